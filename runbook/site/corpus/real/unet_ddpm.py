"""DDPM's UNet on CIFAR-10 (score_sde's flax port), one training step.

The model (flax.linen) is the DDPM UNet as score_sde ports it from Ho et al.: a 3x3
input convolution, four resolutions (32, 16, 8, 4) of two residual blocks each with
channel multipliers (1, 2, 2, 2) of 128, single-head spatial self-attention after every
residual block at 16x16 and in the middle (at 4x4), nearest-neighbour upsampling and
strided-convolution downsampling with convolutions, GroupNorm (32 groups), swish, dropout
0.1, and a sinusoidal timestep embedding through two dense layers that each residual
block adds as a per-channel bias. The step is score_sde's DDPM loss (``vpsde``, discrete,
1000 linear betas from 1e-4 to 0.02): a random timestep and Gaussian noise per image, the
noised image, the mean squared error of the predicted noise; then a global-norm clip at
1, Adam (lr 2e-4 with a 5000-step warmup) and an EMA of the parameters (rate 0.9999).

Authors' scale (score_sde configs/vp/ddpm/cifar10.py and default_cifar10_configs.py):
batch 128 of 32x32x3 images, nf=128, ch_mult (1, 2, 2, 2), num_res_blocks 2,
attn_resolutions (16,), float32. Kept: the modules, initialisers (DDPM's fan-avg uniform),
the loss, the optimizer update and EMA, and the donation of the carried state. Changed:
score_sde `jax.pmap`s the batch over a host's devices and `lax.scan`s 5 steps per call;
here one device runs one step on the whole batch of 128 under `jax.jit`; flax.optim's Adam
is `optax.scale_by_adam` with the same hyper-parameters; the data pipeline and the
step's logged loss history are left out.

The fixes:

- attention-scores: the runbook's `attention_blockwise` with ``causal=False`` (every
  position attends to every other) at its default scale, ``1/sqrt(C)``, score_sde's own:
  blocks of 64 positions at 16x16 (at 4x4, one block of 16), and a gradient of its own that
  recomputes each score block, so the gradient keeps no ``256 x 256`` score matrix per image.
- scan-residuals: `nn.remat` of each residual block and attention block.
- grad-accumulation: the batch's timesteps and noise drawn whole, as the step draws them,
  then the gradient summed over micro-batches of the images
  (`runbook.cases.grad_accumulation.accumulate_gradients`) before one update. Each
  micro-batch draws its own dropout masks, from a key of its own: masks drawn for a
  micro-batch's shape are not rows of the whole batch's, so this fix is checked against the
  step with dropout off in both (`RealProgram.compared`); at the authors' scale both keep
  dropout at 0.1.

No donation fix: score_sde's pmap already donates the carried state. No prng-temporaries
fix: drawing the dropout masks and the noise with another generator ("rbg") gives other
random numbers, so the results would not compare value by value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from runbook.cases.attention_scores import attention_blockwise
from runbook.cases.grad_accumulation import accumulate_gradients

from ._program import Builder, Built, RealProgram, register

SOURCE = (
    "https://github.com/yang-song/score_sde/blob/"
    "0acb9e0ea3b8cccd935068cd9c657318fbc6ce4c/models/ddpm.py"
)
SCALES: dict[str, dict[str, Any]] = {
    "authors": {"image": 32, "nf": 128, "ch_mult": (1, 2, 2, 2), "blocks": 2,
                "attn": (16,), "batch": 128, "block": 64, "step": 0},
    "tiny": {"image": 16, "nf": 32, "ch_mult": (1, 2), "blocks": 1,
             "attn": (8,), "batch": 4, "block": 16, "step": 2500},
}  # fmt: skip
# "block": positions per block of the attention-scores fix, at most: four blocks over the
# attention's positions (authors' 16 x 16, tiny's 8 x 8), so that even the tiny same-result
# test goes through the online softmax across blocks; the 4 x 4 middle takes one block.
N_STEPS, BETA_MIN, BETA_MAX = 1000, 0.1, 20.0
LR, WARMUP, GRAD_CLIP, EMA_RATE, DROPOUT = 2e-4, 5000, 1.0, 0.9999, 0.1
ACCUMULATE = 8  # micro-batches in the grad-accumulation fix (16 images each at 128)


def default_init(scale: float = 1.0) -> Any:
    """DDPM's initialisation: fan-average uniform variance scaling."""
    return nn.initializers.variance_scaling(1e-10 if scale == 0 else scale, "fan_avg", "uniform")


