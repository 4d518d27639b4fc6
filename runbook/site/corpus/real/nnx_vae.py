"""The Stable Diffusion VAE in flax NNX, fine-tuned on reconstruction: one gradient step.

The model is bonsai's NNX port of the Stable Diffusion autoencoder (``AutoencoderKL``, the
``stabilityai/sd-vae-ft-mse`` weights): an encoder of four down blocks (128, 256, 512, 512
channels, two ResNet blocks each, GroupNorm of 32 groups), a mid block of ResNet,
single-head spatial self-attention over the ``H/8 x W/8`` positions (``scale = 1/sqrt(C)``,
C = 512) and ResNet; a 1x1 quantisation convolution whose mean half is decoded (no
sampling) by the mirror-image decoder (three ResNet blocks per up block, nearest-neighbour
upsampling).

Authors' scale: bonsai's ``run_model``: batch 1 of ``256 x 256 x 3`` float32 images, so
the mid blocks attend over 32 x 32 = 1024 positions of 512 channels.

Kept: the modules, channel counts, GroupNorm epsilon, attention layout and float32.
Changed: bonsai runs the forward pass only; here the step is what fine-tuning it costs: the
mean squared reconstruction error, its gradient by `nnx.value_and_grad` and an
``nnx.Optimizer`` (Adam 1e-4) update, as a `jax.jit` of NNX's functional API (graph
definition static, state in, state out). Weights are not loaded (abstract at the authors'
scale); our own code throughout. The attention-scores fix is the runbook's
``attention_blockwise`` with ``causal=False`` (every position attends to every other) and
its default scale, ``1/sqrt(C)``, the model's own: blocks of 256 positions, and a gradient of
its own that recomputes each score block, so no ``1024 x 1024`` score matrix is kept.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from runbook.cases.attention_scores import attention_blockwise

from ._program import Built, RealProgram, register

SOURCE = (
    "https://github.com/jax-ml/bonsai/blob/"
    "1dc82f3eb3412b5c31c1c5c738b9829c09cb320c/bonsai/models/vae/modeling.py"
)

# channels per level, GroupNorm groups, image side, batch
SIZES: dict[str, dict[str, Any]] = {
    "authors": {"channels": (128, 256, 512, 512), "groups": 32, "image": 256, "batch": 1},
    "tiny": {"channels": (8, 16), "groups": 4, "image": 16, "batch": 1},
}
BLOCK = 256  # positions per block (queries and keys) in the attention-scores fix


def attend_full(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Softmax attention of ``(b, heads, tokens, d)`` inputs, the whole score matrix at once."""
    scores = jnp.einsum("bhld,bhsd->bhls", q, k) * (1.0 / jnp.sqrt(q.shape[-1]))
    return jnp.einsum("bhls,bhsd->bhld", jax.nn.softmax(scores, axis=-1), v)


