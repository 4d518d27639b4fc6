"""Score-based diffusion in equinox: an MLP-Mixer score model trained on MNIST-sized images.

The model is equinox's score-based diffusion example (Song et al., arXiv 2011.13456): the
image and its time are patched by a strided ``Conv2d``, mixed by MLP-Mixer blocks (a
patch-mixing and a channel-mixing MLP, each after a LayerNorm), and unpatched by a
``ConvTranspose2d``. The loss is denoising score matching with a variance-preserving SDE
(``int_beta(t) = t``, weight ``1 - exp(-t)``): one example's loss is vmapped over the
batch, at low-discrepancy times, and an ``eqx.filter_jit`` step takes its gradient and
applies AdaBelief.

Authors' scale: the example's ``main`` defaults: MNIST images ``(1, 28, 28)``, batch 256,
patch 4 (49 patches), hidden width 64, mixing widths 512 and 512, 4 blocks, ``t1 = 10``,
float32, ``optax.adabelief(3e-4)``.

Kept: the modules, shapes, loss and the step's signature (model, weight, int_beta, data,
t1, key, optimizer state, optimizer update), with the two lambdas as the example passes
them. Changed: the MNIST loader is left out (data are abstract); einops' rearranges are
written with `jnp` transposes; our own code throughout.

The fixes: vmap-materialize (the vmap-materialize case's fix, ``lax.map`` with a
``batch_size``: the examples a group at a time), donation (``donate="all"``), and
grad-accumulation (the batch's times and keys drawn whole, then
`runbook.cases.grad_accumulation.accumulate_gradients` over micro-batches of the examples).
Each group of the ``lax.map`` is not checkpointed: a checkpoint per group would keep one
group's activations for the backward pass at a time, which is grad-accumulation's
mechanism (and its fix's saving), not the vmapped temporaries'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

from runbook.cases.grad_accumulation import accumulate_gradients

from ._program import Built, RealProgram, register

SOURCE = (
    "https://github.com/patrick-kidger/equinox/blob/"
    "9336d820b2ef66b360fc6cb3611b3da5cefbb14d/docs/examples/score_based_diffusion.ipynb"
)

SIZES = {
    "authors": {"image": 28, "patch": 4, "hidden": 64, "mix_patch": 512, "mix_hidden": 512, "blocks": 4,
                    "batch": 256},
    "tiny": {"image": 8, "patch": 4, "hidden": 8, "mix_patch": 16, "mix_hidden": 16, "blocks": 2, "batch": 4},
}  # fmt: skip
T1 = 10.0
MAP_BATCH = 32  # examples per lax.map step in the vmap-materialize fix
ACCUMULATE = 8  # micro-batches in the grad-accumulation fix (32 examples each at batch 256)


class MixerBlock(eqx.Module):
    patch_mixer: eqx.nn.MLP
    hidden_mixer: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(
        self, patches: int, hidden: int, mix_patch: int, mix_hidden: int, *, key: jax.Array
    ):
        k1, k2 = jr.split(key)
        self.patch_mixer = eqx.nn.MLP(patches, patches, mix_patch, depth=1, key=k1)
        self.hidden_mixer = eqx.nn.MLP(hidden, hidden, mix_hidden, depth=1, key=k2)
        self.norm1 = eqx.nn.LayerNorm((hidden, patches))
        self.norm2 = eqx.nn.LayerNorm((patches, hidden))

    def __call__(self, y: jax.Array) -> jax.Array:  # (hidden, patches)
        y = y + jax.vmap(self.patch_mixer)(self.norm1(y))
        y = y.T
        y = y + jax.vmap(self.hidden_mixer)(self.norm2(y))
        return y.T


class Mixer2d(eqx.Module):
    conv_in: eqx.nn.Conv2d
    conv_out: eqx.nn.ConvTranspose2d
    blocks: list[MixerBlock]
    norm: eqx.nn.LayerNorm
    t1: float

    def __init__(self, s: dict[str, int], t1: float, *, key: jax.Array):
        patches = (s["image"] // s["patch"]) ** 2
        k_in, k_out, *k_blocks = jr.split(key, 2 + s["blocks"])
        self.conv_in = eqx.nn.Conv2d(2, s["hidden"], s["patch"], stride=s["patch"], key=k_in)
        self.conv_out = eqx.nn.ConvTranspose2d(
            s["hidden"], 1, s["patch"], stride=s["patch"], key=k_out
        )
        self.blocks = [
            MixerBlock(patches, s["hidden"], s["mix_patch"], s["mix_hidden"], key=k)
            for k in k_blocks
        ]
        self.norm = eqx.nn.LayerNorm((s["hidden"], patches))
        self.t1 = t1

    def __call__(self, t: jax.Array, y: jax.Array) -> jax.Array:
        _, height, width = y.shape
        time = jnp.broadcast_to(jnp.asarray(t / self.t1), (1, height, width))
        y = self.conv_in(jnp.concatenate([y, time]))
        hidden, ph, pw = y.shape
        y = y.reshape(hidden, ph * pw)
        for block in self.blocks:
            y = block(y)
        return self.conv_out(self.norm(y).reshape(hidden, ph, pw))


def single_loss_fn(
    model: Mixer2d,
    weight: Callable[[jax.Array], jax.Array],
    int_beta: Callable[[jax.Array], jax.Array],
    data: jax.Array,
    t: jax.Array,
    key: jax.Array,
) -> jax.Array:
    mean = data * jnp.exp(-0.5 * int_beta(t))
    std = jnp.sqrt(jnp.maximum(1 - jnp.exp(-int_beta(t)), 1e-5))
    noise = jr.normal(key, data.shape)
    pred = model(t, mean + std * noise)
    return weight(t) * jnp.mean((pred + noise / std) ** 2)


def _times_and_keys(batch: int, t1: float, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    tkey, losskey = jr.split(key)
    t = jr.uniform(tkey, (batch,), minval=0, maxval=t1 / batch)
    return t + (t1 / batch) * jnp.arange(batch), jr.split(losskey, batch)


def batch_loss_fn(
    model: Mixer2d, weight: Any, int_beta: Any, data: jax.Array, t1: float, key: jax.Array
) -> jax.Array:
    t, keys = _times_and_keys(data.shape[0], t1, key)
    per_example = functools.partial(single_loss_fn, model, weight, int_beta)
    return jnp.mean(jax.vmap(per_example)(data, t, keys))


def batch_loss_mapped(
    model: Mixer2d, weight: Any, int_beta: Any, data: jax.Array, t1: float, key: jax.Array
) -> jax.Array:
    """The vmap-materialize fix: the examples `MAP_BATCH` at a time under
    ``lax.map(..., batch_size=...)``, as the case's fix has it."""
    t, keys = _times_and_keys(data.shape[0], t1, key)
    per_example = functools.partial(single_loss_fn, model, weight, int_beta)
    losses = jax.lax.map(lambda xs: per_example(*xs), (data, t, keys), batch_size=MAP_BATCH)
    return jnp.mean(losses)