def conv3x3(x: jax.Array, out: int, stride: int = 1, init_scale: float = 1.0) -> jax.Array:
    return nn.Conv(out, (3, 3), strides=(stride, stride), padding="SAME",
                   kernel_init=default_init(init_scale))(x)  # fmt: skip


class NIN(nn.Module):
    """A 1x1 "network in network" projection over the channels."""

    units: int
    init_scale: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("W", default_init(self.init_scale), (x.shape[-1], self.units))
        b = self.param("b", nn.initializers.zeros, (self.units,))
        return jnp.tensordot(x, w, 1) + b


def attention_full(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """score_sde's attention: every position attends to every other, ``(B, N, N)`` scores."""
    del block
    w = jax.nn.softmax(jnp.einsum("bqc,bkc->bqk", q, k) * q.shape[-1] ** -0.5, axis=-1)
    return jnp.einsum("bqk,bkc->bqc", w, v)


def attention_blocks(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    """The fix: the runbook's `attention_blockwise`, not causal, at its default scale
    ``1/sqrt(C)`` (score_sde's); one head, ``(B, N, C)`` as its ``(B, N, 1, C)``."""
    b, n, c = q.shape
    block = min(block, n)  # the middle block attends over 4 x 4 positions only
    assert n % block == 0, (n, block)
    heads = (x.reshape(b, n, 1, c) for x in (q, k, v))
    return attention_blockwise(*heads, block=block, causal=False).reshape(b, n, c)


class AttnBlock(nn.Module):
    attention: Callable[..., jax.Array]
    block: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, hh, ww, c = x.shape
        h = nn.GroupNorm()(x)
        q, k, v = (NIN(c)(h).reshape(b, hh * ww, c) for _ in range(3))
        h = self.attention(q, k, v, self.block).reshape(b, hh, ww, c)
        return x + NIN(c, init_scale=0.0)(h)


class ResnetBlockDDPM(nn.Module):
    out_ch: int | None = None
    dropout: float = DROPOUT

    @nn.compact
    def __call__(self, x: jax.Array, temb: jax.Array, train: bool = True) -> jax.Array:
        c = x.shape[-1]
        out_ch = self.out_ch or c
        h = conv3x3(nn.swish(nn.GroupNorm()(x)), out_ch)
        h += nn.Dense(out_ch, kernel_init=default_init())(nn.swish(temb))[:, None, None, :]
        h = nn.Dropout(self.dropout)(nn.swish(nn.GroupNorm()(h)), deterministic=not train)
        h = conv3x3(h, out_ch, init_scale=0.0)
        if c != out_ch:
            x = NIN(out_ch)(x)
        return x + h


def timestep_embedding(t: jax.Array, dim: int, max_positions: int = 10_000) -> jax.Array:
    half = dim // 2
    freq = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(math.log(max_positions) / (half - 1)))
    emb = t[:, None] * freq[None, :]
    return jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=1)


