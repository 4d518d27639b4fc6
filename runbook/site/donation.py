"""The `donation` page's measurements: the check that a donation happened, the checks of
the case's programs, real runs, the claims and the tables. The case itself (the train
step, its fixes, the ways donation fails) is `runbook.cases.donation`, which this module
measures.
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

from .. import _cache, _subprocess
from .._case import CaseResult, measure_case
from .._errors import DoesNotFitError, RunbookError
from .._measure import _lowering, compile_fn, measure
from .._render import Table, fmt_bytes
from .._runtime import RuntimePeak, runtime_peak
from ..cases import donation
from ..cases.donation import (
    LOOP_SCALE,
    _inputs,
    _sizes,
    donated_step,
    misnumbered_step,
    mixed_dtype_update,
    train_step,
    update_read_once,
    update_read_update,
)
from ._claims import Claim, verdict
from ._pages import cited_reports_table

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

RECOMMENDED = "donated"


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


def check_programs(scale_name: str = "seed") -> list[tuple[str, Any, tuple[Any, ...]]]:
    """The programs `checks` compiles: (label, jitted function, abstract args)."""
    step_args = _inputs(donation.CASE.scales[scale_name], {}, False)
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
    found = _cache.cached(request, compute, module=__name__)
    return [DonationCheck(**{**c, "warnings": tuple(c["warnings"])}) for c in found]


def target_checks(target: str) -> Table:
    """`checks` compiled for `target` as a table: at the seed scale, or at the runnable scale
    where a program of the seed scale does not fit one device."""
    reason = ""
    for scale in ("seed", donation.CASE.runnable_scale):
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
    args = _inputs(donation.CASE.scales["tiny"], {}, False)
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
    from .._host import settle, status

    size = donation.CASE.scales[scale]
    jax.block_until_ready(jnp.ones(8) + 1)  # start the runtime's pools
    base = settle()
    args = jax.block_until_ready(_inputs(size, {}, True))
    settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    with jax.disable_jit():
        jax.block_until_ready(train_step(*args))
    return {"measured": status("VmHWM") - base}


def eager_peak(scale: str | None = None) -> int:
    """The real peak of `train_step` run without jit, in a fresh process (bytes)."""
    scale = scale or donation.CASE.runnable_scale
    request = {"kind": "donation-eager-peak", "scale": scale}
    call = functools.partial(_subprocess.call, "runbook.site.donation:_eager_json", scale=scale)
    return int(_cache.cached(request, call, module=__name__)["measured"])


def _reuse_json(scale: str) -> dict[str, Any]:
    """Run `donated_step` once on real arrays: are the inputs deleted, and do the new
    parameters and moments sit at the old ones' addresses?"""
    args = _inputs(donation.CASE.scales[scale], {}, True)
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
    scale = scale or donation.CASE.runnable_scale
    request = {"kind": "donation-reuse", "scale": scale}
    call = functools.partial(_subprocess.call, "runbook.site.donation:_reuse_json", scale=scale)
    return dict(_cache.cached(request, call, module=__name__))


def peaks(scale: str | None = None) -> list[RuntimePeak]:
    """Every variant run for real in a fresh process (`runbook.runtime_peak`)."""
    return [runtime_peak("donation", v.name, scale=scale) for v in donation.CASE.variants]


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


def debug_nans_aliases(scale: str = "seed", target: str | None = None) -> dict[str, int]:
    """The recommended step's aliased bytes compiled with ``jax_debug_nans`` off, on (a
    step traced afresh) and ``kept`` (the step traced with it off, lowered again once on).
    """
    case = donation.CASE
    size = case.scales[scale]
    v = case.variant(RECOMMENDED)
    args = case.inputs(v, size, case.grid(size)[0], False)

    def traced(flag: bool, step: Any = None) -> int:
        # JAX's own context: the flag is set for this thread alone. Set process-wide, it
        # turned donation off in the programs other targets' threads traced meanwhile
        # (`claims_by_target`), and the store held a different one each build.
        with jax.debug_nans(flag):
            step = step or jax.jit(lambda *a: donation.train_step(*a), donate_argnums=(0, 1))
            return measure(step, *args, target=target, name="donated_step").alias

    earlier = jax.jit(lambda *a: donation.train_step(*a), donate_argnums=(0, 1))
    off = traced(False, earlier)
    # "kept": the step traced with the flag off, lowered again once it is on
    return {"off": off, "on": traced(True), "kept": traced(True, earlier)}


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
    state = _sizes(donation.CASE.scales[result.scale])["state"]
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
            f" Run for real ({donation.CASE.runnable_scale} scale, fresh process): "
            f"{r['deleted']} of {r['donated']} donated arrays deleted, {r['same_address']} of {r['outputs']} new "
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
            f" Real peaks ({donation.CASE.runnable_scale} scale, fresh processes): op by op "
            f"without jit {fmt_bytes(runs['eager'])}, jit {fmt_bytes(jitted)} "
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

    nans = debug_nans_aliases(result.scale, target)
    out.append(
        Claim(
            "debug-nans",
            "jax_debug_nans turns donation off (jax-ml/jax#12514, PR #13144; #13789, #33949).",
            verdict(nans["off"] > 0 and nans["on"] == 0),
            f"{where}: donated_step traced with jax_debug_nans off aliases "
            f"{fmt_bytes(nans['off'])}, with it on {fmt_bytes(nans['on'])}; the same step traced "
            f"with it off and lowered again once it is on aliases {fmt_bytes(nans['kept'])}.",
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
