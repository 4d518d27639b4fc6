"""The `grad-accumulation` page: the reports beside our figures, every variant's bytes on each
compiler, and the claims. The steps and optimizers are in `runbook.cases.grad_accumulation`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax

from .._case import CaseResult, measure_case
from .._measure import MemoryReport
from .._render import Table, fmt_bytes
from ..cases._setup.grad_accumulation import ITEM
from ..cases.grad_accumulation import CASE
from ._accelerator import on_targets, variant_table, worst_point
from ._claims import Claim, verdict

REPORTS = {
    "google-deepmind/optax#528": "MultiSteps keeps a buffer of accumulated gradients the size "
    "of the parameters in its state",
    "young-geng/EasyLM#36": "accumulating over 2 steps ran a TPU out of memory; the maintainer: "
    "the accumulated gradient is the size of the parameters",
    "google-deepmind/optax#472": "MultiSteps with every_k_schedule=1 runs out of memory where "
    "the plain optimizer does not",
    "google-deepmind/optax#320": "on a TPU, MultiSteps raised the memory needed as if the "
    "batch had grown by the accumulation steps",
    "borisdayma/dalle-mini#122": "MultiSteps needed too much memory, so a loop of one's own "
    "accumulates instead",
}
# The claim each report is decided by, in `REPORTS`' order.
_REPORT_CLAIMS = ("accumulator-528", "accumulator-528", "every-1-472", "batch-320", "loop-122")
SHOWN = ("h100", "v5e")  # a GPU and a TPU (the TPU reports'), compiled without the device


def results(names: Sequence[str] = SHOWN) -> dict[str, CaseResult]:
    """Every variant at the reproduction's worst point, on this backend and each target."""
    return on_targets(CASE.name, names=names, every_variant=None)


def memory_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Per variant and compiler: the program's total, and its arguments within it."""
    found = found if found is not None else results()
    point = dict(next(iter(found.values())).reports[0].params)

    def cell(report: MemoryReport) -> str:
        return f"{fmt_bytes(report.total)} ({fmt_bytes(report.argument)} arguments)"

    return variant_table(
        found,
        cell,
        f"Bytes of one call of each variant's step (its arguments within), {point}, seed scale, "
        f"jax {jax.__version__}, one device.",
    )


CLAIMS = {
    "accumulator-528": "optax.MultiSteps keeps an accumulator the size of the parameters beside "
    "the optimizer's state (google-deepmind/optax#528, young-geng/EasyLM#36).",
    "every-1-472": "optax.MultiSteps with every_k_schedule=1 needs more memory than the plain "
    "optimizer at the same batch (google-deepmind/optax#472).",
    "batch-320": "Accumulating over k steps with optax.MultiSteps needs as much memory as a "
    "batch k times larger (google-deepmind/optax#320).",
    "loop-122": "Accumulating under lax.scan inside one step needs less memory than "
    "optax.MultiSteps (borisdayma/dalle-mini#122).",
    "bf16-half": "A bfloat16 accumulator saves at least half of the float32 accumulator's bytes "
    "(the parameters' bytes over two).",
}
NEEDED = ("micro-batch", "full-batch", "multisteps-every-1", "multisteps", "scan-f32", "scan-bf16")


def parameter_bytes() -> int:
    """The bytes of the seed scale's parameters (one float32 matrix per layer)."""
    scale = CASE.scales["seed"]
    return int(scale["layers"] * scale["width"] ** 2 * ITEM)


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The reports' claims, decided on this backend or for `target`.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    if result is None:  # at the largest batch: the reproduction's worst point, as it grows
        largest = {"batch": max(CASE.scales[scale]["batch"])}
        result = measure_case(CASE.name, scale, target=target, variants=list(NEEDED), at=largest)
    at = worst_point(result)
    report = {n: found[0] for n in NEEDED if (found := result.select(n, **at))}
    weights = parameter_bytes()

    def said(*names: str) -> str:
        return "; ".join(f"{n}: {fmt_bytes(report[n].total)}" for n in names if n in report)

    def decide(
        key: str, names: tuple[str, ...], holds: Callable[..., bool], evidence: Callable[..., str]
    ) -> Claim:
        chosen = [report.get(n) for n in names]
        if any(r is None for r in chosen):
            return Claim(key, CLAIMS[key], "not reproducible here", said(*names) + ".")
        return Claim(key, CLAIMS[key], verdict(holds(*chosen)), evidence(*chosen))

    def accumulator(plain: MemoryReport, multi: MemoryReport) -> str:
        return (
            f"MultiSteps' step takes {fmt_bytes(multi.argument - plain.argument)} more "
            f"arguments than the plain step on the same micro-batch; the parameters: "
            f"{fmt_bytes(weights)}."
        )

    def ratio(a: MemoryReport, b: MemoryReport) -> str:
        return f"{a.name}: {fmt_bytes(a.total)}; {b.name}: {fmt_bytes(b.total)} ({a.total / b.total:.2f}x)."

    def saved(f32: MemoryReport, b16: MemoryReport) -> str:
        return (
            f"scan-f32: {fmt_bytes(f32.total)}; scan-bf16: {fmt_bytes(b16.total)}; saved "
            f"{fmt_bytes(f32.total - b16.total)}, half the parameters: {fmt_bytes(weights // 2)}."
        )

    return [
        decide(
            "accumulator-528",
            ("micro-batch", "multisteps"),
            # its counters add a few bytes (a TPU pads each scalar) to the accumulator
            lambda plain, multi: 0 <= multi.argument - plain.argument - weights <= 1 << 20,
            accumulator,
        ),
        decide(
            "every-1-472",
            ("multisteps-every-1", "full-batch"),
            lambda every, plain: every.total > plain.total,
            ratio,
        ),
        decide(
            "batch-320",
            ("multisteps", "full-batch"),
            lambda multi, whole: multi.total >= 0.9 * whole.total,
            ratio,
        ),
        decide(
            "loop-122",
            ("scan-f32", "multisteps"),
            lambda loop, multi: loop.total < multi.total,
            ratio,
        ),
        decide(
            "bf16-half",
            ("scan-f32", "scan-bf16"),
            lambda f32, b16: f32.total - b16.total >= weights // 2,
            saved,
        ),
    ]


def reports_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Each report beside what the compiler for a TPU v5e gives (compiled without one)."""
    found = found if found is not None else results()
    tpu = found.get("v5e")
    decided = {c.key: c for c in claims(tpu, target="v5e")} if tpu else {}
    rows = []
    for (report, text), key in zip(REPORTS.items(), _REPORT_CLAIMS, strict=True):
        claim = decided.get(key)
        rows.append(
            [report, text, claim.verdict if claim else "-", claim.evidence if claim else "-"]
        )
    return Table(
        ["report", "what it says", "verdict for a TPU v5e", "measured (compile-time prediction)"],
        rows,
        f"Compiled for a TPU v5e without the device, seed scale, jax {jax.__version__}.",
    )