class DDPM(nn.Module):
    nf: int
    ch_mult: tuple[int, ...]
    num_res_blocks: int
    attn_resolutions: tuple[int, ...]
    block: int
    attention: Callable[..., jax.Array] = attention_full
    remat: bool = False
    dropout: float = DROPOUT

    @nn.compact
    def __call__(self, x: jax.Array, labels: jax.Array, train: bool = True) -> jax.Array:
        res_cls: Any = (
            nn.remat(ResnetBlockDDPM, static_argnums=(3,)) if self.remat else ResnetBlockDDPM
        )
        attn_cls: Any = nn.remat(AttnBlock) if self.remat else AttnBlock
        made = {"res": 0, "attn": 0}

        # Named as flax names them unwrapped, so that the remat fix keeps the parameters' paths.
        def res(out_ch: int | None = None) -> Any:
            made["res"] += 1
            return res_cls(out_ch, self.dropout, name=f"ResnetBlockDDPM_{made['res'] - 1}")

        def attn() -> Any:
            made["attn"] += 1
            return attn_cls(self.attention, self.block, name=f"AttnBlock_{made['attn'] - 1}")

        temb = timestep_embedding(labels, self.nf)
        temb = nn.Dense(self.nf * 4, kernel_init=default_init())(temb)
        temb = nn.Dense(self.nf * 4, kernel_init=default_init())(nn.swish(temb))

        hs = [conv3x3(x, self.nf)]  # data centred: the input is in [-1, 1]
        levels = len(self.ch_mult)
        for level, mult in enumerate(self.ch_mult):
            for _ in range(self.num_res_blocks):
                h = res(out_ch=self.nf * mult)(hs[-1], temb, train)
                if h.shape[1] in self.attn_resolutions:
                    h = attn()(h)
                hs.append(h)
            if level != levels - 1:
                hs.append(conv3x3(hs[-1], hs[-1].shape[-1], stride=2))

        h = res()(hs[-1], temb, train)
        h = attn()(h)
        h = res()(h, temb, train)

        for level in reversed(range(levels)):
            for _ in range(self.num_res_blocks + 1):
                h = res(out_ch=self.nf * self.ch_mult[level])(
                    jnp.concatenate([h, hs.pop()], axis=-1), temb, train
                )
            if h.shape[1] in self.attn_resolutions:
                h = attn()(h)
            if level != 0:
                b, hh, ww, c = h.shape
                h = jax.image.resize(h, (b, hh * 2, ww * 2, c), "nearest")
                h = conv3x3(h, c)
        return conv3x3(nn.swish(nn.GroupNorm()(h)), x.shape[-1], init_scale=0.0)


def _vpsde() -> tuple[jax.Array, jax.Array]:
    betas = jnp.linspace(BETA_MIN / N_STEPS, BETA_MAX / N_STEPS, N_STEPS)
    cumprod = jnp.cumprod(1.0 - betas)
    return jnp.sqrt(cumprod), jnp.sqrt(1.0 - cumprod)


def _draws(step_rng: jax.Array, data: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step's random numbers for the whole batch, in its order: each image's timestep
    and noise, and the key that the dropout key is split from next."""
    r, k_t = jax.random.split(step_rng)
    labels = jax.random.choice(k_t, N_STEPS, shape=(data.shape[0],))
    r, k_noise = jax.random.split(r)
    return labels, jax.random.normal(k_noise, data.shape), r


def _loss(score: jax.Array, noise: jax.Array) -> jax.Array:
    """The mean over images of each image's mean squared error of the predicted noise."""
    return jnp.mean(jnp.mean(jnp.square(score - noise).reshape(noise.shape[0], -1), axis=-1))


def _perturb(data: jax.Array, labels: jax.Array, noise: jax.Array) -> jax.Array:
    """The noised image at each example's timestep (vpsde, discrete)."""
    sqrt_a, sqrt_1ma = _vpsde()
    return (sqrt_a[labels][:, None, None, None] * data
            + sqrt_1ma[labels][:, None, None, None] * noise)  # fmt: skip


def _update(tx: optax.GradientTransformation, state: Any, grad: Any) -> Any:
    """score_sde's update: the global-norm clip, Adam with warmup, and the EMA."""
    lr = LR * jnp.minimum(state["step"] / WARMUP, 1.0)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grad)))
    grad = jax.tree.map(lambda g: g * GRAD_CLIP / jnp.maximum(norm, GRAD_CLIP), grad)
    updates, opt_state = tx.update(grad, state["opt_state"])
    params = jax.tree.map(lambda p, u: p - lr * u, state["params"], updates)
    ema = jax.tree.map(lambda e, p: e * EMA_RATE + p * (1.0 - EMA_RATE),
                       state["params_ema"], params)  # fmt: skip
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
            "params_ema": ema}  # fmt: skip


def _step_fn(model: DDPM, tx: optax.GradientTransformation) -> Callable[..., Any]:
    def step_fn(carry: tuple[jax.Array, Any], batch: dict[str, jax.Array]) -> Any:
        rng, state = carry
        rng, step_rng = jax.random.split(rng)

        def loss_fn(params: Any) -> jax.Array:
            data = batch["image"]
            labels, noise, r = _draws(step_rng, data)
            perturbed = _perturb(data, labels, noise)
            _, k_drop = jax.random.split(r)
            score = cast(
                jax.Array,
                model.apply({"params": params}, perturbed, labels, rngs={"dropout": k_drop}),
            )
            return _loss(score, noise)

        loss, grad = jax.value_and_grad(loss_fn)(state["params"])
        return (rng, _update(tx, state, grad)), loss

    return step_fn