def make_step(
    model: Mixer2d,
    weight: Any,
    int_beta: Any,
    data: jax.Array,
    t1: float,
    key: jax.Array,
    opt_state: Any,
    opt_update: Any,
    loss: Callable[..., jax.Array] = batch_loss_fn,
) -> tuple[jax.Array, Mixer2d, jax.Array, Any]:
    value, grads = eqx.filter_value_and_grad(loss)(model, weight, int_beta, data, t1, key)
    updates, opt_state = opt_update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return value, model, jr.split(key, 1)[0], opt_state


def make_step_accumulated(
    model: Mixer2d,
    weight: Any,
    int_beta: Any,
    data: jax.Array,
    t1: float,
    key: jax.Array,
    opt_state: Any,
    opt_update: Any,
) -> tuple[jax.Array, Mixer2d, jax.Array, Any]:
    """The grad-accumulation fix: the batch's times and keys drawn whole, as `make_step`
    draws them, then the gradient summed over `ACCUMULATE` micro-batches of the examples."""
    t, keys = _times_and_keys(data.shape[0], t1, key)
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params: Any, part: tuple[jax.Array, ...]) -> jax.Array:
        per_example = functools.partial(
            single_loss_fn, eqx.combine(params, static), weight, int_beta
        )
        return jnp.mean(jax.vmap(per_example)(*part))

    micro_batches = min(ACCUMULATE, data.shape[0])
    value, grads = accumulate_gradients(loss, params, (data, t, keys), micro_batches)
    updates, opt_state = opt_update(grads, opt_state)
    model = eqx.apply_updates(model, updates)
    return value, model, jr.split(key, 1)[0], opt_state


def int_beta(t: jax.Array) -> jax.Array:
    return t


def weight(t: jax.Array) -> jax.Array:
    return 1 - jnp.exp(-int_beta(t))


def _build(
    scale: str,
    concrete: bool,
    mapped: bool = False,
    donate: bool = False,
    accumulate: bool = False,
) -> Built:
    s = SIZES[scale]
    opt = optax.adabelief(3e-4)

    def init(key: jax.Array) -> tuple[Mixer2d, Any]:
        model = Mixer2d(s, T1, key=key)
        return model, opt.init(eqx.filter(model, eqx.is_inexact_array))

    model_key, train_key = jr.split(jr.PRNGKey(5678))
    data: Any
    train_key_arg: Any = train_key
    shape = (s["batch"], 1, s["image"], s["image"])
    if concrete:
        model, opt_state = init(model_key)
        data = jr.normal(jax.random.key(0), shape)
    else:
        model, opt_state = eqx.filter_eval_shape(init, model_key)
        data = jax.ShapeDtypeStruct(shape, jnp.float32)
        train_key_arg = jax.ShapeDtypeStruct(train_key.shape, train_key.dtype)
    step_fn: Callable[..., Any] = make_step
    if mapped:
        step_fn = functools.partial(make_step, loss=batch_loss_mapped)
    if accumulate:
        step_fn = make_step_accumulated
    step = eqx.filter_jit(step_fn, donate="all" if donate else "none")
    return step, (model, weight, int_beta, data, T1, train_key_arg, opt_state, opt.update)


def build(scale: str, concrete: bool) -> Built:
    return _build(scale, concrete)


register(
    RealProgram(
        name="eqx-score-diffusion",
        model="MLP-Mixer score model, equinox, denoising score matching on MNIST, vmap loss",
        source=SOURCE,
        libraries=("equinox", "optax"),
        build=build,
        fixes={
            "vmap-materialize": functools.partial(_build, mapped=True),
            "donation": functools.partial(_build, donate=True),
            "grad-accumulation": functools.partial(_build, accumulate=True),
        },
        tolerance=1e-4,
        notes="The MNIST loader is left out; einops rearranges written with jnp.",
    )
)
