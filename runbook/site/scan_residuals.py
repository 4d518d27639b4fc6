"""The `scan-residuals` page's machinery: the reports' claims decided, what reverse mode
saves (read from `print_saved_residuals`), the tables beside them, and the programs only
the claims measure (the loop unrolled, scans in sequence).

The reproduction and its fixes are in `runbook.cases.scan_residuals`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import print_saved_residuals

from .._buffers import _short_path
from .._case import CaseResult, measure_case
from .._measure import MemoryReport, measure
from .._render import Table, fmt_bytes
from ..cases._setup.scan_residuals import _args, carry_bytes, saved_carries
from ..cases.scan_residuals import (
    CASE,
    STEPS,
    final_state,
    loss,
    step,
)
from ._claims import Claim, verdict
from ._pages import cited_reports_table

UNROLLED_STEPS = (16, 64)  # the unrolled loop's claim: its compile time grows with T

# What the reports say, quoted (their programs, their units); ours is measured beside it.
REPORTS = {
    "jax-ml/jax#3186": "gradient memory grows with the number of steps of a loop",
    "jax-ml/jax#27748": "wrapping the whole scan in jax.remat took a job from about 117 GB to "
    "about 22 GB; the same code runs out of memory on jax 0.5.3",
    "marin-community/levanter#427": "scanning over layers keeps a stack of saved per-layer "
    "activations",
    "apple/axlearn#1171": "scan(remat(fn)) saved about 20% of a train step's memory",
}


def report_link(name: str) -> str:
    """``owner/repo#N`` as the URL of that GitHub issue."""
    repo, _, number = name.partition("#")
    return f"https://github.com/{repo}/issues/{number}"


