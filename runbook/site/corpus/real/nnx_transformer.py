"""Flax's NNX LM1B example: a decoder-only Transformer language model's training step.

The model is flax's ``examples/lm1b_nnx``: token embeddings plus fixed sinusoidal
positions, 6 pre-LayerNorm decoder blocks (``nnx.MultiHeadAttention`` with attention
dropout, a ReLU MLP, dropout after each), a final LayerNorm and a dense output layer over
the vocabulary, with padding and causal masks. Its ``train_step`` merges the graph
definition with the parameters in a ``TrainState``, computes the weighted softmax
cross-entropy (one-hot targets) with dropout keyed by ``fold_in(rng, step)``, and applies
AdamW (b2 0.98, weight decay 0.1, warm-up schedule); ``jax.jit`` donates the state.

Authors' scale: the example's default config on one device: batch 32 (its per-device
batch), 128 tokens, vocabulary 30,000, width 512, 8 heads, MLP 2048, 6 layers, dropout 0.1
on activations and attention, bfloat16 computation with float32 parameters.

Kept: the modules, masks, dtypes, loss, optimizer and the step's signature. Changed: data
loading, the mesh and partitioning annotations are left out (one device, inputs abstract);
the graph definition is a static field of the train state; the step returns the loss and
its denominator (the example's accuracy metric needs the whole logits, which the
vocab-logits fix never forms); our own code throughout. No prng-temporaries fix: a faster
generator draws other dropout masks, so its result cannot match the step's. The
attention-scores fix attends a chunk of queries at a time under `jax.checkpoint`, with the
step's own dropout mask (drawn whole, as booleans, from the same key): the runbook's
blockwise attention has no dropout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from flax.training import train_state

from runbook.cases.vocab_logits import loss_vocab_tiles

from ._program import Built, RealProgram, register

SOURCE = (
    "https://github.com/google/flax/blob/"
    "ec85cddf016404ea67aa68c95814d465ffcf05ea/examples/lm1b_nnx/models.py"
)

SIZES = {
    "authors": {
        "vocab": 30_000,
        "batch": 32,
        "length": 128,
        "emb": 512,
        "heads": 8,
        "mlp": 2048,
        "layers": 6,
    },
    "tiny": {"vocab": 64, "batch": 2, "length": 16, "emb": 16, "heads": 2, "mlp": 32, "layers": 2},
}
QUERY_CHUNKS = 4  # query chunks of the attention-scores fix


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int
    emb_dim: int
    num_heads: int
    mlp_dim: int
    num_layers: int
    max_len: int = 512
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    dtype: Any = jnp.bfloat16
    chunked_attention: bool = False


def sinusoid(max_len: int, features: int) -> np.ndarray:
    """Fixed sinusoidal positions ``(1, max_len, features)``."""
    half = features // 2
    position = np.arange(max_len)[:, None]
    freq = np.exp(np.arange(half) * -np.log(10_000.0) / (half - 1))
    table = np.zeros((max_len, features), np.float32)
    table[:, :half], table[:, half : 2 * half] = np.sin(position * freq), np.cos(position * freq)
    return table[None]


def chunked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    **_: Any,
) -> jax.Array:
    """The attention-scores fix: flax's attention (scaled scores, mask, softmax, dropout) a
    chunk of queries at a time, each checkpointed; the dropout mask is drawn as flax draws
    it, whole, from the same key, and sliced per chunk."""
    assert bias is None
    assert not broadcast_dropout
    dtype = query.dtype if dtype is None else dtype
    b, t, h, d = query.shape
    query = query / jnp.sqrt(d).astype(dtype)
    keep: jax.Array | None = None
    if not deterministic and dropout_rate > 0.0:
        assert dropout_rng is not None
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, (b, h, t, key.shape[1]))
    size = t // QUERY_CHUNKS

    def rows(i: jax.Array) -> jax.Array:
        q = jax.lax.dynamic_slice_in_dim(query, i * size, size, axis=1)
        w = jnp.einsum("bqhd,bkhd->bhqk", q, key, precision=precision)
        if mask is not None:
            m = jax.lax.dynamic_slice_in_dim(mask, i * size, size, axis=2)
            w = jnp.where(m, w, jnp.finfo(dtype).min)  # type: ignore[no-untyped-call]
        w = jax.nn.softmax(w).astype(dtype)
        if keep is not None:
            k = jax.lax.dynamic_slice_in_dim(keep, i * size, size, axis=2)
            w = w * (k.astype(dtype) / jnp.asarray(1.0 - dropout_rate, dtype=dtype))
        return jnp.einsum("bhqk,bkhd->bqhd", w, value, precision=precision)

    out = jax.lax.map(jax.checkpoint(rows), jnp.arange(QUERY_CHUNKS))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, value.shape[-1])


class MlpBlock(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        init, bias = nnx.initializers.xavier_uniform(), nnx.initializers.normal(1e-6)
        self.linear1 = nnx.Linear(c.emb_dim, c.mlp_dim, dtype=c.dtype, kernel_init=init,
                                  bias_init=bias, rngs=rngs)  # fmt: skip
        self.linear2 = nnx.Linear(c.mlp_dim, c.emb_dim, dtype=c.dtype, kernel_init=init,
                                  bias_init=bias, rngs=rngs)  # fmt: skip
        self.dropout = nnx.Dropout(c.dropout_rate)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = self.dropout(nnx.relu(self.linear1(x)), rngs=rngs)
        return self.dropout(self.linear2(x), rngs=rngs)


class DecoderBlock(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(c.emb_dim, dtype=c.dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(c.emb_dim, dtype=c.dtype, rngs=rngs)
        extra: dict[str, Any] = {"attention_fn": chunked_attention} if c.chunked_attention else {}
        self.attention = nnx.MultiHeadAttention(
            num_heads=c.num_heads, in_features=c.emb_dim, qkv_features=c.emb_dim,
            dtype=c.dtype, kernel_init=nnx.initializers.xavier_uniform(), use_bias=False,
            broadcast_dropout=False, dropout_rate=c.attention_dropout_rate, rngs=rngs,
            keep_rngs=False, **extra,
        )  # fmt: skip
        self.mlp = MlpBlock(c, rngs=rngs)
        self.dropout = nnx.Dropout(c.dropout_rate)

    def __call__(
        self, inputs: jax.Array, mask: jax.Array | None, *, rngs: nnx.Rngs | None = None
    ) -> jax.Array:
        x = self.attention(self.ln1(inputs), mask=mask, rngs=rngs)
        x = self.dropout(x, rngs=rngs) + inputs
        return x + self.mlp(self.ln2(x), rngs=rngs)


class TransformerLM(nnx.Module):
    def __init__(self, c: Config, *, rngs: nnx.Rngs):
        self.config = c
        self.embed = nnx.Embed(c.vocab_size, c.emb_dim,
                               embedding_init=nnx.initializers.normal(1.0), rngs=rngs)  # fmt: skip
        self.dropout = nnx.Dropout(c.dropout_rate)
        self.blocks = nnx.List([DecoderBlock(c, rngs=rngs) for _ in range(c.num_layers)])
        self.norm = nnx.LayerNorm(c.emb_dim, dtype=c.dtype, rngs=rngs)
        self.logitdense = nnx.Linear(c.emb_dim, c.vocab_size, dtype=c.dtype,
                                     kernel_init=nnx.initializers.xavier_uniform(),
                                     bias_init=nnx.initializers.normal(1e-6), rngs=rngs)  # fmt: skip

    def hidden(self, inputs: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        """The final normalised hidden states ``(batch, length, emb)``."""
        c = self.config
        mask = nnx.combine_masks(
            nnx.make_attention_mask(inputs > 0, inputs > 0, dtype=c.dtype),
            nnx.make_causal_mask(inputs, dtype=c.dtype),
        )
        shifted = jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]  # shift right
        y = self.embed(shifted) + sinusoid(c.max_len, c.emb_dim)[:, : inputs.shape[1]]
        y = self.dropout(y, rngs=rngs).astype(c.dtype)
        for block in self.blocks:
            y = block(y, mask, rngs=rngs)
        out: jax.Array = self.norm(y)
        return out

    def __call__(self, inputs: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        return self.logitdense(self.hidden(inputs, rngs=rngs)).astype(self.config.dtype)


class TrainState(train_state.TrainState):  # type: ignore[no-untyped-call]
    graphdef: Any = struct.field(pytree_node=False)  # type: ignore[no-untyped-call]


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """The example's weighted softmax cross-entropy against one-hot targets (no smoothing)."""
    onehot = jax.nn.one_hot(targets, logits.shape[-1])
    return jnp.sum(-jnp.sum(onehot * nnx.log_softmax(logits), axis=-1) * weights)


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    dropout_rng: jax.Array,
    learning_rate_fn: Callable[[Any], Any],
    vocab_tiles: bool = False,
) -> tuple[TrainState, dict[str, jax.Array]]:
    inputs = batch["inputs"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params: nnx.State[Any, Any]) -> jax.Array:
        module = nnx.merge(state.graphdef, params)
        module.set_attributes(deterministic=False, decode=False, raise_if_not_found=False)
        rngs = nnx.Rngs(dropout=dropout_rng)
        if vocab_tiles:  # the vocab-logits fix: the loss a slice of the vocabulary at a time
            h = module.hidden(inputs, rngs=rngs)
            dense, dtype = module.logitdense, module.config.dtype
            loss = loss_vocab_tiles(
                h.reshape(-1, h.shape[-1]), dense.kernel[...].astype(dtype),
                inputs.reshape(-1), weights.reshape(-1), dense.bias[...].astype(dtype),
            )  # fmt: skip
        else:
            loss = cross_entropy(module(inputs, rngs=rngs), inputs, weights)
        return loss / weights.sum()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    new_state = state.apply_gradients(grads=grads)  # type: ignore[no-untyped-call]
    metrics = {
        "loss": loss,
        "denominator": weights.sum(),
        "learning_rate": learning_rate_fn(state.step),
    }
    return new_state, metrics


