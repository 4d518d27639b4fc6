"""The `vocab-logits` page: its claims, the reports beside our figures, and the experiments
behind them (labels and dtypes at AI-Hypercomputer/maxtext#3922's shape, apple/axlearn#1236's
logits). The reproduction and its fixes are in `runbook.cases.vocab_logits`."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from .. import _cache, _targets
from .._case import CaseResult, measure_case
from .._measure import MemoryReport, _name, compile_lowered, lower_fn, measure, program_hash
from .._render import Table, fmt_bytes
from ..cases._setup.vocab_logits import args as _args
from ..cases._setup.vocab_logits import grad as _grad
from ..cases.vocab_logits import CASE, loss_integer, loss_one_hot
from ._claims import Claim, verdict
from ._pages import cited_reports_table

# What the reports say, quoted; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#35906": "the intermediate logits dominate training memory (PR #35915 proposes "
    "a chunked loss)",
    "apple/axlearn#1236": "16k tokens x 153k vocabulary in float32: about 9.6 GB of logits",
    "AI-Hypercomputer/maxtext#2242": "vocabulary tiling: compute the loss a piece of the "
    "vocabulary at a time",
    "AI-Hypercomputer/maxtext#3922": "a one-hot [8, 4096, 102400] array of 6.7 GB",
}
AXLEARN = {"tokens": 16 * 1024, "vocab": 153_000, "reported_gb": 9.6}
MAXTEXT_ONE_HOT = {"tokens": 8 * 4096, "vocab": 102_400, "reported_gb": 6.7}
# Where every variant runs for real on the page: the runnable scale's longest sequence.
PEAK_POINT = {"tokens": CASE.scales[CASE.runnable_scale]["tokens"][-1]}


def one_hot_arrays(fn: Any, *args: Any, target: str | None = None) -> list[tuple[str, int]]:
    """Tokens x vocabulary arrays the compiled program computes from the labels alone.

    Those are one-hot labels (possibly scaled), materialised: (HLO shape, bytes) of each
    fusion of the optimised program whose only operand is the `labels` argument. Cached like
    a measurement, by the program (a compile for a target is read from the docs' store).
    """
    n, v = args[0].shape[0], args[1].shape[1]
    t = _targets.resolve(target)
    lowered = lower_fn(fn, *args, target=t)

    def compute() -> list[str]:
        text = compile_lowered(lowered, name=_name(fn), target=t).as_text()
        return re.findall(rf"= (\w+)\[{n},{v}\]\S* fusion\(%?labels[.\d]*\)", text)

    request = {"kind": "one-hot-arrays", "program": program_hash(lowered),
               "target": t.name if t else None}  # fmt: skip
    found: list[str] = _cache.cached(request, compute, module=__name__)
    return [
        (f"{dtype}[{n},{v}]", n * v * jnp.dtype(_HLO_DTYPES[dtype]).itemsize) for dtype in found
    ]


_HLO_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "pred": "bool"}


def label_and_dtype_costs(
    tokens: int = int(MAXTEXT_ONE_HOT["tokens"]),
    vocab: int = int(MAXTEXT_ONE_HOT["vocab"]),
    target: str | None = None,
) -> list[dict[str, Any]]:
    """The gradient with one-hot or integer labels and float32 or bfloat16 logits.

    Inputs in bfloat16, at AI-Hypercomputer/maxtext#3922's shape by default. Each row:
    ``labels``, ``logits``, ``report`` and ``one_hot`` (`one_hot_arrays` of the program).
    """
    scale = {**CASE.scales["seed"], "vocab": vocab}
    args = _args(scale, {"tokens": tokens}, False, jnp.bfloat16)
    rows = []
    for labels, loss in (("one-hot", loss_one_hot), ("integer", loss_integer)):
        for logits, upcast in (("float32", True), ("bfloat16", False)):
            fn = _grad(functools.partial(loss, upcast=upcast))
            report = measure(
                fn, *args, name=f"{labels}, {logits} logits", buffers=True, target=target
            )
            report = dataclasses.replace(report, params={"shape": (tokens, vocab)})
            rows.append(
                {
                    "labels": labels,
                    "logits": logits,
                    "report": report,
                    "one_hot": one_hot_arrays(fn, *args, target=target),
                }
            )
    return rows


def dtype_table(rows: list[dict[str, Any]]) -> Table:
    """`label_and_dtype_costs` as a table."""
    n, v = rows[0]["report"].params["shape"]
    return Table(
        ["labels", "logits", "total", "temp", "one-hot arrays materialised"],
        [
            [
                r["labels"],
                r["logits"],
                fmt_bytes(r["report"].total),
                fmt_bytes(r["report"].temp),
                "; ".join(f"{shape}: {fmt_bytes(size)}" for shape, size in r["one_hot"]) or "none",
            ]
            for r in rows
        ],
        f"Gradient of the loss, bfloat16 inputs, {n} tokens x {v} vocabulary. "
        f"{rows[0]['report'].provenance.label()}.",
    )


def axlearn_logits(target: str | None = None) -> MemoryReport:
    """The integer-label gradient at apple/axlearn#1236's shape, float32 logits, with buffers."""
    scale = {**CASE.scales["seed"], "vocab": AXLEARN["vocab"]}
    args = _args(scale, {"tokens": AXLEARN["tokens"]}, False)
    return measure(
        _grad(loss_integer), *args, name="axlearn#1236 shape", buffers=True, target=target
    )


def logits_share(report: MemoryReport, tokens: int, vocab: int) -> tuple[float, bool]:
    """(temporaries / total, whether every temporary larger than the inputs is shaped
    tokens x vocabulary) for a report measured with ``buffers=True``."""
    big = [b for b in report.buffers if b.kind == "temp" and b.size > report.argument]
    shaped = all(f"[{tokens},{vocab}]" in b.shape for b in big)
    return report.temp / report.total, bool(big) and shaped


def fix_table(result: CaseResult) -> Table:
    """Each variant at the reproduction's worst point: bytes, floor, saving."""
    repro = max(result.select(role="reproduction"), key=lambda r: r.total)
    rows = []
    for v in CASE.variants:
        r = result.one(v.name, **repro.params)
        rows.append(
            [
                v.name,
                v.summary,
                fmt_bytes(r.temp),
                fmt_bytes(r.total),
                fmt_bytes(r.lower_bound),
                f"{r.overhead:.3f}x",
                f"{repro.total / r.total:.1f}x",
            ]
        )
    return Table(
        ["variant", "what it does", "temp", "total", "floor", "total / floor", "saving"],
        rows,
        f"{repro.params['tokens']} tokens, seed scale. Floor: inputs, loss and gradients plus "
        "one float32 tokens x vocabulary array (all of it without chunks, one chunk with). "
        f"{result.provenance.label()}.",
    )


def evidence(result: CaseResult) -> dict[str, Any]:
    """The measurements beyond the case's own that the claims and the reports table use.

    ``worst``: the reproduction at its worst point, with buffers; ``labels_dtypes``:
    `label_and_dtype_costs()`; ``axlearn``: `axlearn_logits()`.
    """
    repro = max(result.select(role="reproduction"), key=lambda r: r.total)
    args = _args(CASE.scales[result.scale], repro.params, False)
    target = result.provenance.target or None
    return {
        "worst": measure(_grad(loss_one_hot), *args, name=repro.name, buffers=True, target=target),
        "labels_dtypes": label_and_dtype_costs(target=target),
        "axlearn": axlearn_logits(target),
    }


def reports_table(result: CaseResult, found: Mapping[str, Any]) -> Table:
    """What each report says beside the figure we measure for the same effect.

    `found` is `evidence(result)`.
    """
    scale = CASE.scales[result.scale]
    repro = max(result.select(role="reproduction"), key=lambda r: r.total)
    n = repro.params["tokens"]
    share, _ = logits_share(found["worst"], n, scale["vocab"])
    tiled = result.one("vocab-tiled", tokens=n)
    largest = found["axlearn"].buffers[0]
    one_hot = next(
        r["one_hot"]
        for r in found["labels_dtypes"]
        if (r["labels"], r["logits"]) == ("one-hot", "bfloat16")
    )
    ours = [
        (
            f"temporaries are {share:.0%} of the gradient's {fmt_bytes(repro.total)} at {n} "
            f"tokens; with vocabulary tiles the gradient needs {fmt_bytes(tiled.total)}"
        ),
        (
            f"largest buffer at that shape: {largest.shape}, {largest.size / 1e9:.2f} GB "
            f"({fmt_bytes(largest.size)})"
        ),
        (
            f"{repro.total / tiled.total:.1f}x less than the reproduction at {n} tokens "
            f"({fmt_bytes(repro.total)} -> {fmt_bytes(tiled.total)})"
        ),
        "one-hot arrays materialised with bfloat16 logits at that shape: "
        + ("; ".join(f"{s}: {b / 1e9:.2f} GB" for s, b in one_hot) or "none"),
    ]
    return cited_reports_table(REPORTS, ours, f"{result.provenance.label()}; compile time.")


def claims(
    result: CaseResult | None = None,
    found: Mapping[str, Any] | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
) -> list[Claim]:
    """The claims of the reports and of common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        found: `evidence(result)` (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case("vocab-logits", scale, target=target)
    found = found or evidence(result)
    labels_dtypes, axlearn, worst = found["labels_dtypes"], found["axlearn"], found["worst"]
    size = CASE.scales[result.scale]
    tokens = [p["tokens"] for p in CASE.grid(size)]
    n = tokens[-1]

    def at(name: str, t: int = n) -> MemoryReport:
        return result.one(name, tokens=t)

    row = {(r["labels"], r["logits"]): r for r in labels_dtypes}
    out = []

    share, shaped = logits_share(worst, n, size["vocab"])
    out.append(
        Claim(
            "logits-dominate",
            "The intermediate logits dominate training memory (jax-ml/jax#35906).",
            verdict(share > 0.5 and shaped),
            f"at {n} tokens x {size['vocab']} vocabulary the gradient's temporaries are "
            f"{fmt_bytes(worst.temp)} of {fmt_bytes(worst.total)} ({share:.0%}), and every "
            f"temporary larger than the inputs is a [{n}, {size['vocab']}] array: "
            f"{'yes' if shaped else 'no'}.",
        )
    )

    largest = axlearn.buffers[0]
    gb = largest.size / 1e9
    out.append(
        Claim(
            "axlearn-size",
            "16k tokens x 153k vocabulary in float32 take about 9.6 GB (apple/axlearn#1236).",
            verdict(abs(gb - AXLEARN["reported_gb"]) <= 0.05 * AXLEARN["reported_gb"]),
            f"compiled at {AXLEARN['tokens']} x {AXLEARN['vocab']}: the largest buffer is "
            f"{largest.shape}, {gb:.2f} GB ({fmt_bytes(largest.size)}), made by "
            f"{largest.op.rsplit('/', 1)[-1]}; the gradient holds several of that size "
            f"({fmt_bytes(axlearn.temp)} of temporaries).",
        )
    )

    f32_same = all(
        abs(at("grad-integer", t).total - at("grad-one-hot", t).total)
        <= 0.001 * at("grad-one-hot", t).total
        for t in tokens
    )
    f32_hot = row[("one-hot", "float32")]["one_hot"]
    hot, integer = row[("one-hot", "bfloat16")]["report"], row[("integer", "bfloat16")]["report"]
    out.append(
        Claim(
            "one-hot-free",
            "One-hot labels cost nothing extra.",
            verdict(f32_same and hot.total <= 1.01 * integer.total),
            f"with float32 logits one-hot and integer labels need "
            f"{'the same bytes (within 0.1%) at every' if f32_same else 'different bytes at some'}"
            f" number of tokens ({fmt_bytes(at('grad-one-hot').total)} at {n}), although the "
            "one-hot program materialises the one-hot ("
            + ("; ".join(f"{s}: {fmt_bytes(b)}" for s, b in f32_hot) or "none")
            + " at AI-Hypercomputer/maxtext#3922's shape): the integer labels' gradient, a "
            "scatter into zeros, is as large. With bfloat16 logits at that shape: one-hot "
            f"{fmt_bytes(hot.total)}, integer {fmt_bytes(integer.total)}.",
        )
    )

    materialised = row[("one-hot", "bfloat16")]["one_hot"]
    reported = MAXTEXT_ONE_HOT["reported_gb"]
    near = [s for s, b in materialised if abs(b / 1e9 - reported) <= 0.05 * reported]
    out.append(
        Claim(
            "maxtext-one-hot",
            "A one-hot [8, 4096, 102400] array takes 6.7 GB (AI-Hypercomputer/maxtext#3922).",
            verdict(bool(near), otherwise="not reproducible here"),
            "gradient with bfloat16 logits at that shape, arrays computed from the labels "
            "alone: "
            + ("; ".join(f"{s}: {b / 1e9:.2f} GB" for s, b in materialised) or "none")
            + ". With float32 logits: "
            + (
                "; ".join(
                    f"{s}: {b / 1e9:.2f} GB" for s, b in row[("one-hot", "float32")]["one_hot"]
                )
                or "none"
            )
            + ".",
        )
    )

    up, down = row[("integer", "float32")]["report"], row[("integer", "bfloat16")]["report"]
    out.append(
        Claim(
            "upcast-free",
            "Casting the logits to float32 is free.",
            verdict(up.total <= 1.01 * down.total),
            f"integer labels, bfloat16 inputs: {fmt_bytes(up.total)} with the float32 cast, "
            f"{fmt_bytes(down.total)} without. XLA:CPU computes bfloat16 elementwise math in "
            "float32 anyway (the uncast program holds float32 convert fusions of the logits' "
            "shape), so here the cast costs nothing; a compiler with native bfloat16 arithmetic "
            "can differ (see the accelerator section).",
        )
    )

    tiled, chunked = at("vocab-tiled"), at("tokens-chunked")
    out.append(
        Claim(
            "chunking",
            "Computing the loss in chunks (vocabulary tiling, AI-Hypercomputer/maxtext#2242; "
            "PR #35915) keeps the logits out of peak memory.",
            verdict(tiled.overhead <= 1.25 and at("grad-one-hot").total / tiled.total >= 1.5),
            f"at {n} tokens: vocabulary tiles {fmt_bytes(tiled.total)} "
            f"({tiled.overhead:.3f}x the floor with one chunk of logits), token chunks "
            f"{fmt_bytes(chunked.total)} ({chunked.overhead:.3f}x: each chunk adds a partial "
            f"gradient the size of the unembedding), the reproduction "
            f"{fmt_bytes(at('grad-one-hot').total)}.",
        )
    )
    return out