def _accumulated_step_fn(
    model: DDPM, tx: optax.GradientTransformation, micro_batches: int
) -> Callable[..., Any]:
    """The grad-accumulation fix: the timesteps and noise drawn whole, as `_step_fn` draws
    them, then the gradient summed over `micro_batches` parts of the images, each with a
    dropout key of its own."""

    def step_fn(carry: tuple[jax.Array, Any], batch: dict[str, jax.Array]) -> Any:
        rng, state = carry
        rng, step_rng = jax.random.split(rng)
        data = batch["image"]
        labels, noise, r = _draws(step_rng, data)
        _, k_drop = jax.random.split(r)
        # One dropout key per micro-batch: each part receives its own as a row of one.
        k_drops = jax.random.split(k_drop, micro_batches)

        def loss_fn(params: Any, part: tuple[jax.Array, ...]) -> jax.Array:
            x, t, eps, key = part
            score = cast(
                jax.Array,
                model.apply({"params": params}, _perturb(x, t, eps), t,
                            rngs={"dropout": key[0]}),
            )  # fmt: skip
            return _loss(score, eps)

        loss, grad = accumulate_gradients(
            loss_fn, state["params"], (data, labels, noise, k_drops), micro_batches
        )
        return (rng, _update(tx, state, grad)), loss

    return step_fn


def _builder(
    blockwise: bool = False, remat: bool = False, accumulate: bool = False,
    dropout: float = DROPOUT,
) -> Builder:  # fmt: skip
    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        model = DDPM(
            s["nf"], s["ch_mult"], s["blocks"], s["attn"], s["block"],
            attention_blocks if blockwise else attention_full, remat, dropout,
        )  # fmt: skip
        tx = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)
        step_fn = (
            _accumulated_step_fn(model, tx, min(ACCUMULATE, s["batch"]))
            if accumulate
            else _step_fn(model, tx)
        )
        step = jax.jit(step_fn, donate_argnums=(0,))
        image = jax.ShapeDtypeStruct((s["batch"], s["image"], s["image"], 3), jnp.float32)
        labels = jax.ShapeDtypeStruct((s["batch"],), jnp.int32)
        rng = jax.random.PRNGKey(42)

        def init(key: jax.Array, x: jax.Array, t: jax.Array) -> dict[str, Any]:
            params = model.init({"params": key, "dropout": key}, x, t, train=False)["params"]
            return {"step": jnp.asarray(s["step"], jnp.int32), "params": params,
                    "opt_state": tx.init(params), "params_ema": params}  # fmt: skip

        if not concrete:
            state = jax.eval_shape(init, rng, image, labels)
            key = jax.ShapeDtypeStruct(rng.shape, rng.dtype)
            return step, ((key, state), {"image": image})
        k_init, k_data, k_run = jax.random.split(rng, 3)
        state = init(k_init, jnp.zeros(image.shape), jnp.zeros(labels.shape, jnp.int32))
        # The output convolution and the residual branches start at zero; move the params
        # off zero so that every gradient depends on the inputs.
        leaves, tree = jax.tree.flatten(state["params"])
        keys = jax.random.split(k_init, len(leaves))
        state["params"] = jax.tree.unflatten(
            tree,
            [p + 0.05 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys, strict=True)],
        )
        data = jax.random.uniform(k_data, image.shape, minval=-1.0, maxval=1.0)
        return step, ((k_run, state), {"image": data})

    return build


PROGRAM = register(
    RealProgram(
        name="score-sde-ddpm-unet",
        model="DDPM UNet on CIFAR-10 (score_sde, flax linen), Adam + EMA, batch 128",
        source=SOURCE,
        libraries=("flax.linen", "optax"),
        build=_builder(),
        fixes={
            "attention-scores": _builder(blockwise=True),
            "scan-residuals": _builder(remat=True),
            "grad-accumulation": _builder(accumulate=True),
        },
        compared={
            "grad-accumulation": (_builder(dropout=0.0), _builder(accumulate=True, dropout=0.0))
        },
        tolerance=1e-4,
        notes="one device, one step (score_sde pmaps and scans 5 steps); data abstract",
    )
)
