"""The `frozen-params` page's machinery: where the frozen weights' zero gradients cost
memory (jax-ml/jax#23316's question, asked of each compiler), what reverse mode stores
under stop_gradient, the reports' claims decided, and the tables beside them.

The reproduction and its fixes are in `runbook.cases.frozen_params`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from .._buffers import Buffer
from .._case import CaseResult, measure_case
from .._errors import DoesNotFitError
from .._measure import MemoryReport, measure
from .._render import Table, fmt_bytes
from .._targets import get_target
from ..cases._setup import frozen_params as setup
from ..cases.frozen_params import (
    CASE,
    OPTIMIZER,
    PROGRAMS,
    Params,
    grad_stop_gradient,
    grad_trainable,
    jit_step,
    loss_stopped,
    masked_optimizer,
    step_stop_gradient,
    step_trainable,
)
from ._claims import Claim, verdict
from ._history import Note
from ._pages import cited_reports_table
from .scan_residuals import saved_residuals

# What the reports say, quoted; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#23316": "LoRA fine-tuning: most of the gradient pytree is zeros; the optimization "
    "that removes them 'does happen sometimes but not always' (open)",
    "nstarman/quax#248": "the zero gradient of a frozen weight is genuinely allocated",
    "jax-ml/jax#4853": "forward intermediates under stop_gradient inside a scan are saved for "
    "the backward pass",
}

RECOMMENDED = CASE.recommended or "trainable-remat"  # the fix the page recommends


def grad_adapters_part(
    params: Params, x: jax.Array, y: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The whole tree's gradient (stop_gradient on the frozen weights), adapters' part returned."""
    value, grads = grad_stop_gradient(params, x, y)
    return value, grads["lora"]


def step_sgd_stop_gradient(
    params: Params, x: jax.Array, y: jax.Array, lr: float = 1e-3
) -> tuple[Params, jax.Array]:
    """Train step: stop_gradient on the frozen weights, plain SGD on the whole tree."""
    value, grads = grad_stop_gradient(params, x, y)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), value


def step_sgd_trainable(
    params: Params, x: jax.Array, y: jax.Array, lr: float = 1e-3
) -> tuple[Params, jax.Array]:
    """Train step: plain SGD on the adapters only."""
    value, grads = grad_trainable(params, x, y)
    lora = jax.tree.map(lambda p, g: p - lr * g, params["lora"], grads)
    return {"frozen": params["frozen"], "lora": lora}, value


def step_masked_stop_gradient(
    params: Params, opt_state: Any, x: jax.Array, y: jax.Array
) -> tuple[Params, Any, jax.Array]:
    """Train step: stop_gradient on the frozen weights, then `masked_optimizer`."""
    value, grads = grad_stop_gradient(params, x, y)
    updates, opt_state = masked_optimizer().update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def zero_programs(scale: Mapping[str, Any]) -> list[tuple[str, Any, Any, tuple[Any, ...]]]:
    """Programs that differentiate with stop_gradient on the frozen weights and differ in
    what consumes the gradient: (what happens to it, the program, the same program for the
    adapters only, the abstract args of each)."""
    params = setup.params(scale, False)
    batch = setup.batch(scale, False)
    whole = jax.eval_shape(OPTIMIZER.init, params)
    masked = jax.eval_shape(masked_optimizer().init, params)
    lora = jax.eval_shape(OPTIMIZER.init, params["lora"])
    sgd = functools.partial(jax.jit, donate_argnums=0)
    adapters_step = jit_step(step_trainable)
    return [
        ("returned from jit", grad_stop_gradient, grad_trainable, ((params, *batch),) * 2),
        (
            "consumed in jit: only the adapters' part returned",
            grad_adapters_part,
            grad_trainable,
            ((params, *batch),) * 2,
        ),
        (
            "consumed in jit: SGD on the whole tree",
            sgd(step_sgd_stop_gradient),
            sgd(step_sgd_trainable),
            ((params, *batch),) * 2,
        ),
        (
            "consumed in jit: optax.multi_transform with set_to_zero",
            jit_step(step_masked_stop_gradient),
            adapters_step,
            ((params, masked, *batch), (params, lora, *batch)),
        ),
        (
            "consumed in jit: Adam on the whole tree",
            jit_step(step_stop_gradient),
            adapters_step,
            ((params, whole, *batch), (params, lora, *batch)),
        ),
    ]


