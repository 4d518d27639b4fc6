"""The `host-offloading` page: the reports beside our figures, the device's and the host's
bytes of every variant on each compiler, and the claims. The layer stack, its policies and
the host-weights step are in `runbook.cases.host_offloading`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax

from .._case import CaseResult, measure_case
from .._measure import MemoryReport
from .._render import Table, fmt_bytes
from .._targets import get_target
from ..cases.host_offloading import CASE
from ._accelerator import on_targets, variant_table, worst_point
from ._claims import Claim, verdict

REPORTS = {
    "jax-ml/jax#23869": "a remat policy that offloads a named value moved nothing to the host, "
    "with no warning (openxla/xla#17541)",
    "jax-ml/jax#17323": "a request to keep activations and parameters in host memory, to train "
    "models whose activations do not fit the device",
    "AI-Hypercomputer/maxtext#987": "a remat policy that decides, tensor by tensor, to recompute, "
    "keep on the device, or offload",
    "JAX's host offloading page": "saved activations and parameters kept in pinned host memory; "
    "its snippets are illustrative, not executed",
}
SHOWN = ("h100", "v5e")  # compilers with a host memory space, compiled without the device


def results(names: Sequence[str] = SHOWN) -> dict[str, CaseResult]:
    """Every variant at the reproduction's worst point, on this backend and each target."""
    return on_targets(CASE.name, names=names, every_variant=None)


def _cell(report: MemoryReport | None) -> str:
    if report is None:
        return "not measured"
    host = f" + {fmt_bytes(report.host_total)} host" if report.host else ""
    return f"{fmt_bytes(report.total)}{host}"


def memory_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Per variant and compiler: the device's total, and the host's where it holds any."""
    found = found if found is not None else results()
    point = dict(next(iter(found.values())).reports[0].params)
    return variant_table(
        found,
        _cell,
        f"Device bytes per variant, and the host's beside them; {point}, seed scale, "
        f"jax {jax.__version__}, one device.",
    )


NEEDED = ("remat", "offload-output", "offload-input", "save-dots", "offload-dots")
CLAIMS = {
    "offload-moves": "An offloading remat policy keeps what the backward pass reads in pinned "
    "host memory, not the device's (JAX's host offloading page).",
    "wrong-name-23869": "A policy that offloads a value the backward pass never reads moves "
    "nothing, and says nothing (jax-ml/jax#23869).",
    "offload-dots": "Offloading the saved matrix products frees their device memory "
    "(offload_dot_with_no_batch_dims against dots_with_no_batch_dims_saveable).",
}


def _platform(target: str | None) -> str:
    return get_target(target).platform if target else jax.default_backend()


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The reports' claims, decided on this backend or for `target`.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    platform = result.provenance.backend if result else _platform(target)
    if platform == "cpu":  # one memory: offloaded values stay where the rest are
        why = "XLA:CPU has one memory: nothing is kept apart in host memory to compare."
        return [Claim(k, text, "not reproducible here", why) for k, text in CLAIMS.items()]
    result = result or measure_case(CASE.name, scale, target=target, variants=list(NEEDED))
    at = worst_point(result)
    report = {n: found[0] for n in NEEDED if (found := result.select(n, **at))}

    def said(*names: str) -> str:
        return "; ".join(f"{n}: {_cell(report.get(n))}" for n in names) + "."

    def decide(key: str, names: tuple[str, str], holds: Callable[..., bool]) -> Claim:
        chosen = [report.get(n) for n in names]
        if any(r is None for r in chosen):
            return Claim(key, CLAIMS[key], "not reproducible here", said(*names))
        return Claim(key, CLAIMS[key], verdict(holds(*chosen)), said(*names))

    return [
        decide(
            "offload-moves",
            ("remat", "offload-input"),
            lambda remat, moved: bool(moved.host_total) and moved.total < remat.total,
        ),
        decide(
            "wrong-name-23869",
            ("remat", "offload-output"),
            lambda remat, trap: not trap.host and trap.total == remat.total,
        ),
        decide(
            "offload-dots",
            ("save-dots", "offload-dots"),
            lambda saved, dots: bool(dots.host_total) and dots.total < saved.total,
        ),
    ]


def reports_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Each report beside what the compiler for an H100 gives (compiled without one)."""
    found = found if found is not None else results()
    gpu = found.get("h100")
    decided = {c.key: c for c in claims(gpu, target="h100")} if gpu else {}
    keys = ("wrong-name-23869", "offload-moves", "offload-dots", "offload-moves")
    rows = []
    for (report, said), key in zip(REPORTS.items(), keys, strict=True):
        claim = decided.get(key)
        rows.append(
            [report, said, claim.verdict if claim else "-", claim.evidence if claim else "-"]
        )
    return Table(
        ["report", "what it says", "verdict for an H100", "measured (compile-time prediction)"],
        rows,
        f"Compiled for an H100 without the device, jax {jax.__version__}.",
    )
