"""The `attention-scores` page: the reports beside our figures, the sequence-length sweep
(quadratic against linear) and the claims. The reproduction and its fixes are in
`runbook.cases.attention_scores`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cache
from .._case import CaseResult, measure_case
from .._errors import DoesNotFitError
from .._measure import MemoryReport, measure
from .._render import Table, fmt_bytes
from ..cases import attention_scores as attn
from ..cases._setup.attention_scores import attention_backward, cudnn_unavailable
from ..cases.attention_scores import CASE
from ._claims import Claim, verdict
from ._pages import cited_reports_table

# What the reports say, summarised; ours is measured beside it.
REPORTS = {
    "jax-ml/jax PR #20145": "JAX's own attention (its XLA implementation) builds the whole "
    "score matrix; a fused GPU kernel (cuDNN) avoids it",
    "google/flax#2858": "the attention layer runs out of memory at long sequences: its "
    "memory grows with the square of the length",
    "diffusers, big_vision reports": "attention over many tokens needs memory quadratic in "
    "their number; chunking the queries under jax.checkpoint (Rabe & Staats, arXiv "
    "2112.05682) makes it linear",
}

SWEEP = (2048, 4096, 8192, 16384, 32768)  # tokens
ATTEND: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
    "xla": attn.attention,
    "chunked": attn.attention_chunked,
    "cudnn": attn.attention_cudnn,
    "blockwise": attn.attention_blockwise,
}


def _inputs(tokens: int, count: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    s = CASE.scales["seed"]
    shape = (s["batch"], tokens, s["heads"], s["dim"])
    return tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16) for _ in range(count))


def _platform(target: str | None) -> str:
    from .. import _targets

    return _targets.get_target(target).platform if target else jax.default_backend()


def _sweep_json(name: str, target: str | None, lengths: Sequence[int]) -> list[dict[str, int]]:
    program = jax.jit(attention_backward(ATTEND[name]))
    found = []
    for tokens in lengths:
        try:
            r = measure(program, *_inputs(tokens, 4), name=name, target=target)
        except DoesNotFitError as e:  # the compiler's own figure for what it would need
            found.append({"tokens": tokens, "temp": e.needed, "total": e.needed, "fits": False})
            continue
        found.append({"tokens": tokens, "temp": r.temp, "total": r.total, "fits": True})
    return found


def _swept(name: str, target: str | None, lengths: Sequence[int]) -> list[dict[str, int]]:
    request = {"kind": "attention-sweep", "name": name, "target": target,
               "tokens": list(lengths)}  # fmt: skip
    found: list[dict[str, int]] = _cache.cached(
        request, functools.partial(_sweep_json, name, target, lengths), module=__name__
    )
    return found


@functools.cache
def sweep(target: str | None = None) -> dict[str, list[dict[str, int]]]:
    """Variants' backward passes compiled at every length of `SWEEP`: temporaries and
    total, in bytes. On this backend every variant that compiles; for a target XLA's, the
    recommended fix and cuDNN's where it compiles (`claims` adds the chunked variant)."""
    chosen = ("xla", "blockwise", "cudnn") if target else tuple(ATTEND)
    found = {}
    for variant in CASE.variants:
        if variant.name not in chosen:
            continue
        if variant.unavailable and variant.unavailable(_platform(target)):
            continue
        found[variant.name] = _swept(variant.name, target, SWEEP)
    return found


def slope(points: Sequence[dict[str, int]], figure: str = "temp") -> float:
    """k in T^k: how `figure` grows from the seed's T to twice it (2 quadratic, 1 linear).

    One doubling, not a fit over the sweep: at short lengths a compiler may keep a
    program's temporaries near zero (the TPU compiler does), and near a device's memory it
    may trade speed for memory; neither says how the program grows.
    """
    seed = _seed_tokens()
    at = {p["tokens"]: max(p[figure], 1) for p in points}
    return float(np.log2(at[2 * seed] / at[seed]))


def sweep_table(found: dict[str, list[dict[str, int]]], caption: str = "") -> Table:
    rows = [
        [name, *(_cell(p) for p in points), f"{slope(points):.2f}"]
        for name, points in found.items()
    ]
    lengths = [p["tokens"] for p in next(iter(found.values()))]
    return Table(
        [
            "variant",
            *(f"T={t:,}" for t in lengths),
            "growth from the seed's T to twice it: T^k, k =",
        ],
        rows,
        caption,
    )


def _cell(point: dict[str, Any]) -> str:
    if point.get("fits", True):
        return fmt_bytes(point["temp"])
    return f"{fmt_bytes(point['temp'])} (does not fit: the compiler's figure)"