def frozen_sized(report: MemoryReport, scale: Mapping[str, Any]) -> list[Buffer]:
    """Outputs and temporaries of `report` shaped like the frozen weights (the report must be
    measured with ``buffers=True``): zero gradients, copies, optimizer work on them."""
    shape = "f32[{layers},{width},{width}]".format(**scale)
    return [b for b in report.buffers if b.shape == shape and b.kind in ("output", "temp")]


def zero_costs(scale_name: str = "seed", target: str | None = None) -> list[dict[str, Any]]:
    """jax-ml/jax#23316's question: where do the frozen weights' zero gradients cost memory?

    Every program of `zero_programs` is measured, and so is its adapters-only twin. Each
    row: ``label``, ``report``, ``extra`` (bytes beyond the twin), ``zeros`` (a frozen-sized
    buffer made by broadcasting zeros exists) and ``frozen_sized`` (those buffers).
    """
    scale = CASE.scales[scale_name]
    rows = []
    for label, fn, twin, (args, twin_args) in zero_programs(scale):
        r = measure(fn, *args, buffers=True, target=target)
        found = frozen_sized(r, scale)
        rows.append(
            {
                "label": label,
                "report": r,
                "extra": r.total - measure(twin, *twin_args, target=target).total,
                "zeros": any(b.op.endswith("broadcast_in_dim") for b in found),
                "frozen_sized": found,
            }
        )
    return rows


def zeros_table(costs: list[dict[str, Any]]) -> Table:
    """`zero_costs` as a table."""
    rows = [
        [
            c["label"],
            fmt_bytes(c["report"].total),
            fmt_bytes(c["extra"]),
            "yes" if c["zeros"] else "no",
            "; ".join(
                f"{b.kind} {fmt_bytes(b.size)} ({b.op.rsplit('/', 1)[-1] or b.instruction})"
                for b in c["frozen_sized"]
            )
            or "none",
        ]
        for c in costs
    ]
    return Table(
        [
            "the gradient is",
            "total",
            "beyond the adapters-only program",
            "zero gradients allocated?",
            "frozen-sized outputs and temporaries",
        ],
        rows,
        "stop_gradient on the frozen weights in every program; each is compared with the same "
        f"program for the adapters only. {costs[0]['report'].provenance.label()}.",
    )


def zeros_by_compiler(targets: Sequence[str]) -> list[Any]:
    """jax-ml/jax#23316's question answered for each compile target: `zeros_table` per
    target, at seed scale, or at the runnable scale where the seed does not fit a device."""
    items: list[Any] = []
    for target in targets:
        for scale in ("seed", CASE.runnable_scale):
            try:
                items.append(zeros_table(zero_costs(scale, target=target)))
                break
            except DoesNotFitError as e:
                items.append(Note(f"{target}, scale {scale!r}: {e}."))
    return items


