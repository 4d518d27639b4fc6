"""`donation`: a train step holds two copies of its state.

A jitted train step returns new parameters and optimizer state shaped like the ones it was
given. Unless those arguments are donated, the caller still owns the old ones, so XLA
writes the new state beside them: jax-ml/jax#1733, #1273. Donation can also fail, with or
without a warning (#9237, #9675), and a loop that reads a donated buffer's new value costs
a full copy on recent XLA (openxla/xla#45912). The functions below are the reproduction,
its fixes and the checks; copy the one you need.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from .. import _cache, _subprocess
from .._case import _CASES, Case, CaseResult, Variant, measure_case
from .._claims import Claim, verdict
from .._errors import DoesNotFitError, RunbookError
from .._measure import _lowering, compile_fn
from .._pages import cited_reports_table
from .._render import Table, fmt_bytes
from .._runtime import RuntimePeak, runtime_peak

Params = list[jax.Array]

# What the reports say, quoted or summarised; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#1733": "a train step needs enough memory for two copies of the weights",
    "jax-ml/jax#1273": "the peak doubled under jit; with donate_argnums, 'Some donated "
    "buffers were not usable'",
    "jax-ml/jax#9635": "'CPU doesn't support argument donation'",
    "jax-ml/jax#9237, #9675": "donation that does not happen gives only a gentle warning; "
    "users ask for a loud failure",
    "openxla/xla#45912": "since jaxlib 0.7.2 a donated buffer whose new value a loop reads is "
    "no longer updated in place: a temporary the size of the array",
}

OPTIMIZER = optax.adam(1e-3)


def model(params: Params, x: jax.Array) -> jax.Array:
    """A stack of square layers, ``tanh`` between them."""
    for w in params[:-1]:
        x = jnp.tanh(x @ w)
    return x @ params[-1]


def loss(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error of the model."""
    return jnp.mean((model(params, x) - y) ** 2)


