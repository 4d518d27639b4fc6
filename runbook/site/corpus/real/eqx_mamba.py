"""Mamba in equinox: a character language model whose blocks run a selective state-space scan.

The model is the Mamba example of equinox's ``mamba`` branch (Gu & Dao, arXiv 2312.00752):
an embedding shared with the output head (``eqx.nn.Shared``), residual blocks of RMSNorm,
an input projection, a depthwise causal ``Conv1d``, and a selective state-space model whose
recurrence is a `jax.lax.scan` over the sequence, then a final RMSNorm and the head. The
per-example model is vmapped over the batch, and an ``eqx.filter_jit`` step takes the
gradient of the cross-entropy and applies AdamW.

Authors' scale: the example's training cell on Tiny Shakespeare: 65 characters, batch 64,
blocks of 8 characters, width 64, 3 layers, expansion 2 (inner width 128), convolution
width 4, delta rank ``ceil(64 / 16) = 4``, float32, ``optax.adamw(3e-4)``. As in the
example, each block's state has the inner width as its size (its ``MambaBlock`` passes
``d_state=d_inner``), so every scan step carries a 128 x 128 state per example.

Fixes: scan-residuals makes each step's decay and drive inside the scan's body and
checkpoints the body (`selective_scan`'s `remat`), so that the backward pass keeps per step
only the step's inputs and carry. Until 2026-12-05 the fix checkpointed the scan as
written, its decay and drive arrays made before it: jax 0.10.2's XLA:CPU then kept the
forward pass's drive arrays and recomputed every layer's decay at once, and the fix freed
little there. donation donates the model and the
optimizer state (``eqx.filter_jit(..., donate="all")``). The head is 65 wide: no
vocab-logits fix.

Kept: the modules, their shapes and initialisation, the shared head, the scan, the step's
signature (model, optimizer state, inputs, targets, optimizer, key). Changed: the data
loader is left out (inputs are abstract); our own code throughout.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from ._program import Built, RealProgram, register

SOURCE = (
    "https://github.com/patrick-kidger/equinox/blob/"
    "3504d77d30bfe07530befa0c4e432acacf1a7a53/examples/mamba.ipynb"
)

# vocab, batch, length, width, layers, expansion, state size (for the delta rank), conv width
SIZES = {
    "authors": {
        "vocab": 65,
        "batch": 64,
        "length": 8,
        "width": 64,
        "layers": 3,
        "expand": 2,
        "state": 16,
        "conv": 4,
    },
    "tiny": {
        "vocab": 17,
        "batch": 2,
        "length": 8,
        "width": 16,
        "layers": 2,
        "expand": 2,
        "state": 4,
        "conv": 4,
    },
}


def selective_scan(
    u: jax.Array,
    delta: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    d: jax.Array,
    remat: bool = False,
) -> jax.Array:
    """The recurrence ``x_t = exp(delta_t A) x_{t-1} + delta_t B_t u_t``, ``y_t = x_t C_t``
    over one sequence ``(length, inner)``.

    As written, the decay ``exp(delta_t A)`` and the drive ``delta_t B_t u_t`` of every step
    are made before the scan, each ``(length, inner, state)``, and kept for the backward
    pass with the states the scan stacks. With `remat` (the fix), each step makes its own
    inside a checkpointed body: the backward pass keeps the step's inputs and its carry, and
    recomputes the rest one step at a time."""
    length, inner = u.shape
    if remat:

        def step(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
            dt, bt, ut, ct = xs
            state = jnp.exp(dt[:, None] * a) * state + (dt * ut)[:, None] * bt[None, :]
            return state, state @ ct

        _, ys = jax.lax.scan(jax.checkpoint(step), jnp.zeros((inner, a.shape[1])), (delta, b, u, c))
    else:
        decay = jnp.exp(jnp.einsum("ld,dn->ldn", delta, a))
        drive = jnp.einsum("ld,ln,ld->ldn", delta, b, u)

        def body(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
            state = decay[t] * state + drive[t]
            return state, state @ c[t]

        _, ys = jax.lax.scan(body, jnp.zeros((inner, a.shape[1])), jnp.arange(length))
    out: jax.Array = ys + u * d
    return out


class SSM(eqx.Module):
    input_proj: eqx.nn.Linear
    delta_proj: eqx.nn.Linear
    a_log: jax.Array
    d: jax.Array
    rank: int = eqx.field(static=True)
    state: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    def __init__(self, inner: int, rank: int, state: int, remat: bool, *, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.rank, self.state, self.remat = rank, state, remat
        self.input_proj = eqx.nn.Linear(inner, rank + 2 * state, use_bias=False, key=k1)
        self.delta_proj = eqx.nn.Linear(rank, inner, use_bias=False, key=k2)
        grid = jnp.repeat(jnp.arange(1, state + 1), inner).reshape(state, inner).T
        self.a_log = jnp.log(grid.astype(jnp.float32))
        self.d = jnp.ones(inner)

    def __call__(self, x: jax.Array) -> jax.Array:
        projected = jax.vmap(self.input_proj)(x)
        delta, b, c = jnp.split(projected, [self.rank, self.rank + self.state], axis=-1)
        delta = jax.nn.softplus(jax.vmap(self.delta_proj)(delta))
        return selective_scan(x, delta, -jnp.exp(self.a_log), b, c, self.d, self.remat)


class MambaBlock(eqx.Module):
    in_proj: eqx.nn.Linear
    conv: eqx.nn.Conv1d
    ssm: SSM
    out_proj: eqx.nn.Linear

    def __init__(
        self, width: int, inner: int, rank: int, conv: int, remat: bool, *, key: jax.Array
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.in_proj = eqx.nn.Linear(width, 2 * inner, key=k1)
        self.conv = eqx.nn.Conv1d(
            inner, inner, kernel_size=conv, groups=inner, padding=conv - 1, key=k2
        )
        # The example's block gives its state-space model the inner width as state size.
        self.ssm = SSM(inner, rank, inner, remat, key=k3)
        self.out_proj = eqx.nn.Linear(inner, width, key=k4)

    def __call__(self, x: jax.Array) -> jax.Array:
        length = x.shape[0]
        h, gate = jnp.split(jax.vmap(self.in_proj)(x), 2, axis=-1)
        h = jax.nn.silu(self.conv(h.T)[:, :length].T)
        y = self.ssm(h) * jax.nn.silu(gate)
        return jax.vmap(self.out_proj)(y)


class Residual(eqx.Module):
    block: MambaBlock
    norm: eqx.nn.RMSNorm

    def __init__(
        self, width: int, inner: int, rank: int, conv: int, remat: bool, *, key: jax.Array
    ):
        self.block = MambaBlock(width, inner, rank, conv, remat, key=key)
        self.norm = eqx.nn.RMSNorm(width)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        return self.block(jax.vmap(self.norm)(x)) + x


class Mamba(eqx.Module):
    layers: eqx.nn.Sequential
    norm: eqx.nn.RMSNorm
    embed_head: eqx.nn.Shared

    def __init__(self, s: dict[str, int], remat: bool = False, *, key: jax.Array):
        keys = jax.random.split(key, s["layers"] + 2)
        inner, rank = s["expand"] * s["width"], math.ceil(s["width"] / s["state"])
        self.layers = eqx.nn.Sequential(
            [
                Residual(s["width"], inner, rank, s["conv"], remat, key=keys[i])
                for i in range(s["layers"])
            ]
        )
        self.norm = eqx.nn.RMSNorm(s["width"])
        embed = eqx.nn.Embedding(s["vocab"], s["width"], key=keys[-2])
        head = eqx.nn.Linear(s["width"], s["vocab"], use_bias=False, key=keys[-1])
        self.embed_head = eqx.nn.Shared(
            (embed, head), where=lambda pair: pair[1].weight, get=lambda pair: pair[0].weight
        )

    def __call__(self, tokens: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        embed, head = self.embed_head()
        h = self.layers(jax.vmap(embed)(tokens))
        logits: jax.Array = jax.vmap(head)(jax.vmap(self.norm)(h))
        return logits


def loss_fn(model: Mamba, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
    logits = eqx.filter_vmap(functools.partial(model, key=key))(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def train_step(
    model: Mamba,
    opt_state: Any,
    x: jax.Array,
    y: jax.Array,
    optimizer: optax.GradientTransformation,
    key: jax.Array,
) -> tuple[Mamba, Any, jax.Array]:
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, key)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state, loss


def _build(scale: str, concrete: bool, remat: bool = False, donate: bool = False) -> Built:
    s = SIZES[scale]
    optimizer = optax.adamw(learning_rate=3e-4)

    def init(key: jax.Array) -> tuple[Mamba, Any]:
        model = Mamba(s, remat, key=key)
        return model, optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    key: Any = jax.random.PRNGKey(222)
    x: Any
    y: Any
    shape = (s["batch"], s["length"])
    if concrete:
        model, opt_state = init(key)
        data = jax.random.randint(jax.random.key(0), (2, *shape), 0, s["vocab"])
        x, y = data[0], data[1]
    else:
        model, opt_state = eqx.filter_eval_shape(init, key)
        x = y = jax.ShapeDtypeStruct(shape, jnp.int32)
        key = jax.ShapeDtypeStruct(key.shape, key.dtype)
    step = eqx.filter_jit(train_step, donate="all" if donate else "none")
    return step, (model, opt_state, x, y, optimizer, key)


def build(scale: str, concrete: bool) -> Built:
    return _build(scale, concrete)


register(
    RealProgram(
        name="eqx-mamba",
        model="Mamba character LM, equinox, selective scan under lax.scan, AdamW",
        source=SOURCE,
        libraries=("equinox", "optax"),
        build=build,
        fixes={
            "scan-residuals": functools.partial(_build, remat=True),
            "donation": functools.partial(_build, donate=True),
        },
        tolerance=1e-4,
        notes="The data loader is left out; einops-free, our own code.",
    )
)
