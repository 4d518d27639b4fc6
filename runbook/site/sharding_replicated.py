"""The `sharding-replicated` page: the reports beside our figures, what placement JAX gives
an axis the mesh does not divide, creating the state sharded against on one device, and
the claims. The reproduction and its fixes are in `runbook.cases.sharding_replicated`."""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _cache, _case_types, _subprocess, _targets
from .._case import CaseResult, measure_case
from .._fit import fit
from .._measure import measure
from .._render import Table, fmt_bytes
from ..cases._setup import sharding_replicated as setup
from ..cases.sharding_replicated import (
    AXIS,
    CASE,
    DEVICES,
    fsdp,
    init,
    jit_step,
    optimizer,
    replicated,
    scanned_train_step,
    state_bytes,
    train_step,
)
from ._claims import Claim, verdict
from ._history import Note
from ._pages import cited_reports_table

# What the reports say, summarised; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#14075": "an array created on one device and then sharded over 8 devices can "
    "only be about half as large as what one device holds",
    "jax-ml/jax#16679": "creating a 6B-parameter model's Adam state with pjit and "
    "out_shardings runs out of memory where device_put of the same state does not",
    "jax-ml/jax#19893": "initializing one large random parameter inside jit with a sharded "
    "output runs out of memory: sharding it does not help",
    "jax-ml/jax#26946": "a sharding constraint on an axis the mesh does not divide silently "
    "replicates the array instead of sharding it",
    "the issue commissioning this case (jax 0.10.2)": "16 layers of 8192x8192 with Adam on 8 "
    "devices: 12 GiB of arguments per device replicated, 1.5 GiB sharded; 8 GiB of "
    "temporaries in both",
}

ODD_ROWS = 8 * 1024 + 1  # #26946: an axis 8 devices do not divide
COLUMNS = 1024


def _on_mesh(name: str, **kwargs: Any) -> Any:
    """`name(**kwargs)` with `DEVICES` devices: forced in a child on a CPU that lacks them."""
    fn = globals()[name]
    if kwargs.get("target") is None and jax.device_count() < DEVICES:
        return _subprocess.call(f"{__name__}:{name}", devices=DEVICES, **kwargs)
    return fn(**kwargs)


def _mesh() -> Mesh:
    return Mesh(np.array(_case_types.devices(DEVICES)), (AXIS,))


def _indivisible_json(concrete: bool) -> list[dict[str, Any]]:
    """A (rows, COLUMNS) array made inside `jit` and constrained to ``P(AXIS, None)``, for
    rows the devices do not divide and rows they do."""
    mesh = _mesh()
    sharding = NamedSharding(mesh, P(AXIS, None))
    found = []
    for rows in (ODD_ROWS, ODD_ROWS - 1):

        def make(rows: int = rows) -> jax.Array:
            x = jnp.arange(rows * COLUMNS, dtype=jnp.float32).reshape(rows, COLUMNS)
            out: jax.Array = jax.lax.with_sharding_constraint(x, sharding)
            return out

        compiled = jax.jit(make).lower().compile()
        stats = compiled.memory_analysis()
        assert stats is not None
        out = compiled.output_shardings
        one: dict[str, Any] = {
            "rows": rows,
            "whole": rows * COLUMNS * 4,
            "output": int(stats.output_size_in_bytes),
            "replicated": bool(out.is_fully_replicated),
            "spec": str(getattr(out, "spec", out)),
        }
        if concrete:  # device_put of the same array to the same sharding, for real
            try:
                jax.device_put(np.zeros((rows, COLUMNS), np.float32), sharding)
                one["device_put"] = "accepted"
            except ValueError as e:
                one["device_put"] = f"refused: {str(e).splitlines()[0][:120]}"
        found.append(one)
    return found


def _cpu_json() -> dict[str, Any]:
    """Everything this page decides on `DEVICES` CPU devices, in one process: the case at
    the issue's scale, #26946's placement, and where `init` puts the state."""
    issue = measure_case(CASE.name, "issue", variants=["replicated", "fsdp"])
    return {
        "issue": issue.to_json(),
        "indivisible": _indivisible_json(concrete=True),
        "init": _init_json("issue", None),
    }


@functools.cache  # once per process, and across processes in the measurement cache
def cpu_experiments() -> dict[str, Any]:
    """`_cpu_json` over `DEVICES` CPU devices (forced in one child where this process has
    fewer): every target's claims read the same CPU figures."""
    request = {
        "kind": "sharding-cpu", "rows": ODD_ROWS, "columns": COLUMNS, "devices": DEVICES,
        "issue": dict(CASE.scale("issue")),
    }  # fmt: skip
    found: dict[str, Any] = _cache.cached(
        request, functools.partial(_on_mesh, "_cpu_json"), module=__name__
    )
    return found


