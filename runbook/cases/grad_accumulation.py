"""`grad-accumulation`: a training step whose batch does not fit, split into micro-batches.

The backward pass reads what each layer computed for every example of the batch, so a
step's memory grows with its batch. Accumulating the gradients of `k` micro-batches before
one optimizer update holds one micro-batch's activations at a time, for an accumulator the
size of the parameters. Two ways: `optax.MultiSteps` wraps the optimizer, carries the
accumulator in its state and applies the update on every `k`-th call, each call taking one
micro-batch; or one step takes the whole batch and accumulates under `lax.scan` over its
micro-batches, in float32 or bfloat16. Reports: google-deepmind/optax#528 (MultiSteps'
accumulator is the size of the parameters), #320 (MultiSteps on a TPU, memory growing as
if the batch had), #472 (MultiSteps at ``every_k_schedule=1`` runs out of memory where the
plain optimizer does not), optax PR#596 (MultiSteps reworked to need less memory),
young-geng/EasyLM#36 (two accumulation steps run a TPU out of memory),
borisdayma/dalle-mini#88 and #122 (MultiSteps given up for a loop of one's own). The
functions below are the reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from .._case_types import Case, Variant
from ._setup import grad_accumulation as _setup

Params = list[jax.Array]  # one (width, width) matrix per layer

OPTIMIZER = optax.adam(1e-4)


def model(params: Params, x: jax.Array) -> jax.Array:
    """A stack of ``tanh(h @ w)`` layers: each one's output is what its backward pass reads."""
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return h


def loss(params: Params, x: jax.Array) -> jax.Array:
    """The mean over the batch's rows of the squared norm of the model's output."""
    return jnp.mean(jnp.sum(jnp.square(model(params, x)), axis=-1))


def train_step(
    params: Params,
    opt_state: Any,
    x: jax.Array,
    optimizer: optax.GradientTransformation = OPTIMIZER,
) -> tuple[Params, Any, jax.Array]:
    """The reproduction: one optimizer update from the gradient of the whole batch `x`."""
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def multisteps(every: int) -> optax.GradientTransformation:
    """Fix: `OPTIMIZER` under `optax.MultiSteps`, updating once every `every` calls.

    Call `train_step` with it once per micro-batch: its state carries the sum of the
    gradients so far (the accumulator, the size of the parameters) and the inner optimizer's
    state; on the `every`-th call it applies the mean gradient and starts a new sum.
    """
    return optax.MultiSteps(OPTIMIZER, every_k_schedule=every).gradient_transformation()


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    micro_batches: int,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, Any]:
    """Fix: the value and gradient of ``loss_fn(params, batch)``, a mean over the leading
    axis of every array in `batch`, computed one of `micro_batches` equal parts at a time
    under `lax.scan`. The parts' gradients are summed in an accumulator of `dtype` (float32,
    or bfloat16 for half the bytes); their mean is the whole batch's gradient, while the
    backward pass holds one part's activations at a time. Draw any random numbers for the
    whole batch first, and pass them in `batch`, for the same result."""
    parts = jax.tree.map(lambda a: a.reshape(micro_batches, -1, *a.shape[1:]), batch)

    def add(acc: Any, part: Any) -> tuple[Any, jax.Array]:
        value, grads = jax.value_and_grad(loss_fn)(params, part)
        return jax.tree.map(lambda a, g: a + g.astype(dtype), acc, grads), value

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, dtype), params)
    summed, values = lax.scan(add, zeros, parts)
    grads = jax.tree.map(lambda s, p: (s / micro_batches).astype(p.dtype), summed, params)
    return jnp.mean(values), grads


def accumulated_step(
    params: Params,
    opt_state: Any,
    x: jax.Array,
    micro_batches: int,
    dtype: Any = jnp.float32,
) -> tuple[Params, Any, jax.Array]:
    """Fix: one update from the whole batch `x`, its gradient summed over `micro_batches`
    equal parts under `lax.scan` (`accumulate_gradients`) in an accumulator of `dtype`."""
    value, grads = accumulate_gradients(loss, params, x, micro_batches, dtype)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def jit_step(step: Callable[..., Any]) -> Any:
    """A step as users jit it: the parameters and the optimizer state donated."""
    return jax.jit(step, donate_argnums=(0, 1))


def adam_moments(result: Any) -> Any:
    """What the same-result check compares: the updated parameters and Adam's two moments
    (wherever the optimizer state holds them), which a gradient's scale changes even where
    the first update, ``-lr * sign(g)`` for each weight, would not."""
    params, state, _ = result
    adam = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    return params, adam[0].mu, adam[0].nu


def _scan(dtype: Any) -> Callable[[Any], Any]:
    return lambda p: jit_step(
        functools.partial(accumulated_step, micro_batches=p["micro_batches"], dtype=dtype)
    )


def _multisteps(every: Callable[[Any], int]) -> Callable[[Any], Any]:
    return lambda p: jit_step(functools.partial(train_step, optimizer=multisteps(every(p))))


CASE = Case(
    name="grad-accumulation",
    title="A batch that does not fit, and what accumulating its gradients costs",
    symptom="a training step runs out of memory at the batch it needs; with optax.MultiSteps "
    "it holds a copy of the parameters more, and reports say it runs out of memory too",
    devices=1,
    scales=_setup.SCALES,
    variants=(
        Variant(
            "micro-batch",
            "baseline",
            "one micro-batch's step, no accumulation",
            lambda p: jit_step(train_step),
            args=_setup.inputs(OPTIMIZER.init, part=True),
        ),
        Variant(
            "full-batch",
            "reproduction",
            "the whole batch in one step",
            lambda p: jit_step(train_step),
        ),
        Variant(
            "multisteps-every-1",
            "baseline",
            "the whole batch, optax.MultiSteps(every_k_schedule=1)",
            _multisteps(lambda p: 1),
            args=_setup.inputs(multisteps(1).init),
        ),
        Variant(
            "multisteps",
            "fix",
            "optax.MultiSteps, one micro-batch per call",
            _multisteps(lambda p: p["micro_batches"]),
            args=_setup.inputs(multisteps(1).init, part=True),  # its state: the same for any k
            run=_setup.per_micro_batch(multisteps),
        ),
        Variant(
            "scan-f32",
            "fix",
            "one step, lax.scan over the micro-batches, float32 accumulator",
            _scan(jnp.float32),
        ),
        Variant(
            "scan-bf16",
            "fix",
            "one step, lax.scan over the micro-batches, bfloat16 accumulator",
            _scan(jnp.bfloat16),
        ),
    ),
    args=_setup.inputs(OPTIMIZER.init),
    grid=_setup.grid,
    floor=_setup.floor,
    tolerance=_setup.TOLERANCE,
    compare=adam_moments,
    runnable_scale="small",
    recommended="multisteps",
    cause="the backward pass reads every layer's activations for the whole batch at once",
)