def learning_rate_fn(step: Any) -> Any:
    """The example's schedule: linear warm-up over 1000 steps to 0.0016, then rsqrt decay."""
    warmup = optax.linear_schedule(0.0, 0.0016, 1000)
    decay = lambda s: 0.0016 * jnp.sqrt(1000.0) / jnp.sqrt(s + 1000.0)
    return optax.join_schedules([warmup, decay], [1000])(step)


def _build(scale: str, concrete: bool, chunked: bool = False, tiles: bool = False) -> Built:
    s = SIZES[scale]
    config = Config(s["vocab"], s["emb"], s["heads"], s["mlp"], s["layers"],
                    chunked_attention=chunked)  # fmt: skip
    tx = optax.adamw(learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)

    def init(key: jax.Array) -> TrainState:
        graphdef, params = nnx.split(TransformerLM(config, rngs=nnx.Rngs(params=key)))
        created: TrainState = TrainState.create(  # type: ignore[no-untyped-call]
            apply_fn=None, params=params, tx=tx, graphdef=graphdef
        )
        return created

    key = jax.random.PRNGKey(0)
    init_key, dropout_rng = jax.random.split(key)
    shape = (s["batch"], s["length"])
    state: Any
    inputs: Any
    dropout_arg: Any = dropout_rng
    if concrete:
        state = init(init_key)
        tokens = jax.random.randint(jax.random.key(0), shape, 1, s["vocab"])
        inputs = jnp.where(jnp.arange(s["length"]) < s["length"] - 3, tokens, 0)  # padding
    else:
        state = jax.eval_shape(init, init_key)
        inputs = jax.ShapeDtypeStruct(shape, jnp.int32)
        dropout_arg = jax.ShapeDtypeStruct(dropout_rng.shape, dropout_rng.dtype)
    step = functools.partial(train_step, learning_rate_fn=learning_rate_fn, vocab_tiles=tiles)
    return jax.jit(step, donate_argnums=0), (state, {"inputs": inputs}, dropout_arg)


def build(scale: str, concrete: bool) -> Built:
    return _build(scale, concrete)


register(
    RealProgram(
        name="nnx-lm1b-transformer",
        model="LM1B decoder-only Transformer, flax NNX, dropout, bfloat16, AdamW",
        source=SOURCE,
        libraries=("flax.nnx", "optax"),
        build=build,
        fixes={
            "attention-scores": functools.partial(_build, chunked=True),
            "vocab-logits": functools.partial(_build, tiles=True),
        },
        tolerance=1e-3,  # the example's log-softmax is in bfloat16, the vocab tiles' float32
        notes="Data, mesh and partitioning left out; the accuracy metric is not computed.",
    )
)