def loss_stopped_branch(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    """jax-ml/jax#4853's pattern: each layer's frozen branch computed under stop_gradient."""

    def layer(
        h: jax.Array, weights: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, None]:
        w, a, b = weights
        return jnp.tanh(lax.stop_gradient(h @ w) + (h @ a) @ b), None

    weights = (params["frozen"]["w"], params["lora"]["a"], params["lora"]["b"])
    h, _ = lax.scan(layer, x, weights)
    return jnp.mean((h - y) ** 2)


def stored_for_backward(scale_name: str = "seed") -> dict[str, int]:
    """What `print_saved_residuals` lists for two gradients of the model, in bytes.

    ``stopped branch``: `loss_stopped_branch` (jax-ml/jax#4853's pattern: each layer's
    frozen product under stop_gradient); ``stopped weights``: `loss_stopped` (the frozen
    weights under stop_gradient, the product differentiable). ``... weights`` entries count
    the residuals shaped like the frozen weights; the others count the rest (activations).
    """
    scale = CASE.scales[scale_name]
    args = (setup.params(scale, False), *setup.batch(scale, False))
    frozen = "f32[{layers},{width},{width}]".format(**scale)
    out = {}
    for key, fn in (("stopped branch", loss_stopped_branch), ("stopped weights", loss_stopped)):
        saved = saved_residuals(fn, *args)
        out[key] = sum(size for shape, size, _ in saved if shape != frozen)
        out[f"{key}, weights"] = sum(size for shape, size, _ in saved if shape == frozen)
    return out


def fix_table(result: CaseResult) -> Table:
    """Each variant at each program: bytes, floor, saving against the reproduction."""
    rows = []
    for program in PROGRAMS:
        repro = result.one("stop-gradient", program=program)
        for v in CASE.variants:
            r = result.one(v.name, program=program)
            rows.append(
                [
                    program,
                    v.name,
                    v.summary,
                    fmt_bytes(r.total),
                    fmt_bytes(r.lower_bound),
                    f"{r.overhead:.3f}x",
                    f"{repro.total / r.total:.2f}x",
                ]
            )
    return Table(
        ["program", "variant", "what it does", "total", "floor", "total / floor", "saving"],
        rows,
        "Floor: weights, batch, the adapters' gradients (and Adam moments for a train step) and "
        "one stored activation per layer. Saving: the reproduction's bytes / the variant's, same "
        f"program. {result.provenance.label()}.",
    )


OFFLOADED = "trainable-offload"


def offload_table(targets: Sequence[str]) -> Table:
    """`trainable-offload` against the recommended fix, both programs at seed scale compiled
    for each target: what each leaves on the device, what offloading keeps in host memory."""
    rows, labels = [], []
    for target in targets:
        both = measure_case(CASE.name, target=target, variants=[OFFLOADED, RECOMMENDED])
        for program in PROGRAMS:
            off, kept = both.one(OFFLOADED, program=program), both.one(RECOMMENDED, program=program)
            rows.append(
                [
                    get_target(target).label,
                    program,
                    fmt_bytes(off.total),
                    fmt_bytes(off.host_total),
                    f"{off.overhead:.2f}x",
                    fmt_bytes(kept.total),
                    fmt_bytes(kept.total - off.total),
                ]
            )
        labels.append(both.provenance.label())
    return Table(
        ["target", "program", f"{OFFLOADED} on the device", "in host memory",
         "device total / floor", f"{RECOMMENDED} on the device", "device bytes saved"],
        rows,
        "Seed scale, compile-time predictions per target. The device floor counts no stored "
        f"activation, since offloading keeps them in host memory. {'; '.join(labels)}.",
    )  # fmt: skip


def reports_table(
    result: CaseResult, costs: list[dict[str, Any]], stored: Mapping[str, int]
) -> Table:
    """What each report says beside the figure we measure for the same effect.

    `costs` is `zero_costs()`; `stored` is `stored_for_backward()`.
    """
    kept = [c["label"] for c in costs if c["zeros"]]
    zeros = costs[0]["frozen_sized"]
    ours = [
        (
            f"zero gradients allocated in {len(kept)} of {len(costs)} programs "
            f"({'; '.join(kept) or 'none'}); a train step with Adam on the whole tree needs "
            f"{fmt_bytes(costs[-1]['extra'])} more than the adapters-only step"
        ),
        (
            f"returned from jit: an {zeros[0].kind} of {fmt_bytes(zeros[0].size)} made by "
            f"{zeros[0].op.rsplit('/', 1)[-1]}"
            if zeros
            else "returned from jit: no frozen-sized buffer"
        ),
        (
            f"activations stored for the backward pass: {fmt_bytes(stored['stopped branch'])} "
            "with each layer's frozen product under stop_gradient, "
            f"{fmt_bytes(stored['stopped weights'])} with it differentiable"
        ),
    ]
    return cited_reports_table(
        REPORTS, ours, f"{result.provenance.label()}; compile time, {result.scale} scale."
    )


# The variants the claims read: a release that cannot build trainable-offload (no memory
# kinds on jax 0.4.30's CPU) still decides them.
CLAIMED = ("stop-gradient", "masked", "trainable-only")


def claims(
    result: CaseResult | None = None,
    costs: list[dict[str, Any]] | None = None,
    stored: Mapping[str, int] | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
) -> list[Claim]:
    """The claims of the reports and of common advice, decided by measurements at seed scale.

    Args:
        result: the case measured (measured here when not given).
        costs: `zero_costs` for the same compiler (measured here when not given).
        stored: `stored_for_backward` (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case("frozen-params", scale, target=target, variants=CLAIMED)
    target = result.provenance.target or None
    costs = costs or zero_costs(result.scale, target=target)
    stored = stored or stored_for_backward(result.scale)
    at: Callable[[str, str], MemoryReport] = lambda name, program: result.one(name, program=program)
    kept = [c for c in costs if c["zeros"]]
    removed = [c for c in costs if not c["zeros"]]
    frozen = setup.sizes(CASE.scales[result.scale])["frozen"]
    out = []

    returned = costs[0]
    zeros = returned["frozen_sized"]
    out.append(
        Claim(
            "allocated",
            "The zero gradients of frozen weights are genuinely allocated (nstarman/quax#248).",
            verdict(returned["zeros"]),
            f"when the gradient is returned from jit: an output of "
            f"{fmt_bytes(zeros[0].size) if zeros else '-'} made by broadcast_in_dim, "
            f"{fmt_bytes(returned['extra'])} beyond the "
            f"adapters-only gradient (the frozen weights are {fmt_bytes(frozen)}). Consumed "
            f"inside the same jit they are not: {len(removed)} of {len(costs)} programs have no "
            "such buffer.",
        )
    )
    out.append(
        Claim(
            "sometimes",
            "XLA removes the zero gradients sometimes but not always (jax-ml/jax#23316).",
            verdict(bool(kept) and bool(removed)),
            "allocated: "
            + "; ".join(c["label"] for c in kept)
            + ". Removed: "
            + "; ".join(c["label"] for c in removed)
            + ". In these programs a zero gradient costs memory only when it leaves the jit; "
            "inside it, XLA folds the zeros into their consumers. An optimizer that keeps state for the "
            f"frozen weights costs memory anyway: Adam on the whole tree needs "
            f"{fmt_bytes(costs[-1]['extra'])} more than on the adapters only.",
        )
    )
    out.append(
        Claim(
            "stop-gradient-scan",
            "Forward intermediates under stop_gradient inside a scan are saved for the backward "
            "pass (jax-ml/jax#4853).",
            verdict(stored["stopped branch"] > stored["stopped weights"]),
            "print_saved_residuals, activations: "
            f"{fmt_bytes(stored['stopped branch'])} with each layer's frozen product "
            f"under stop_gradient, {fmt_bytes(stored['stopped weights'])} with the product "
            "differentiable (only the weights stopped). With the weights stopped it also lists "
            f"{fmt_bytes(stored['stopped weights, weights'])} of frozen weights as residuals, "
            "which the compiled program does not copy: its temporaries are "
            f"{fmt_bytes(at('stop-gradient', 'gradient').temp)}, the adapters-only gradient's "
            f"{fmt_bytes(at('trainable-only', 'gradient').temp)}.",
        )
    )
    adam = costs[-1]
    out.append(
        Claim(
            "stop-gradient-free",
            "Putting the frozen weights under stop_gradient freezes them at no memory cost.",
            verdict(max(c["extra"] for c in costs) <= 0.01 * frozen),
            f"the gradient returned from jit holds {fmt_bytes(returned['extra'])} of zeros; a "
            f"train step with Adam on the whole tree needs {fmt_bytes(adam['extra'])} more than "
            "the adapters-only step (Adam's two moments of every frozen weight, and "
            f"{len(adam['frozen_sized'])} frozen-sized temporaries).",
        )
    )
    masked, only = at("masked", "train step"), at("trainable-only", "train step")
    out.append(
        Claim(
            "masking-wastes",
            "Masking after the gradient (optax.multi_transform with set_to_zero) still pays for "
            "the frozen weights' gradient in a train step.",
            verdict(masked.total > 1.01 * only.total),
            f"masked train step {fmt_bytes(masked.total)}, adapters-only {fmt_bytes(only.total)}: "
            "the frozen gradient is never used, and XLA removes its computation. Returned "
            f"from jit, the masked gradient holds the zeros: "
            f"{fmt_bytes(at('masked', 'gradient').total)} vs "
            f"{fmt_bytes(at('trainable-only', 'gradient').total)}.",
        )
    )
    return out