def attend_blockwise(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The attention-scores fix: the same attention by the runbook's `attention_blockwise`,
    not causal, at its default scale ``1/sqrt(d)`` (`attend_full`'s), heads and tokens swapped
    to its ``(b, tokens, heads, d)`` layout and back."""
    t = q.shape[2]
    # At least four blocks (1024 positions: 256; the tiny scale's 64: 16), so that even the
    # tiny same-result test goes through the online softmax across blocks; powers of two,
    # and the blocks must divide the positions.
    size = min(BLOCK, t // 4)
    assert t % size == 0, (t, size)
    out = attention_blockwise(*(x.swapaxes(1, 2) for x in (q, k, v)), block=size, causal=False)
    return out.swapaxes(1, 2)


class ResnetBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, groups: int, rngs: nnx.Rngs):
        self.norm1 = nnx.GroupNorm(cin, num_groups=groups, epsilon=1e-6, rngs=rngs)
        self.conv1 = nnx.Conv(cin, cout, (3, 3), padding="SAME", rngs=rngs)
        self.norm2 = nnx.GroupNorm(cout, num_groups=groups, epsilon=1e-6, rngs=rngs)
        self.conv2 = nnx.Conv(cout, cout, (3, 3), padding="SAME", rngs=rngs)
        self.shortcut = nnx.data(
            nnx.Conv(cin, cout, (1, 1), padding="VALID", rngs=rngs) if cin != cout else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1(nnx.silu(self.norm1(x)))
        h = self.conv2(nnx.silu(self.norm2(h)))
        return (x if self.shortcut is None else self.shortcut(x)) + h


class Attention(nnx.Module):
    """Single-head self-attention over the H x W positions, with a residual."""

    def __init__(self, channels: int, groups: int, blockwise: bool, rngs: nnx.Rngs):
        self.norm = nnx.GroupNorm(channels, num_groups=groups, epsilon=1e-6, rngs=rngs)
        self.to_q = nnx.Linear(channels, channels, rngs=rngs)
        self.to_k = nnx.Linear(channels, channels, rngs=rngs)
        self.to_v = nnx.Linear(channels, channels, rngs=rngs)
        self.to_out = nnx.Linear(channels, channels, rngs=rngs)
        self.blockwise = blockwise

    def __call__(self, x: jax.Array) -> jax.Array:
        b, hh, ww, c = x.shape
        h = self.norm(x.reshape(b, hh * ww, c))
        q, k, v = (f(h)[:, None] for f in (self.to_q, self.to_k, self.to_v))  # one head
        out = (attend_blockwise if self.blockwise else attend_full)(q, k, v)[:, 0]
        return self.to_out(out).reshape(b, hh, ww, c) + x


class MidBlock(nnx.Module):
    def __init__(self, channels: int, groups: int, blockwise: bool, rngs: nnx.Rngs):
        self.res1 = ResnetBlock(channels, channels, groups, rngs)
        self.attn = Attention(channels, groups, blockwise, rngs)
        self.res2 = ResnetBlock(channels, channels, groups, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.res2(self.attn(self.res1(x)))


class Encoder(nnx.Module):
    def __init__(self, s: dict[str, Any], blockwise: bool, rngs: nnx.Rngs):
        chans, g = s["channels"], s["groups"]
        self.conv_in = nnx.Conv(3, chans[0], (3, 3), padding="SAME", rngs=rngs)
        blocks, cin = [], chans[0]
        for i, cout in enumerate(chans):
            res = [ResnetBlock(cin if j == 0 else cout, cout, g, rngs) for j in range(2)]
            last = i == len(chans) - 1
            down = (
                None if last else nnx.Conv(cout, cout, (3, 3), strides=2, padding="SAME", rngs=rngs)
            )
            blocks.append(nnx.Dict(resnets=nnx.List(res), down=nnx.data(down)))
            cin = cout
        self.blocks = nnx.List(blocks)
        self.mid = MidBlock(cin, g, blockwise, rngs)
        self.norm_out = nnx.GroupNorm(cin, num_groups=g, epsilon=1e-6, rngs=rngs)
        self.conv_out = nnx.Conv(cin, 8, (3, 3), padding="SAME", rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.blocks:
            for res in block["resnets"]:  # type: ignore[union-attr]
                x = res(x)
            if block["down"] is not None:
                x = block["down"](x)
        return self.conv_out(nnx.silu(self.norm_out(self.mid(x))))


class Decoder(nnx.Module):
    def __init__(self, s: dict[str, Any], blockwise: bool, rngs: nnx.Rngs):
        chans, g = list(reversed(s["channels"])), s["groups"]
        self.conv_in = nnx.Conv(4, chans[0], (3, 3), padding="SAME", rngs=rngs)
        self.mid = MidBlock(chans[0], g, blockwise, rngs)
        blocks, cin = [], chans[0]
        for i, cout in enumerate(chans):
            res = [ResnetBlock(cin if j == 0 else cout, cout, g, rngs) for j in range(3)]
            last = i == len(chans) - 1
            up = None if last else nnx.Conv(cout, cout, (3, 3), padding="SAME", rngs=rngs)
            blocks.append(nnx.Dict(resnets=nnx.List(res), up=nnx.data(up)))
            cin = cout
        self.blocks = nnx.List(blocks)
        self.norm_out = nnx.GroupNorm(cin, num_groups=g, epsilon=1e-6, rngs=rngs)
        self.conv_out = nnx.Conv(cin, 3, (3, 3), padding="SAME", rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.mid(self.conv_in(x))
        for block in self.blocks:
            for res in block["resnets"]:  # type: ignore[union-attr]
                x = res(x)
            if block["up"] is not None:
                b, h, w, c = x.shape
                x = block["up"](jax.image.resize(x, (b, 2 * h, 2 * w, c), "nearest"))
        return self.conv_out(nnx.silu(self.norm_out(x)))


class VAE(nnx.Module):
    def __init__(self, s: dict[str, Any], blockwise: bool, rngs: nnx.Rngs):
        self.encoder = Encoder(s, blockwise, rngs)
        self.quant_conv = nnx.Conv(8, 8, (1, 1), padding="VALID", rngs=rngs)
        self.post_quant_conv = nnx.Conv(4, 4, (1, 1), padding="VALID", rngs=rngs)
        self.decoder = Decoder(s, blockwise, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mean, _ = jnp.split(self.quant_conv(self.encoder(x)), 2, axis=-1)
        return self.decoder(self.post_quant_conv(mean))


def train_step(
    graphdef: nnx.GraphDef[Any], state: nnx.State[Any, Any], images: jax.Array
) -> tuple[nnx.State[Any, Any], jax.Array]:
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model: VAE) -> jax.Array:
        return jnp.mean((model(images) - images) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss


def _build(scale: str, concrete: bool, blockwise: bool = False, donate: bool = False) -> Built:
    s = SIZES[scale]

    def init() -> tuple[VAE, nnx.Optimizer[VAE]]:
        model = VAE(s, blockwise, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-4), wrt=nnx.Param)

    shape = (s["batch"], s["image"], s["image"], 3)
    images: Any
    if concrete:
        graphdef, state = nnx.split(init())
        images = jax.random.uniform(jax.random.key(0), shape, minval=-1.0, maxval=1.0)
    else:
        graphdef, state = nnx.split(nnx.eval_shape(init))
        images = jax.ShapeDtypeStruct(shape, jnp.float32)
    step = jax.jit(train_step, static_argnums=0, donate_argnums=(1,) if donate else ())
    return step, (graphdef, state, images)


def build(scale: str, concrete: bool) -> Built:
    return _build(scale, concrete)


register(
    RealProgram(
        name="nnx-vae",
        model="Stable Diffusion VAE (AutoencoderKL), flax NNX, reconstruction fine-tuning step",
        source=SOURCE,
        libraries=("flax.nnx", "optax"),
        build=build,
        fixes={
            "attention-scores": functools.partial(_build, blockwise=True),
            "donation": functools.partial(_build, donate=True),
        },
        tolerance=1e-3,  # a first Adam step moves each weight by about its rate
        notes="Bonsai runs the forward pass only; the step adds an MSE loss and Adam.",
    )
)