def indivisible() -> list[dict[str, Any]]:
    """jax-ml/jax#26946 on this JAX, over `DEVICES` (forced) CPU devices: an axis they do not
    divide, then one they do: per device, the output's bytes, its sharding, and what
    `device_put` to the same sharding does."""
    found: list[dict[str, Any]] = cpu_experiments()["indivisible"]
    return found


def indivisible_table(found: list[dict[str, Any]], caption: str = "") -> Table:
    rows = [
        [f"{f['rows']:,} x {COLUMNS:,}", "yes" if f["rows"] % DEVICES == 0 else "no",
         fmt_bytes(f["whole"]), fmt_bytes(f["output"]), f"{f['whole'] / f['output']:.2f}x",
         "yes" if f["replicated"] else "no", f["device_put"]]
        for f in found
    ]  # fmt: skip
    return Table(
        ["array", f"rows divide by {DEVICES}", "whole array", "per device, constrained in jit",
         "whole / per device", "replicated", "device_put to the same sharding"],
        rows,
        caption,
    )  # fmt: skip


def _init_json(scale: str, target: str | None) -> dict[str, Any]:
    """The state made by `init` on one device, and made sharded (`out_shardings`)."""
    size = CASE.scale(scale)
    layers, width = size["layers"], size["width"]
    make = functools.partial(init, layers=layers, width=width)
    with _targets.compiling_for(target):
        key = jax.eval_shape(lambda: jax.random.key(0))
        one = _case_types.devices(1)[0]
        placed = jax.ShapeDtypeStruct(
            key.shape, key.dtype, sharding=jax.sharding.SingleDeviceSharding(one)
        )
        whole = measure(make, placed, name="one device", target=target)
        mesh = _mesh()
        shapes = jax.eval_shape(make, key)
        shardings = (fsdp(mesh, shapes[0]), fsdp(mesh, shapes[1]))
        spread = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
        sharded = measure(
            jax.jit(make, out_shardings=shardings), spread, name="sharded", target=target
        )
    return {
        "one": {"output": whole.output, "temp": whole.temp},
        "sharded": {"output": sharded.output, "temp": sharded.temp},
    }


def init_placement() -> dict[str, Any]:
    """Creating the state at the issue's scale: with `init` on one device (then a
    `device_put` would split it) against `jit(init, out_shardings=...)`, per device,
    compiled on CPU devices (nothing allocated)."""
    found: dict[str, Any] = cpu_experiments()["init"]
    return found


def init_table(found: dict[str, Any], scale: str = "issue", caption: str = "") -> Table:
    rows = [
        ["init on one device (then device_put)", "1", fmt_bytes(found["one"]["output"]),
         fmt_bytes(found["one"]["temp"])],
        ["jit(init, out_shardings=fsdp(...))", str(DEVICES),
         fmt_bytes(found["sharded"]["output"]), fmt_bytes(found["sharded"]["temp"])],
    ]  # fmt: skip
    return Table(
        ["how the state is created", "devices", "state per device", "temporaries per device"],
        rows,
        caption or f"The whole state is {fmt_bytes(state_bytes(CASE.scale(scale)))}.",
    )


def prefetch(
    targets: list[str], scale: str = "seed", slices: tuple[str, ...] = ()
) -> list[concurrent.futures.Future[Any]]:
    """Start compiling every variant for each of `targets`, and `slice_fits(slices)`, in
    background threads.

    The page's first cells wait on child processes for the CPU figures; the targets'
    compiles (the slowest, one thread each) overlap with them, and the accelerator section
    reads their results from the measurement cache. Wait on the futures before it.
    """
    pool = concurrent.futures.ThreadPoolExecutor(max(1, len(targets) + bool(slices)))
    jobs: list[concurrent.futures.Future[Any]] = [
        pool.submit(
            contextvars.copy_context().run, measure_case, CASE.name, scale, target=t, buffers=True
        )
        for t in targets
        if _targets.unavailable(t) is None
    ]
    if slices:
        jobs.append(pool.submit(contextvars.copy_context().run, slice_fits, slices, scale))
    pool.shutdown(wait=False)
    return jobs


# --- on a pod slice: the whole slice's devices, not the case's 8 ------------------------