def loss_unrolled(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
    """The loop fully unrolled (``lax.scan(..., unroll=True)``): one copy of the body per step."""

    def body(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        return step(h, x, w), None

    h, _ = lax.scan(body, h0, xs, unroll=True)
    return jnp.sum(h)


def loss_layers(ws: jax.Array, h0: jax.Array, xs: jax.Array, whole: bool = False) -> jax.Array:
    """Several scans in sequence, one per matrix of `ws` (a stack of recurrent layers).

    With `whole`, each scan is wrapped in `jax.checkpoint` (the change of jax-ml/jax#27748).
    """
    layer = jax.checkpoint(final_state) if whole else final_state
    h = h0
    for w in ws:
        h = layer(w, h, xs)
    return jnp.sum(h)


_SHORT_DTYPES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s64": 8, "s32": 4, "u32": 4}
_RESIDUAL = re.compile(r"^(\w+)\[([\d,]*)\] (.*)$")


def saved_residuals(fn: Callable[..., Any], *args: Any) -> list[tuple[str, int, str]]:
    """What reverse mode saves for `fn`'s backward pass: (shape, bytes, where it came from).

    Reads `jax.ad_checkpoint.print_saved_residuals`; `args` may be `jax.ShapeDtypeStruct`s.
    Residuals that are `fn`'s own arguments are left out (they exist anyway).
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    rows = []
    for line in out.getvalue().splitlines():
        found = _RESIDUAL.match(line.strip())
        if not found or "from the argument" in line:
            continue
        dtype, dims, origin = found.groups()
        origin = re.sub(r"from (\S+?):", lambda m: f"from {_short_path(m[1])}:", origin)
        count = math.prod(int(d) for d in dims.split(",") if d)
        rows.append((f"{dtype}[{dims}]", count * _SHORT_DTYPES.get(dtype, 4), origin))
    return rows


def residual_table(fn: Callable[..., Any], *args: Any, caption: str = "") -> Table:
    """`saved_residuals` as a table, with the total."""
    rows = saved_residuals(fn, *args)
    total = sum(size for _, size, _ in rows)
    body = [[shape, fmt_bytes(size), origin] for shape, size, origin in rows]
    return Table(
        ["residual", "bytes", "made by"], [*body, ["total", fmt_bytes(total), ""]], caption
    )


def worst(result: CaseResult) -> MemoryReport:
    """The reproduction's largest report (its largest number of steps)."""
    return max(result.select("grad"), key=lambda r: r.total)


def fix_table(result: CaseResult) -> Table:
    """Each variant at the reproduction's worst point: bytes, floor, saving, carries stored."""
    repro = worst(result)
    steps = repro.params["steps"]
    carry = carry_bytes(CASE.scales[result.scale])
    rows = []
    for v in CASE.variants:
        r = result.one(v.name, steps=steps)
        stored = max(r.total - r.argument - r.output + r.alias, 0) / carry
        rows.append(
            [
                v.name,
                v.summary,
                fmt_bytes(r.total),
                fmt_bytes(r.lower_bound),
                f"{r.overhead:.3f}x",
                f"{repro.total / r.total:.1f}x",
                f"{stored:,.0f}",
                f"{saved_carries(v.name, steps):,}",
            ]
        )
    return Table(
        [
            "variant",
            "what it does",
            "total",
            "floor",
            "total / floor",
            "saving vs grad",
            "temp, in carries",
            "floor, in carries",
        ],
        rows,
        f"{steps} steps, seed scale; one carry = {fmt_bytes(carry)}. Floor = arguments + "
        f"outputs + the carries the strategy must store. {result.provenance.label()}.",
    )


def carries_by_release() -> Table:
    """Carries per step in the gradient's temporaries at the longest scan, per committed
    release (CPU, from the version matrix): how many residuals JAX saves is the release's."""
    from ._history import load_versions

    carry, t = carry_bytes(CASE.scales["seed"]), max(STEPS)
    rows = []
    for release in load_versions():
        entries = release["cases"].get("scan-residuals", {}).get("variants", [])
        found = {e["name"]: e["bytes"]["temp"] for e in entries if e["params"]["steps"] == t}
        rows.append([release["jax"], *(
            f"{found[n] / carry / t:.2f}" if n in found else "-"
            for n in ("grad", "remat-policy", "remat-body"))])  # fmt: skip
    return Table(
        ["jax", "grad", "remat-policy", "remat-body"],
        rows,
        f"Temporaries per step in carries ({fmt_bytes(carry)} each) at T={t}, scale 'seed', "
        "compiled on the CPU by each release (docs/_data/versions/, `nox -s versions`).",
    )


def growth_table(result: CaseResult) -> Table:
    """Temporaries per step, in carries, for every variant at every number of steps."""
    carry = carry_bytes(CASE.scales[result.scale])
    steps = [p["steps"] for p in CASE.grid(CASE.scales[result.scale])]
    rows = [
        [v.name, *(f"{result.one(v.name, steps=t).temp / carry / t:.2f}" for t in steps)]
        for v in CASE.variants
    ]
    return Table(
        ["variant", *(f"T={t}" for t in steps)],
        rows,
        f"Temporary bytes / (T x one carry of {fmt_bytes(carry)}); {result.provenance.label()}.",
    )


def measure_layers(
    steps: int = 1024, layers: int = 4, scale: str = "seed", target: str | None = None
) -> tuple[MemoryReport, MemoryReport]:
    """`loss_layers`'s gradient, without and with whole-scan checkpoints (abstract shapes)."""
    w, h0, xs = _args(CASE.scales[scale], {"steps": steps}, False)
    ws = jax.ShapeDtypeStruct((layers, *w.shape), w.dtype)
    params = {"steps": steps, "layers": layers}
    plain, wrapped = (
        dataclasses.replace(
            measure(
                jax.value_and_grad(functools.partial(loss_layers, whole=whole)),
                ws,
                h0,
                xs,
                name=name,
                target=target,
            ),
            params=params,
        )
        for whole, name in ((False, "layers"), (True, "layers, remat-whole"))
    )
    return plain, wrapped


def reports_table(result: CaseResult, layers: Sequence[MemoryReport]) -> Table:
    """What each report says beside the figure we measure for the same effect.

    `layers` is `measure_layers()`'s pair: scans in sequence, without and with checkpoints.
    """
    repro, carry = worst(result), carry_bytes(CASE.scales[result.scale])
    t = repro.params["steps"]
    first = min(result.select("grad"), key=lambda r: r.params["steps"])
    whole, body = result.one("remat-whole", steps=t), result.one("remat-body", steps=t)
    plain, wrapped = layers
    ours = [
        (
            f"grad: {fmt_bytes(first.total)} at T={first.params['steps']}, "
            f"{fmt_bytes(repro.total)} at T={t}: {repro.temp / carry / t:.2f} carries per step"
        ),
        (
            f"one scan: remat-whole needs {whole.total / repro.total:.2f}x grad's bytes at "
            f"T={t}; {plain.params['layers']} scans in sequence (T={plain.params['steps']}): "
            f"{fmt_bytes(plain.total)} -> {fmt_bytes(wrapped.total)} "
            f"({wrapped.total / plain.total:.2f}x)"
        ),
        (
            f"grad at T={t} keeps {repro.temp / (carry * t):.2f} (T, batch, hidden) arrays of "
            "temporaries: the stacked residuals"
        ),
        f"remat-body saves {1 - body.total / repro.total:.0%} of grad's total at T={t}",
    ]
    return cited_reports_table(
        REPORTS, ours, f"{result.provenance.label()}; compile time, seed scale."
    )


def _dynamic_fori_error() -> str:
    """What `jax.grad` says about a `fori_loop` whose trip count is a traced value."""

    def dynamic(w: jax.Array, h0: jax.Array, xs: jax.Array, n: jax.Array) -> jax.Array:
        return jnp.sum(lax.fori_loop(0, n, lambda t, h: step(h, xs[t], w), h0))

    args = (*_args(CASE.scales["tiny"], {"steps": 16}, False), jnp.int32(16))
    try:
        jax.jit(jax.grad(dynamic)).lower(*args)
    except ValueError as e:
        return str(e).strip().split(". ")[0] + "."
    return ""


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The claims the reports and threads make, decided by measurements at the seed scale.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    # Only the variants the claims read: a release that cannot build another (offload-carry
    # before XLA:CPU took memory kinds) still has its claims decided.
    result = result or measure_case("scan-residuals", scale, target=target, variants=CLAIMED)
    target = result.provenance.target or None
    size = CASE.scales[result.scale]
    return _claims(result, size, target)


CLAIMED = ("grad", "grad-fori", "remat-whole", "remat-body", "remat-nested")


def _claims(result: CaseResult, scale: Mapping[str, Any], target: str | None) -> list[Claim]:
    carry = carry_bytes(scale)
    steps = [p["steps"] for p in CASE.grid(scale)]
    at: Callable[[str, int], MemoryReport] = lambda name, t: result.one(name, steps=t)
    lo, hi = steps[0], steps[-1]
    out = []

    same = all(at("grad-fori", t).total == at("grad", t).total for t in steps)
    growth = at("grad-fori", hi).total / at("grad-fori", lo).total
    error = _dynamic_fori_error()
    out.append(
        Claim(
            "fori-constant",
            "`lax.fori_loop` has constant backward memory.",
            verdict(growth < 1.1),
            f"with a static trip count it is a scan: grad-fori needs exactly grad's bytes at "
            f"{'every' if same else 'not every'} T ({fmt_bytes(at('grad-fori', lo).total)} at "
            f"T={lo}, {fmt_bytes(at('grad-fori', hi).total)} at T={hi}: {growth:.0f}x). With a "
            f"traced trip count there is no reverse-mode gradient at all: "
            f"{error or 'no error raised'}",
        )
    )

    pairs = []
    for t in UNROLLED_STEPS:
        args = _args(scale, {"steps": t}, False)
        rolled = measure(jax.value_and_grad(loss), *args, target=target)
        unrolled = measure(jax.value_and_grad(loss_unrolled), *args, target=target)
        pairs.append((t, rolled, unrolled))
    out.append(
        Claim(
            "scan-vs-unroll",
            "`lax.scan` always uses less memory than unrolling the loop (threads disagree: "
            "jax-ml/jax#14056, jax-ml/jax#26618).",
            verdict(all(r.total < u.total for _, r, u in pairs)),
            "grad with lax.scan vs fully unrolled (unroll=True), seed batch and width: "
            + "; ".join(
                f"T={t}: {fmt_bytes(r.total)} vs {fmt_bytes(u.total)} ({r.temp / carry / t:.1f}"
                f" vs {u.temp / carry / t:.1f} carries per step; compiled in "
                f"{r.compile_seconds:.1f} s vs {u.compile_seconds:.1f} s)"
                for t, r, u in pairs
            )
            + ". Only these numbers of steps were tried: unrolled compile time grows with T.",
        )
    )

    layers = measure_layers(scale=result.scale, target=target)
    plain, wrapped = layers
    whole_ratio = max(at("remat-whole", t).total / at("grad", t).total for t in steps)
    out.append(
        Claim(
            "checkpoint-always",
            "`jax.checkpoint` always reduces memory.",
            verdict(whole_ratio < 1 and wrapped.total < plain.total),
            f"around the whole scan it saves nothing: remat-whole needs {whole_ratio:.2f}x "
            f"grad's bytes at worst over T; around each of {plain.params['layers']} scans in "
            f"sequence it needs more ({fmt_bytes(plain.total)} -> {fmt_bytes(wrapped.total)}). "
            f"On the body it does save: remat-body needs {fmt_bytes(at('remat-body', hi).total)}"
            f" vs {fmt_bytes(at('grad', hi).total)} at T={hi}.",
        )
    )

    best = min(at("remat-whole", hi).total / at("grad", hi).total, wrapped.total / plain.total)
    out.append(
        Claim(
            "remat-whole",
            "Wrapping the whole scan in `jax.remat` cuts the gradient's memory several-fold "
            "(jax-ml/jax#27748: about 117 GB to about 22 GB).",
            verdict(best < 0.5, otherwise="not reproducible here"),
            f"one scan at T={hi}: {fmt_bytes(at('grad', hi).total)} -> "
            f"{fmt_bytes(at('remat-whole', hi).total)}; {plain.params['layers']} scans in "
            f"sequence: {fmt_bytes(plain.total)} -> {fmt_bytes(wrapped.total)}."
            + (
                ""
                if best < 0.5
                else " The backward pass recomputes a scan and stores its residuals then, so a "
                "lone scan peaks the same; with several scans it helps only if one scan's "
                "recomputed residuals are alive at a time, and here the temporaries hold "
                f"{wrapped.temp / (carry * plain.params['steps']):.1f} carries per step."
            ),
        )
    )

    body_saves = 1 - at("remat-body", hi).total / at("grad", hi).total
    per_step = [at("remat-body", t).temp / carry / t for t in steps]
    out.append(
        Claim(
            "remat-body",
            "Checkpointing the scan's body (`scan(remat(fn))`) saves memory "
            "(apple/axlearn#1171: about 20% of a train step).",
            verdict(body_saves > 0.2),
            f"here it saves {body_saves:.0%} of grad's total at T={hi}: each step stores "
            f"{per_step[-1]:.2f} carries instead of {at('grad', hi).temp / carry / hi:.2f}. "
            "The share of a whole train step depends on how much of it is scan residuals.",
        )
    )

    sqrt_growth = [
        (
            a,
            b,
            (at("remat-nested", b).temp - at("remat-nested", a).temp) / carry,
            saved_carries("remat-nested", b) - saved_carries("remat-nested", a),
        )
        for a, b in itertools.pairwise(steps)
    ]
    out.append(
        Claim(
            "nested-sqrt",
            "Nested checkpointed scans store about 2·sqrt(T) carries.",
            verdict(all(abs(g - e) <= 0.25 * e for _, _, g, e in sqrt_growth)),
            "growth of remat-nested's temporaries between successive T, in carries, vs growth "
            "of 2·sqrt(T): "
            + ", ".join(f"T={a}->{b}: {g:.0f} vs {e}" for a, b, g, e in sqrt_growth)
            + "; the rest does not grow with T (w-sized gradient buffers among it): "
            f"{fmt_bytes(at('remat-nested', hi).temp - 2 * math.isqrt(hi) * carry)} at T={hi}.",
        )
    )
    return out