def plot_sweep(found: dict[str, list[dict[str, int]]], ax: Any, title: str) -> None:
    """Temporaries against tokens on log-log axes, one line per variant."""
    for name, points in found.items():
        ax.loglog([p["tokens"] for p in points], [max(p["temp"], 1) / 2**20 for p in points],
                  "o-", label=f"{name} (T^{slope(points):.2f})")  # fmt: skip
    ax.set_xlabel("tokens T")
    ax.set_ylabel("temporaries (MiB)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)


def _gradient_of_sum(
    attend: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
) -> Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """The gradient of ``sum(attend(q, k, v))`` with respect to q, k and v (the program
    the reports measure: its output's gradient is a constant)."""

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    grad: Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
    grad = jax.grad(loss, argnums=(0, 1, 2))
    return grad


@functools.cache
def reported_program(name: str, target: str | None = None) -> MemoryReport:
    """The reports' program: the gradient of ``sum(attention)`` at the seed scale."""
    s = CASE.scales["seed"]
    program = jax.jit(_gradient_of_sum(ATTEND[name]))
    return measure(program, *_inputs(s["tokens"][0], 3), name=name, target=target)


def _seed_tokens() -> int:
    tokens: int = CASE.scales["seed"]["tokens"][0]
    return tokens


def _scores_bytes() -> int:
    """One float32 T x T score matrix per head at the seed scale."""
    s = CASE.scales["seed"]
    t: int = s["tokens"][0]
    return int(s["batch"] * s["heads"] * t * t * 4)


def reports_table(result: CaseResult, found: dict[str, list[dict[str, int]]]) -> Table:
    target = result.provenance.target or None
    cudnn = (
        f"cuDNN: {fmt_bytes(reported_program('cudnn', target).temp)} of temporaries"
        if "cudnn" in found
        else "cuDNN: not applicable on this target"
    )
    ours = [
        (f"XLA: {fmt_bytes(result.one('xla').temp)} of temporaries in the backward pass; " + cudnn),
        f"XLA's attention: temporaries grow as T^{slope(found['xla']):.2f}",
        (
            f"chunked under jax.checkpoint: T^{slope(found['chunked']):.2f}; "
            f"blockwise: T^{slope(found['blockwise']):.2f}"
        ),
    ]
    return cited_reports_table(REPORTS, ours, result.provenance.label())


# The claims this page decides, by key.
TEXT = {
    "quadratic": "XLA's attention needs memory quadratic in the sequence length "
    "(google/flax#2858).",
    "gradient-keeps-scores": "The gradient keeps T x T arrays alive: at least two float32 "
    "score matrices (the reports' program, the gradient of sum(attention)).",
    "cudnn-linear": "cuDNN's fused attention needs memory linear in T, and a small fraction "
    "of XLA's (jax-ml/jax PR #20145).",
    "chunked-linear": "Chunking the queries under jax.checkpoint makes the memory linear in T "
    "(Rabe & Staats).",
    "blockwise-bounded": "Blocks of queries and keys with their own gradient need little "
    "beyond the inputs and the gradients.",
}


def claims(
    result: CaseResult | None = None,
    found: dict[str, list[dict[str, int]]] | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
) -> list[Claim]:
    """The reports' claims and the common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        found: `sweep(...)` (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case("attention-scores", scale, target=target)
    if not result.select("xla"):  # the reproduction needs an API this JAX lacks
        why = next(s["reason"] for s in result.skipped if s["name"] == "xla")
        return [
            Claim(key, text, "not reproducible here", f"the reproduction was not built: {why}.")
            for key, text in TEXT.items()
        ]
    found = dict(found or sweep(target))
    target = result.provenance.target or None
    if "chunked" not in found:
        found["chunked"] = _swept("chunked", target, SWEEP)
    xla, chunked, blockwise = (result.one(n) for n in ("xla", "chunked", "blockwise"))
    reported = reported_program("xla", target)
    has_cudnn = "cudnn" in found
    cudnn_claim = (
        Claim(
            "cudnn-linear",
            TEXT["cudnn-linear"],
            verdict(slope(found["cudnn"]) <= 1.2 and result.one("cudnn").temp < 0.05 * xla.temp),
            f"temporaries grow as T^{slope(found['cudnn']):.2f}; "
            f"{fmt_bytes(result.one('cudnn').temp)} of temporaries against XLA's "
            f"{fmt_bytes(xla.temp)}.",
        )
        if has_cudnn
        else Claim(
            "cudnn-linear",
            TEXT["cudnn-linear"],
            "not reproducible here",
            "cuDNN compiles for NVIDIA GPUs only: " + (cudnn_unavailable(_platform(target)) or ""),
        )
    )
    return [
        Claim(
            "quadratic",
            TEXT["quadratic"],
            verdict(slope(found["xla"]) >= 1.8),
            f"temporaries of the backward pass from T={_seed_tokens():,} to twice it: "
            f"they grow as T^{slope(found['xla']):.2f}.",
        ),
        Claim(
            "gradient-keeps-scores",
            TEXT["gradient-keeps-scores"],
            verdict(reported.temp >= 2 * _scores_bytes()),
            f"{fmt_bytes(reported.temp)} of temporaries; one float32 T x T matrix per head "
            f"is {fmt_bytes(_scores_bytes())} ({reported.temp / _scores_bytes():.2f}x).",
        ),
        cudnn_claim,
        Claim(
            "chunked-linear",
            TEXT["chunked-linear"],
            verdict(slope(found["chunked"]) <= 1.2),
            f"temporaries grow as T^{slope(found['chunked']):.2f}; at the seed scale "
            f"{fmt_bytes(chunked.total)} against XLA's {fmt_bytes(xla.total)}.",
        ),
        Claim(
            "blockwise-bounded",
            TEXT["blockwise-bounded"],
            verdict(blockwise.total <= 1.25 * blockwise.lower_bound),
            f"{fmt_bytes(blockwise.temp)} of temporaries; total {fmt_bytes(blockwise.total)}, "
            f"{blockwise.overhead:.3f}x the floor (inputs and gradients).",
        ),
    ]