SLICES = ("v5e-16", "h100x8")  # a TPU pod slice and a GPU host
# each variant's step, placement and whether its layers are stacked, as the case builds it
_STEPS: dict[str, tuple[Callable[..., Any], Callable[..., Any], bool]] = {
    "replicated": (train_step, replicated, False),
    "fsdp": (train_step, fsdp, False),
    "fsdp-scan": (scanned_train_step, fsdp, True),
}


def _slice_json(name: str, variant: str, scale: str) -> dict[str, Any]:
    """The case's `variant` step at `scale` over every device of the slice `name`: its fit."""
    step, place, stacked = _STEPS[variant]
    size = CASE.scale(scale)
    slice_ = _targets.get_target(name)
    inputs = setup.Inputs(slice_.devices, AXIS, optimizer, init, jit_step)
    # Inside, the case's mesh is the slice's devices, as `runbook.slice_mesh(name, AXIS)`.
    with _targets.compiling_for(slice_):
        fn = inputs.program(step, place, stacked)(size)
        args = inputs.args(place, stacked)(size, size, False)
    found = fit(fn, *args, target=slice_, name=variant)
    return {"slice": name, "variant": variant, "verdict": str(found), **found.to_json()}


@functools.cache  # once per process (prefetch's thread, then the page), and in the cache
def slice_fits(
    slices: tuple[str, ...] = SLICES, scale: str = "seed", variants: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The reproduction and the recommended fix (or `variants`) at `scale` on each of
    `slices` whose compiler this machine has, their state split over all of its devices:
    bytes per device and whether they fit (`runbook.fit`), in the measurement cache."""
    chosen = variants or ("replicated", str(CASE.recommended))
    found = []
    for name in slices:
        if _targets.unavailable(name) is not None:
            continue
        request = {
            "kind": "sharding-slice", "slice": name, "scale": dict(CASE.scale(scale)),
            "variants": list(chosen),
        }  # fmt: skip
        compute = functools.partial(lambda n: [_slice_json(n, v, scale) for v in chosen], name)
        found += _cache.cached(request, compute, module=__name__)
    return found


def slice_table(found: list[dict[str, Any]], slices: tuple[str, ...] = SLICES) -> Table | Note:
    """`slice_fits` as a table: slice, program, bytes per device, verdict; a note for the
    slices this machine has no compiler for."""
    missing = "; ".join(f"{n}: {why}" for n in slices if (why := _targets.unavailable(n)))
    if not found:
        return Note(f"No slice figures on this build: {missing}.")
    rows = []
    for f in found:
        t = _targets.get_target(f["slice"])
        needed = fmt_bytes(f["needed"])
        if f["refused"]:  # the compiler stopped at its first check: a lower bound
            needed = f"at least {needed} (the compiler refused it)"
        rows.append([f"{t.name}: {t.devices} x {t.label}", f["variant"], needed, f["verdict"]])
    usable = {f["slice"]: f["usable"] for f in found}
    caption = (
        "Per device, compiled for every device of the slice without the devices (a "
        "prediction). Usable per device: "
        + "; ".join(
            f"{n}: {fmt_bytes(b)} ({_targets.get_target(n).usable_rule()})"
            for n, b in usable.items()
        )
        + "."
        + (f" Not compiled on this build: {missing}." if missing else "")
    )
    return Table(["slice", "program", "per device", "verdict"], rows, caption)


def issue_scale() -> CaseResult:
    """The reproduction and the unscanned fix at the issue's own scale, on CPU devices."""
    return CaseResult.from_json(cpu_experiments()["issue"])


def reports_table(result: CaseResult) -> Table:
    issue = issue_scale()
    rep, fs = issue.one("replicated"), issue.one("fsdp")
    init_found = init_placement()
    odd = indivisible()[0]
    ours = [
        (
            f"creating the state on one device needs {fmt_bytes(init_found['one']['output'])} "
            f"there; created sharded, {fmt_bytes(init_found['sharded']['output'])} per device"
        ),
        (
            f"created sharded with jit(out_shardings): {fmt_bytes(init_found['sharded']['output'])}"
            " per device (#16679's state was a closure constant: see the closure-constant case)"
        ),
        (
            f"created sharded, per device: {fmt_bytes(init_found['sharded']['output'])} of state"
            f" and {fmt_bytes(init_found['sharded']['temp'])} of temporaries, of "
            f"{fmt_bytes(state_bytes(CASE.scale('issue')))} whole (random normal layers; "
            "the random bits themselves: see the prng-temporaries case)"
        ),
        (
            f"{odd['rows']:,} rows over {DEVICES} devices: {fmt_bytes(odd['output'])} per device "
            f"of {fmt_bytes(odd['whole'])} ({'replicated' if odd['replicated'] else 'not replicated'}); "
            f"device_put {odd['device_put'].split(':')[0]}"
        ),
        (
            f"{fmt_bytes(rep.argument)} replicated, {fmt_bytes(fs.argument)} sharded; temporaries "
            f"{fmt_bytes(rep.temp)} replicated, {fmt_bytes(fs.temp)} sharded"
        ),
    ]
    return cited_reports_table(REPORTS, ours, issue.provenance.label())


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The reports' claims and the common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.

    How JAX places an axis the mesh does not divide, and where `init` puts the state, are
    JAX's decisions before any compiler: those two are decided on this machine's CPU
    devices for every target.
    """
    result = result or measure_case(CASE.name, scale, target=target)
    rep, fs, scan = (result.one(n) for n in ("replicated", "fsdp", "fsdp-scan"))
    size = CASE.scale(result.scale)
    params = state_bytes(size) // 3
    odd, even = indivisible()
    made = init_placement()
    whole = state_bytes(CASE.scale("issue"))
    return [
        Claim(
            "sharding-divides",
            f"Sharding the parameters and the optimizer state over {DEVICES} devices divides "
            "each device's state by the mesh size.",
            verdict(rep.argument >= 0.95 * DEVICES * fs.argument),
            f"arguments per device: {fmt_bytes(rep.argument)} replicated, "
            f"{fmt_bytes(fs.argument)} sharded ({rep.argument / fs.argument:.2f}x); totals "
            f"{fmt_bytes(rep.total)} and {fmt_bytes(fs.total)}.",
        ),
        Claim(
            "temporaries-stay",
            "Sharding the state does not shrink the step's temporaries.",
            verdict(fs.temp >= 0.9 * rep.temp),
            f"temporaries per device: {fmt_bytes(rep.temp)} replicated, {fmt_bytes(fs.temp)} "
            "sharded.",
        ),
        Claim(
            "all-layers-gathered",
            "Sharded, without scanning, the temporaries hold every layer's gathered weights "
            "at once.",
            verdict(fs.temp >= 0.9 * params),
            f"{fmt_bytes(fs.temp)} of temporaries per device, against "
            f"{fmt_bytes(params)} for every layer's weights whole.",
        ),
        Claim(
            "scan-checkpoint-fixes",
            "Scanning the stacked layers with jax.checkpoint removes the gathered weights: "
            "the step then needs little more than its floor.",
            verdict(scan.temp <= 0.5 * fs.temp and scan.total <= 1.25 * scan.lower_bound),
            f"temporaries {fmt_bytes(scan.temp)} scanned against {fmt_bytes(fs.temp)} "
            f"unrolled; total {fmt_bytes(scan.total)}, {scan.overhead:.3f}x its floor.",
        ),
        Claim(
            "indivisible-replicated",
            "A sharding constraint on an axis the mesh does not divide silently replicates "
            "the array (jax-ml/jax#26946).",
            verdict(odd["replicated"] and odd["output"] >= odd["whole"]),
            f"decided on CPU: {odd['rows']:,} rows give {fmt_bytes(odd['output'])} per device "
            f"of {fmt_bytes(odd['whole'])}, {odd['spec']}; {even['rows']:,} rows give "
            f"{fmt_bytes(even['output'])}. device_put of the odd one: {odd['device_put']}.",
        ),
        Claim(
            "init-sharded-whole",
            "Creating large random parameters inside jit with sharded outputs still needs "
            "them whole on a device: sharding does not help (jax-ml/jax#19893).",
            verdict(made["sharded"]["output"] + made["sharded"]["temp"] >= whole // 3),
            f"decided on CPU at the issue's scale: jit(init, out_shardings=...) holds "
            f"{fmt_bytes(made['sharded']['output'])} of state and "
            f"{fmt_bytes(made['sharded']['temp'])} of temporaries per device, against "
            f"{fmt_bytes(whole // 3)} for the parameters whole.",
        ),
        Claim(
            "init-one-device",
            "Creating the state on one device and then calling device_put needs the whole "
            "state on that device (jax-ml/jax#14075).",
            verdict(made["one"]["output"] >= whole),
            f"decided on CPU at the issue's scale: init on one device outputs {fmt_bytes(made['one']['output'])}; "
            f"jit(init, out_shardings=...) {fmt_bytes(made['sharded']['output'])} per device.",
        ),
    ]
