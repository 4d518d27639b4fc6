"""Real peaks: execute a variant in a fresh process and read what it really used.

GPU: the allocator's ``peak_bytes_in_use`` (per device, inputs included; so are the compile's
autotuning and the making of the inputs, each peak recorded apart as it stood then).
CPU: the process's resident-set high-water mark during the run, minus the resident set
before the inputs were made. It includes the inputs, the outputs, XLA's temporaries and
anything the runtime allocates on the side (thread-pool stacks, kernel scratch); it counts
all simulated devices together, so we divide by the device count for a per-device figure.
A child forked from `runbook._forkserver` maps the shared libraries' code afresh, page by
page as it runs: the pages the run touches count, a few MiB more than in a new Python,
which touched them while importing, before the resident set was read.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

from . import _cache, _subprocess
from ._errors import WontFitError
from ._host import available_bytes, one_real_run_at_a_time, settle, status

# Prediction and measurement agree when within this fraction plus this slack per device.
REL_TOLERANCE = 0.10
ABS_TOLERANCE = 16 * 2**20
# Never plan to use more than this share of what the machine reports available.
SAFETY = 0.7
# Timed runs stop once they add up to this: one run of a slow program is timing enough.
TIMING_SECONDS = 1.0


def agreement() -> str:
    """The agreement rule between a measured peak and its prediction, in words."""
    return f"within {REL_TOLERANCE:.0%} + {ABS_TOLERANCE // 2**20} MiB per device"


def agrees(measured: int, predicted: int) -> bool:
    """Whether a measured peak agrees with its prediction (`agreement`)."""
    return abs(measured - predicted) <= REL_TOLERANCE * predicted + ABS_TOLERANCE


@dataclasses.dataclass(frozen=True)
class RuntimePeak:
    """A measured peak beside its compile-time prediction, both per device."""

    name: str
    params: Mapping[str, Any]
    predicted: int
    measured: int
    seconds: float
    method: str
    compiler_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # GPU: the allocator's peak once the program was compiled, before any input existed
    # (XLA's autotuner tries kernels, cuDNN convolutions, with workspaces of their own), and
    # once the inputs were made, before the run. `measured`, the process's peak, includes
    # both: the allocator's peak cannot be reset. None on CPU.
    compile_peak: int | None = None
    inputs_peak: int | None = None

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def agrees(self) -> bool:
        return agrees(self.measured, self.predicted)


def run_compiled(
    compiled: Any,
    make_args: Callable[[], Any],
    *,
    devices_needed: int = 1,
    what: str = "the program",
    hint: str = "",
) -> tuple[dict[str, Any], Any, float]:
    """Execute `compiled` once on the inputs `make_args()` makes, and read its peak.

    Refuses (`WontFitError`) before making any input when the compile-time total is more
    than `SAFETY` of what this machine allows. Call it in a fresh process: the GPU
    allocator's peak cannot be reset.

    Returns:
        (figures, args, seconds): ``predicted``, ``measured``, ``method``,
        ``compile_peak`` and ``inputs_peak`` (bytes per device); the inputs (a program that
        donates them has used them up) and the run's seconds.
    """
    import jax
    import jax.numpy as jnp

    devices = jax.local_devices()
    gpu = devices[0].platform != "cpu"
    stats = compiled.memory_analysis()
    predicted = stats.argument_size_in_bytes + stats.output_size_in_bytes
    predicted += stats.temp_size_in_bytes - stats.alias_size_in_bytes
    if gpu:
        limit = min(d.memory_stats()["bytes_limit"] for d in devices[:devices_needed])
        need, where = predicted, f"{devices[0].device_kind} ({limit:,} bytes usable)"
    else:
        limit = available_bytes()
        need, where = predicted * devices_needed, f"this host ({limit:,} bytes available)"
    if need > SAFETY * limit:
        raise WontFitError(
            f"refusing to run {what}: it needs {need:,} bytes and {where} allows "
            f"{int(SAFETY * limit):,}. {hint}".rstrip()
        )
    compile_peak = devices[0].memory_stats()["peak_bytes_in_use"] if gpu else None
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(8)))  # start the runtime's pools
    if not gpu:
        base = settle()
    args = jax.block_until_ready(make_args())
    inputs_peak = devices[0].memory_stats()["peak_bytes_in_use"] if gpu else None
    if not gpu:
        settle()  # making the inputs leaves freed host buffers behind
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current resident set
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    seconds = time.perf_counter() - start
    used = len(jax.tree_util.tree_leaves(out)[0].sharding.device_set)  # 1 for a serial program
    if gpu:
        measured = max(d.memory_stats()["peak_bytes_in_use"] for d in devices[:used])
        method = "gpu peak_bytes_in_use"
    else:
        measured = (status("VmHWM") - base) // used
        method = "cpu resident-set peak / devices used"
    figures = {
        "predicted": int(predicted), "measured": int(measured), "method": method,
        "compile_peak": compile_peak, "inputs_peak": inputs_peak,
    }  # fmt: skip
    return figures, args, seconds


def _peak_json(
    name: str,
    variant: str,
    scale: str,
    params: dict[str, Any],
    options: Mapping[str, Any] | None,
    repeats: int,
) -> dict[str, Any]:
    import jax

    from ._case import get_case
    from ._measure import compile_fn

    case = get_case(name)
    v = case.variant(variant)
    size = case.scale(scale)
    options = case.options() if options is None else options
    # Predict first, on abstract inputs: refuse before allocating anything.
    abstract = case.inputs(v, size, params, False)
    compiled = compile_fn(v.program(params), *abstract, compiler_options=options)
    found, args, first = run_compiled(
        compiled,
        lambda: case.inputs(v, size, params, True),
        devices_needed=case.devices,
        what=f"{name}/{variant} at scale {scale!r}",
        hint="Use a smaller scale.",
    )
    # A measured run that alone takes TIMING_SECONDS is its own timing.
    times = [first] if repeats and first >= TIMING_SECONDS else []
    while len(times) < repeats and sum(times) < TIMING_SECONDS:
        if any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(args)):
            # The program donated its inputs (a train step): time it on fresh ones.
            args = jax.block_until_ready(case.inputs(v, size, params, True))
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return {
        "name": variant,
        "params": params,
        **found,
        "seconds": min(times) if times else 0.0,
        "compiler_options": options,
    }


def runtime_peak(
    case: str,
    variant: str,
    *,
    scale: str | None = None,
    params: Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    repeats: int = 3,
) -> RuntimePeak:
    """Execute one variant for real in a fresh process and measure its peak.

    Refuses (`WontFitError`) when the compile-time prediction exceeds the memory available.

    Args:
        case: a case name.
        variant: one of the case's variants.
        scale: defaults to the case's runnable scale.
        params: the grid point; defaults to the first point of the grid.
        compiler_options: XLA options replacing the case's own (``{}``: XLA's defaults).
        repeats: at most this many timed executions after the measured one, fewer once
            they add up to a second; a measured run of a second or more is its own timing
            (the fastest is reported).
    """
    from ._case import _CASES, get_case

    c = get_case(case)
    c.variant(variant)
    scale = scale or c.runnable_scale
    size = c.scale(scale)
    params = dict(params if params is not None else c.grid(size)[0])
    request = {
        "kind": "runtime-peak", "case": case, "variant": variant, "scale": scale,
        "params": params, "options": None if compiler_options is None else dict(compiler_options),
        "repeats": repeats,
    }  # fmt: skip

    def run() -> dict[str, Any]:
        with one_real_run_at_a_time():
            reply: dict[str, Any] = _subprocess.call(
                "runbook._runtime:_peak_json", devices=c.devices, name=case, variant=variant,
                scale=scale, params=params, options=request["options"], repeats=repeats,
            )  # fmt: skip
            return reply

    data = _cache.cached(request, run, module=_CASES[case])
    return RuntimePeak(**data)