def train_step(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """One Adam step: returns ``(new params, new optimizer state, loss)``."""
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def jit_step() -> Any:
    """The reproduction: the train step jitted as it is. The caller still holds the old
    parameters and optimizer state, so XLA writes the new ones beside them."""
    return jax.jit(train_step)


def donated_step() -> Any:
    """Fix (recommended): donate the parameters and the optimizer state. The new state is
    written into the old state's buffers; the old arrays are deleted after the call."""
    return jax.jit(train_step, donate_argnums=(0, 1))


def misnumbered_step() -> Any:
    """A donation that half fails: meant ``(params, opt_state)``, wrote ``(0, 2)``. The
    parameters are donated, the optimizer state is not, and the batch ``x`` (argument 2)
    matches no output: JAX warns about ``x`` only."""
    return jax.jit(train_step, donate_argnums=(0, 2))


def mixed_dtype_update(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """A train step that hands back its new parameters in bfloat16 (say, for a bfloat16
    forward pass next step): donated, the float32 parameters' buffers fit no output."""
    new, opt_state, value = train_step(params, opt_state, x, y)
    return [p.astype(jnp.bfloat16) for p in new], opt_state, value


def update_read_update(x: jax.Array, reads: int = 8) -> jax.Array:
    """openxla/xla#45912's pattern: update a donated array, read the new value in a loop,
    update it again. Each step is elementwise, so all of it could happen in place."""
    a = jnp.exp(x)  # exp: costly enough that XLA does not recompute it in the last fusion
    stride = x.shape[0] // reads
    s: jax.Array = lax.fori_loop(0, reads, lambda i, s: s + a[i * stride], jnp.zeros((), x.dtype))
    return a * s


def update_read_once(x: jax.Array, reads: int = 8) -> jax.Array:
    """`update_read_update` with the reads outside a loop (a strided slice): same result."""
    a = jnp.exp(x)
    return a * jnp.sum(a[:: x.shape[0] // reads][:reads])


@dataclasses.dataclass(frozen=True)
class DonationCheck:
    """What a compiled program did with its donated inputs (`donation_check`).

    Attributes:
        donated: bytes of the arguments marked donated.
        aliased: bytes of outputs the compiled program writes into donated inputs.
        warnings: JAX's "Some donated buffers were not usable" warnings (first lines).
        temp: the program's temporaries, bytes.
        total: the program's total, bytes (argument + output + temp - alias).
    """

    name: str
    donated: int
    aliased: int
    warnings: tuple[str, ...]
    temp: int
    total: int

    @property
    def unused(self) -> int:
        """Donated bytes that no output reuses."""
        return self.donated - self.aliased

    @property
    def silent(self) -> bool:
        """Donated bytes went unused and JAX said nothing."""
        return self.unused > 0 and not self.warnings


def donation_check(
    fn: Callable[..., Any],
    *args: Any,
    name: str | None = None,
    target: str | None = None,
    fresh: bool = True,
) -> DonationCheck:
    """Did donation happen? Compile `fn` (a `jax.jit` with donated arguments) for `args` and
    compare the bytes donated with the bytes the compiled program aliases.

    Args:
        fn: a jitted function, e.g. ``jax.jit(step, donate_argnums=(0, 1))``.
        *args: arrays or `jax.ShapeDtypeStruct`s; nothing is allocated.
        name: label for tables (default: the function's name).
        target: compile for this device (see `runbook.targets()`).
        fresh: clear JAX's caches first (`jax.clear_caches`): JAX warns about unusable
            donations only the first time a program is lowered in a process.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.ShapeDtypeStruct((1024,), jnp.float32)
        >>> check = donation_check(jax.jit(lambda a: a.astype(jnp.bfloat16), donate_argnums=0), x)
        >>> check.donated, check.aliased, check.silent
        (4096, 0, True)
    """
    if fresh:
        with _lowering:  # not while another thread lowers
            jax.clear_caches()  # JAX warns on a program's first lowering in a process only
    unusable: list[str] = []
    compiled = compile_fn(fn, *args, target=target, unusable=unusable)
    stats = compiled.memory_analysis()
    donated = sum(
        math.prod(a.shape) * np.dtype(a.dtype).itemsize
        for a in jax.tree_util.tree_leaves(compiled.args_info)
        if a.donated
    )
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes
    total += stats.temp_size_in_bytes - stats.alias_size_in_bytes
    return DonationCheck(
        name or str(getattr(fn, "__name__", "fn")),
        int(donated),
        int(stats.alias_size_in_bytes),
        tuple(unusable),
        int(stats.temp_size_in_bytes),
        int(total),
    )


def _sizes(scale: Mapping[str, Any]) -> dict[str, int]:
    layers, width, tokens = scale["layers"], scale["width"], scale["tokens"]
    weight = width * width * 4
    return {
        "params": layers * weight,
        "layer": weight,
        "state": 3 * layers * weight,  # the parameters and Adam's two moments
        "batch": 2 * tokens * width * 4,
        "activations": (layers - 1) * tokens * width * 4,
    }


def floor_bytes(scale: Mapping[str, Any]) -> int:
    """What one train step must hold, at the least: the parameters, Adam's two moments and
    its step count, the batch, one layer's gradient (each gradient exists whole before Adam
    uses it; the new state reuses the donated buffers), the activations the backward pass
    needs (each hidden layer's output) and the loss."""
    s = _sizes(scale)
    return s["state"] + 4 + s["batch"] + s["layer"] + s["activations"] + 4


def _params(scale: Mapping[str, Any], concrete: bool) -> list[Any]:
    layers, width = scale["layers"], scale["width"]
    if not concrete:
        return [jax.ShapeDtypeStruct((width, width), jnp.float32) for _ in range(layers)]
    rng = np.random.default_rng(0)
    return [
        jnp.asarray(rng.standard_normal((width, width), dtype=np.float32) / np.sqrt(width))
        for _ in range(layers)
    ]


def _inputs(scale: Mapping[str, Any], p: Mapping[str, Any], concrete: bool) -> tuple[Any, ...]:
    """``(params, opt_state, x, y)``: abstract, or real arrays when `concrete`."""
    params = _params(scale, concrete)
    state = OPTIMIZER.init(params) if concrete else jax.eval_shape(OPTIMIZER.init, params)
    shape = (scale["tokens"], scale["width"])
    if not concrete:
        batch = jax.ShapeDtypeStruct(shape, jnp.float32)
        return params, state, batch, batch
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(shape, dtype=np.float32))
    y = jnp.asarray(0.5 * rng.standard_normal(shape, dtype=np.float32))
    return params, state, x, y


CASE = Case(
    name="donation",
    title="A train step holds two copies of its state",
    symptom="a jitted train step needs twice its parameters and optimizer state",
    devices=1,
    scales={
        "seed": {"layers": 4, "width": 16384, "tokens": 1024},
        "small": {"layers": 4, "width": 2048, "tokens": 512},
        "tiny": {"layers": 2, "width": 64, "tokens": 16},
    },
    variants=(
        Variant("no-donation", "reproduction", "jax.jit(train_step)", lambda p: jit_step()),
        Variant(
            "donated",
            "fix",
            "recommended: donate_argnums=(0, 1), parameters and optimizer state",
            lambda p: donated_step(),
        ),
        Variant(
            "misnumbered",
            "fix",
            "donate_argnums=(0, 2): the batch donated instead of the optimizer state",
            lambda p: misnumbered_step(),
        ),
    ),
    args=_inputs,
    grid=lambda scale: [{"optimizer": "adam"}],
    floor=lambda variant, scale, params: floor_bytes(scale),
    tolerance=1e-5,
    cause="the caller still owns the old parameters and optimizer state, so the new ones "
    "are written beside them unless the arguments are donated",
    recommended="donated",
)

RECOMMENDED = "donated"

LOOP_SCALE = {"seed": 2**28, "small": 2**24, "tiny": 2**10}  # elements of the #45912 array


def check_programs(scale_name: str = "seed") -> list[tuple[str, Any, tuple[Any, ...]]]:
    """The programs `checks` compiles: (label, jitted function, abstract args)."""
    step_args = _inputs(CASE.scales[scale_name], {}, False)
    x = (jax.ShapeDtypeStruct((LOOP_SCALE[scale_name],), jnp.float32),)
    return [
        ("donated_step", donated_step(), step_args),
        ("misnumbered_step", misnumbered_step(), step_args),
        ("mixed_dtype_update", jax.jit(mixed_dtype_update, donate_argnums=(0, 1)), step_args),
        ("update_read_update", jax.jit(update_read_update, donate_argnums=0), x),
        ("update_read_once", jax.jit(update_read_once, donate_argnums=0), x),
    ]


CLAIM_VARIANTS = ("no-donation", RECOMMENDED)
# What the claims need of `checks` on a target (compiling a step for a TPU takes seconds).
CLAIM_CHECKS = ("mixed_dtype_update",)
LOOP_CHECKS = ("update_read_update", "update_read_once")  # 1 GiB at seed: fits every target


def checks(
    scale_name: str = "seed", target: str | None = None, names: Sequence[str] | None = None
) -> list[DonationCheck]:
    """`donation_check` of each program of `check_programs` (or of those in `names`), for
    this backend or `target`."""

    def compute() -> list[dict[str, Any]]:
        return [
            dataclasses.asdict(donation_check(fn, *args, name=label, target=target))
            for label, fn, args in check_programs(scale_name)
            if names is None or label in names
        ]

    request = {"kind": "donation-checks", "scale": scale_name, "target": target,
               "names": list(names) if names else None}  # fmt: skip
    found = _cache.cached(request, compute, module=_CASES["donation"])
    return [DonationCheck(**{**c, "warnings": tuple(c["warnings"])}) for c in found]


def target_checks(target: str) -> Table:
    """`checks` compiled for `target` as a table: at the seed scale, or at the runnable scale
    where a program of the seed scale does not fit one device."""
    reason = ""
    for scale in ("seed", CASE.runnable_scale):
        try:
            found = checks(scale, target=target)
        except DoesNotFitError as e:
            reason = f"; at scale 'seed' a program does not fit ({e})"
            continue
        return check_table(found, f"Compiled for {target}, scale {scale!r}{reason}.")
    raise RunbookError(f"{target}: the checks fit no scale{reason}")


def warnings_per_lowering(times: int = 2) -> list[int]:
    """JAX's "not usable" warnings each time `misnumbered_step` is lowered again in this
    process, after clearing JAX's caches once (tiny scale: the count does not depend on it).
    """
    args = _inputs(CASE.scales["tiny"], {}, False)
    with _lowering:
        jax.clear_caches()
    counts = []
    for _ in range(times):
        unusable: list[str] = []
        compile_fn(misnumbered_step(), *args, unusable=unusable)
        counts.append(len(unusable))
    return counts


def check_table(found: Sequence[DonationCheck], caption: str = "") -> Table:
    """`checks` as a table: donated against aliased bytes, and what JAX said."""
    rows = [
        [
            c.name,
            fmt_bytes(c.donated),
            fmt_bytes(c.aliased),
            fmt_bytes(c.unused),
            fmt_bytes(c.temp),
            "; ".join(w.removeprefix("Some donated buffers were not usable: ") for w in c.warnings)
            or "none",
            "SILENT" if c.silent else ("warned" if c.warnings else "-"),
        ]
        for c in found
    ]
    return Table(
        ["program", "donated", "aliased", "donated, not reused", "temporaries",
         "JAX warned about", "failure"],
        rows,
        caption,
    )  # fmt: skip


def _eager_json(scale: str) -> dict[str, Any]:
    """The train step run op by op (no jit), its resident-set peak: the `_runtime` method."""
    from .._runtime import _settle, _status

    size = CASE.scales[scale]
    jax.block_until_ready(jnp.ones(8) + 1)  # start the runtime's pools
    base = _settle()
    args = jax.block_until_ready(_inputs(size, {}, True))
    _settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with jax.disable_jit():
        jax.block_until_ready(train_step(*args))
    return {"measured": _status("VmHWM") - base}


def eager_peak(scale: str | None = None) -> int:
    """The real peak of `train_step` run without jit, in a fresh process (bytes)."""
    scale = scale or CASE.runnable_scale
    request = {"kind": "donation-eager-peak", "scale": scale}
    call = functools.partial(_subprocess.call, "runbook.cases.donation:_eager_json", scale=scale)
    return int(_cache.cached(request, call, module=_CASES["donation"])["measured"])


def _reuse_json(scale: str) -> dict[str, Any]:
    """Run `donated_step` once on real arrays: are the inputs deleted, and do the new
    parameters and moments sit at the old ones' addresses?"""
    args = _inputs(CASE.scales[scale], {}, True)
    donated = jax.tree_util.tree_leaves(args[:2])
    before = {a.unsafe_buffer_pointer() for a in donated if a.size > 1}
    new_params, new_state, _ = jax.block_until_ready(donated_step()(*args))
    after = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves((new_params, new_state))
             if a.size > 1]  # fmt: skip
    return {
        "donated": len(donated),
        "deleted": sum(a.is_deleted() for a in donated),
        "outputs": len(after),
        "same_address": sum(p in before for p in after),
    }


def reuse(scale: str | None = None) -> dict[str, int]:
    """`donated_step` run for real in a fresh process: ``donated`` and ``deleted`` input
    arrays, ``outputs`` (arrays) and ``same_address`` (outputs at a donated input's address).
    """
    scale = scale or CASE.runnable_scale
    request = {"kind": "donation-reuse", "scale": scale}
    call = functools.partial(_subprocess.call, "runbook.cases.donation:_reuse_json", scale=scale)
    return dict(_cache.cached(request, call, module=_CASES["donation"]))


def peaks(scale: str | None = None) -> list[RuntimePeak]:
    """Every variant run for real in a fresh process (`runbook.runtime_peak`)."""
    return [runtime_peak("donation", v.name, scale=scale) for v in CASE.variants]


def reports_table(result: CaseResult, found: Sequence[DonationCheck]) -> Table:
    """What each report says beside the figure we measure for the same effect."""
    repro, fix = result.one("no-donation"), result.one(RECOMMENDED)
    by = {c.name: c for c in found}
    loop, once = by["update_read_update"], by["update_read_once"]
    mixed, mis = by["mixed_dtype_update"], by["misnumbered_step"]
    ours = [
        (
            f"without donation the step needs {fmt_bytes(repro.total)}: {fmt_bytes(repro.argument)} "
            f"of arguments and {fmt_bytes(repro.output)} of new state beside them; donated, "
            f"{fmt_bytes(fix.total)}"
        ),
        (
            f"jit without donation needs {repro.total / fix.total:.2f}x the donated step (op by "
            f"op against jit: see the claims); a misnumbered donation draws {len(mis.warnings)} warning(s) and saves only {fmt_bytes(mis.aliased)}"
        ),
        (
            f"on this CPU the donated step aliases {fmt_bytes(fix.alias)} of "
            f"{fmt_bytes(by['donated_step'].donated)} donated"
        ),
        (
            f"mixed_dtype_update: {fmt_bytes(mixed.unused)} donated and not reused, "
            f"{len(mixed.warnings)} warnings"
        ),
        (
            f"temporaries: {fmt_bytes(loop.temp)} with the loop, {fmt_bytes(once.temp)} without "
            f"(the array is {fmt_bytes(loop.donated)})"
        ),
    ]
    return cited_reports_table(
        REPORTS, ours, f"{result.provenance.label()}; compile time, {result.scale} scale."
    )


def claims(
    result: CaseResult | None = None,
    found: Sequence[DonationCheck] | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
    runs: Mapping[str, Any] | None = None,
) -> list[Claim]:
    """The claims of the reports, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        found: `checks` for the same compiler (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
        runs: real runs on this machine, ``{"peaks": [RuntimePeak], "eager": bytes,
            "reuse": reuse()}``; measured here on this backend when not given, never for a
            target.
    """
    # buffers=True for a target: the accelerator section measured the same programs so
    result = result or measure_case(
        "donation", scale, target=target, buffers=target is not None, variants=CLAIM_VARIANTS
    )
    target = result.provenance.target or None
    if found is None:
        found = checks(result.scale, target=target, names=CLAIM_CHECKS)
        found += checks("seed", target=target, names=LOOP_CHECKS)
    if runs is None and target is None:
        runs = {"peaks": peaks(), "eager": eager_peak(), "reuse": reuse()}
    where = f"compiled for {target}" if target else "on this CPU"
    repro, fix = result.one("no-donation"), result.one(RECOMMENDED)
    state = _sizes(CASE.scales[result.scale])["state"]
    by = {c.name: c for c in found}
    out = []

    evidence = (
        f"{where} the donated step aliases {fmt_bytes(fix.alias)} (the state is "
        f"{fmt_bytes(state)}) and needs {fmt_bytes(fix.total)} against {fmt_bytes(repro.total)}."
    )
    works = fix.alias >= 0.99 * state
    if runs:
        r = runs["reuse"]
        run = {p.name: p for p in runs["peaks"]}
        evidence += (
            f" Run for real ({CASE.runnable_scale} scale, fresh process): {r['deleted']} of "
            f"{r['donated']} donated arrays deleted, {r['same_address']} of {r['outputs']} new "
            f"arrays at a donated array's address; peak {fmt_bytes(run[RECOMMENDED].measured)} "
            f"donated against {fmt_bytes(run['no-donation'].measured)}."
        )
        works = works and r["same_address"] == r["outputs"] > 0
        works = works and run[RECOMMENDED].measured < run["no-donation"].measured
    out.append(
        Claim(
            "cpu",
            "Donation does not work on CPU (jax-ml/jax#9635).",
            verdict(not works),
            evidence,
        )
    )

    out.append(
        Claim(
            "two-copies",
            "Without donation a train step holds two copies of its state (jax-ml/jax#1733).",
            verdict(repro.alias == 0 and repro.output >= 0.99 * state),
            f"{where}: {fmt_bytes(repro.argument)} of arguments and {fmt_bytes(repro.output)} "
            f"of outputs, nothing aliased: {fmt_bytes(repro.total)}, {repro.total / fix.total:.2f}x "
            f"the donated step (the state is {fmt_bytes(state)}).",
        )
    )

    evidence = (
        f"{where}, jit without donation: {fmt_bytes(repro.temp)} of temporaries, but the new "
        f"state beside the old: {fmt_bytes(repro.total)}, {repro.total / fix.total:.2f}x the "
        "donated step."
    )
    lower = None
    if runs:
        run = {p.name: p for p in runs["peaks"]}
        jitted = run["no-donation"].measured
        lower = jitted < 0.9 * runs["eager"]
        evidence += (
            f" Real peaks ({CASE.runnable_scale} scale, fresh processes): op by op without jit "
            f"{fmt_bytes(runs['eager'])}, jit {fmt_bytes(jitted)} "
            f"({jitted / runs['eager']:.2f}x), jit donated "
            f"{fmt_bytes(run[RECOMMENDED].measured)}."
        )
    else:
        evidence += " Deciding needs a real op-by-op run on the device; none here."
    out.append(
        Claim(
            "fusion",
            "jit lowers a train step's memory through fusion (jax-ml/jax#1273 saw the peak "
            "double under jit).",
            "not reproducible here" if lower is None else verdict(lower),
            evidence,
        )
    )

    silent = [c for c in found if c.silent]
    counts = warnings_per_lowering()
    out.append(
        Claim(
            "warns",
            "JAX warns whenever donation fails (what jax-ml/jax#9237 and #9675 rely on).",
            verdict(not silent),
            f"{where}: "
            + "; ".join(
                f"{c.name}: {fmt_bytes(c.unused)} donated and not reused, "
                + (f"{len(c.warnings)} warning(s)" if c.warnings else "no warning")
                for c in found
                if c.unused > 0
            )
            + f". And JAX warns once per program and process: lowered {len(counts)} times, "
            f"misnumbered_step drew {', '.join(map(str, counts))} warning(s).",
        )
    )

    loop, once = by["update_read_update"], by["update_read_once"]
    copied = loop.temp >= 0.99 * loop.donated
    because = (
        "the same reads without a loop copy it too: the loop is not the cause here"
        if once.temp >= 0.99 * once.donated
        else "without the loop nothing is copied"
    )
    out.append(
        Claim(
            "loop-copy",
            "A donated array whose new value a loop reads is no longer updated in place: "
            "a temporary the size of the array (openxla/xla#45912, since jaxlib 0.7.2).",
            verdict(copied),
            f"{where}: update_read_update {fmt_bytes(loop.temp)} of temporaries, "
            f"update_read_once {fmt_bytes(once.temp)}; the array is {fmt_bytes(loop.donated)}, "
            f"aliased {fmt_bytes(loop.aliased)}" + (f"; {because}." if copied else "."),
        )
    )
    return out
