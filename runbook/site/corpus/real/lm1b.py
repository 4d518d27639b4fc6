"""Flax's lm1b example: a decoder-only Transformer language model on One Billion Words.

The model (flax.linen) is the decoder of flax's WMT example used alone: token embedding,
fixed sinusoidal position embeddings, dropout, and pre-LayerNorm blocks of causal
`nn.SelfAttention` (attention dropout, no bias) and a ReLU MLP, each followed by dropout;
a final LayerNorm and a separate ``logitdense`` projection to the vocabulary. Inputs come
packed: several sentences share a row, with their positions and segment ids, so the
attention mask combines padding, causality and segments. The loss is cross-entropy against
one-hot targets (``common_utils.onehot`` times ``log_softmax``), weighted to skip padding;
the step returns the summed metrics (loss, accuracy, denominator, learning rate) computed
from the logits it kept. AdamW (b1 0.9, b2 0.98, eps 1e-9, weight decay 0.1) on a linear
warmup then reciprocal-square-root schedule; dropout keys are folded with the step.

Authors' scale (configs/default.py): vocabulary 30,000, 6 layers, width 512, 8 heads of 64,
MLP 2048, dropout and attention dropout 0.1, bfloat16 compute, 32 x 128 tokens per device,
position table of 512. The example pmaps the step over the local devices (each device gets
its 32 rows) and donates the state; we take one device's share under `jax.jit` with the
state donated, and drop the cross-device `pmean`/`psum`. Kept: the modules, initialisers,
dtypes, loss, metrics, optimizer and donation. Changed: data loading, evaluation and
sampling are left out; the tokens are an abstract input; the logical-partitioning
annotations of newer versions are left out (one device).

The fixes:

- vocab-logits: the model returns the final hidden state; the loss takes the vocabulary a
  slice at a time (`runbook.cases.vocab_logits.loss_vocab_tiles`, with the projection's
  bias and the padding weights), and the accuracy metric takes each token's argmax over
  chunks of tokens (no gradient), so no ``4,096 x 30,000`` logits live at once.
- scan-residuals: `nn.remat` of each block (dropout masks recomputed from the same keys).

Not given: attention-scores (the blockwise kernel has no attention dropout, and the
scores are only 128 x 128 per head); prng-temporaries (another generator or blocked draws
change the dropout masks, so the result would differ); donation (the example donates).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import common_utils
from flax.training.train_state import TrainState
from jax import lax

from runbook.cases.vocab_logits import loss_vocab_tiles

from ._program import Builder, Built, RealProgram, register

SOURCE = (
    "https://github.com/google/flax/blob/"
    "0740ef63c4eae05de58d80f85a05fc23bb8b3261/examples/lm1b/train.py"
)
SCALES: dict[str, dict[str, int]] = {
    "authors": {
        "vocab": 30000, "layers": 6, "emb": 512, "qkv": 512, "mlp": 2048, "heads": 8,
        "batch": 32, "length": 128, "max_len": 512, "chunks": 16,
    },
    "tiny": {
        "vocab": 96, "layers": 2, "emb": 32, "qkv": 32, "mlp": 64, "heads": 4,
        "batch": 4, "length": 16, "max_len": 32, "chunks": 4,
    },
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The example's hyper-parameters, and the switches our fixes turn."""

    vocab_size: int
    emb_dim: int
    num_heads: int
    num_layers: int
    qkv_dim: int
    mlp_dim: int
    max_len: int
    dtype: Any = jnp.bfloat16
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.1
    deterministic: bool = False
    decode: bool = False
    # ours, for the fixes
    remat: bool = False
    return_hidden: bool = False


KERNEL_INIT = nn.initializers.xavier_uniform()
BIAS_INIT = nn.initializers.normal(stddev=1e-6)


def shift_right(x: jax.Array) -> jax.Array:
    """Shift the tokens one place right along the length, a zero in front."""
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


def sinusoid(max_len: int, features: int) -> np.ndarray:
    """The fixed position table ``(1, max_len, features)``: sines, then cosines."""
    half = features // 2
    rates = np.exp(np.arange(half) * -np.log(10000.0) / (half - 1))
    angles = np.arange(max_len)[:, None] * rates[None, :]
    table = np.zeros((max_len, features), np.float32)
    table[:, :half] = np.sin(angles)
    table[:, half : 2 * half] = np.cos(angles)
    return table[None]


class AddPositionEmbs(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        table = jnp.asarray(sinusoid(self.cfg.max_len, x.shape[-1]))
        pe = table[:, : x.shape[1]]
        if self.cfg.decode:
            started = self.has_variable("cache", "cache_index")
            index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.uint32))
            if started:
                i = index.value
                index.value = i + 1
                pe = lax.dynamic_slice(table, jnp.array((0, i, 0)), (1, 1, x.shape[-1]))
        if positions is None:
            return x + pe
        return x + jnp.take(pe[0], positions, axis=0)


class MlpBlock(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> Any:
        cfg = self.cfg
        dense = functools.partial(
            nn.Dense, dtype=cfg.dtype, kernel_init=KERNEL_INIT, bias_init=BIAS_INIT
        )
        h = nn.relu(dense(cfg.mlp_dim)(x))
        h = nn.Dropout(cfg.dropout_rate)(h, deterministic=cfg.deterministic)
        out = dense(x.shape[-1])(h)
        return nn.Dropout(cfg.dropout_rate)(out, deterministic=cfg.deterministic)


class DecoderBlock(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(self, inputs: jax.Array, mask: jax.Array | None) -> Any:
        cfg = self.cfg
        x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
        x = nn.SelfAttention(
            num_heads=cfg.num_heads, dtype=cfg.dtype, qkv_features=cfg.qkv_dim,
            kernel_init=KERNEL_INIT, bias_init=BIAS_INIT, use_bias=False,
            broadcast_dropout=False, dropout_rate=cfg.attention_dropout_rate,
            deterministic=cfg.deterministic, decode=cfg.decode,
        )(x, mask)  # fmt: skip
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=cfg.deterministic) + inputs
        return x + MlpBlock(cfg)(nn.LayerNorm(dtype=cfg.dtype)(x))


class Decoder(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        positions: jax.Array | None,
        segments: jax.Array | None,
        mask: jax.Array | None,
    ) -> Any:
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))
        y = inputs.astype(jnp.int32)
        if not cfg.decode:
            shifted = shift_right(y)
            if segments is not None:  # a packed row: each sentence starts from 0
                shifted = shifted * (segments == shift_right(segments))
            y = shifted
        y = AddPositionEmbs(cfg, name="posembed_output")(embed(y), positions)
        y = nn.Dropout(cfg.dropout_rate)(y, deterministic=cfg.deterministic)
        y = y.astype(cfg.dtype)
        block = nn.remat(DecoderBlock) if cfg.remat else DecoderBlock
        for i in range(cfg.num_layers):
            y = block(cfg, name=f"encoderdecoderblock_{i}")(y, mask)
        y = nn.LayerNorm(dtype=cfg.dtype, name="encoderdecoder_norm")(y)
        if cfg.return_hidden:
            return y
        return nn.Dense(
            cfg.vocab_size, dtype=cfg.dtype, kernel_init=KERNEL_INIT, bias_init=BIAS_INIT,
            name="logitdense",
        )(y)  # fmt: skip


class TransformerLM(nn.Module):
    cfg: TransformerConfig

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        positions: jax.Array | None = None,
        segments: jax.Array | None = None,
    ) -> Any:
        cfg = self.cfg
        mask = None
        if not cfg.decode:
            mask = nn.combine_masks(
                nn.make_attention_mask(inputs > 0, inputs > 0, dtype=cfg.dtype),
                nn.make_causal_mask(inputs, dtype=cfg.dtype),
            )
        if segments is not None:
            mask = nn.combine_masks(
                mask, nn.make_attention_mask(segments, segments, jnp.equal, dtype=cfg.dtype)
            )
        out = Decoder(cfg, name="decoder")(inputs, positions, segments, mask)
        return out.astype(cfg.dtype)


def _schedule(peak: float = 0.05, warmup: int = 1000) -> optax.Schedule:
    """Linear warmup from 0, then ``peak * sqrt(warmup / step)``."""
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak, warmup),
            lambda count: peak * (count + warmup) ** -0.5 * warmup**0.5,
        ],
        boundaries=[warmup],
    )


def _optimizer() -> optax.GradientTransformation:
    return optax.adamw(_schedule(), b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)


def _cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> Any:
    """The example's weighted cross-entropy, summed (no label smoothing)."""
    onehot = common_utils.onehot(  # type: ignore[no-untyped-call]
        targets, logits.shape[-1], on_value=1.0, off_value=0.0
    )
    loss = -jnp.sum(onehot * nn.log_softmax(logits), axis=-1)
    return jnp.sum(loss * weights)


def _chunked_argmax(h: jax.Array, dense: Any, chunks: int, dtype: Any) -> Any:
    """Each token's most likely id, the logits of `chunks` groups of tokens at a time."""
    kernel, bias = dense["kernel"].astype(dtype), dense["bias"].astype(dtype)
    groups = h.reshape(chunks, -1, h.shape[-1])
    ids = lax.map(lambda g: jnp.argmax(jnp.dot(g, kernel) + bias, axis=-1), groups)
    return lax.stop_gradient(ids.reshape(-1))


def _train_step(
    state: TrainState, batch: dict[str, jax.Array], dropout_rng: jax.Array,
    cfg: TransformerConfig, chunks: int,
) -> Any:  # fmt: skip
    inputs = batch["inputs"]
    positions, segments = batch["inputs_position"], batch["inputs_segmentation"]
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        out: Any = TransformerLM(cfg).apply(
            {"params": params}, inputs, positions, segments, rngs={"dropout": dropout_rng}
        )
        if cfg.return_hidden:
            dense = params["decoder"]["logitdense"]
            h = out.reshape(-1, cfg.emb_dim)
            loss = loss_vocab_tiles(
                h, dense["kernel"].astype(cfg.dtype), inputs.reshape(-1), weights.reshape(-1),
                dense["bias"].astype(cfg.dtype),
            )  # fmt: skip
            predicted = _chunked_argmax(h, dense, chunks, cfg.dtype).reshape(inputs.shape)
        else:
            loss = _cross_entropy(out, inputs, weights)
            predicted = jnp.argmax(out, axis=-1)
        return loss / weights.sum(), (loss, predicted)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (loss_sum, predicted)), grads = grad_fn(state.params)
    new_state = state.apply_gradients(grads=grads)  # type: ignore[no-untyped-call]
    metrics = {
        "loss": loss_sum,
        "accuracy": jnp.sum(jnp.equal(predicted, inputs) * weights),
        "denominator": weights.sum(),
        "learning_rate": _schedule()(state.step),
    }
    return new_state, metrics


def _batch(s: dict[str, int], concrete: bool) -> dict[str, Any]:
    shape = (s["batch"], s["length"])
    if not concrete:
        return {
            k: jax.ShapeDtypeStruct(shape, jnp.int32)
            for k in ("inputs", "inputs_position", "inputs_segmentation")
        }
    # Two packed sentences per row, then padding.
    ids = jax.random.randint(jax.random.key(1), shape, 1, s["vocab"], jnp.int32)
    cut, end = s["length"] // 2, s["length"] - 3
    col = jnp.arange(s["length"])[None, :]
    segments = jnp.broadcast_to(jnp.where(col < cut, 1, 2) * (col < end), shape)
    positions = jnp.broadcast_to(jnp.where(col < cut, col, col - cut) * (col < end), shape)
    return {
        "inputs": ids * (segments > 0),
        "inputs_position": positions.astype(jnp.int32),
        "inputs_segmentation": segments.astype(jnp.int32),
    }


def _builder(**switches: bool) -> Builder:
    """The step with the fix's switches on (none: the program as the example has it)."""

    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        cfg = TransformerConfig(
            vocab_size=s["vocab"], emb_dim=s["emb"], num_heads=s["heads"],
            num_layers=s["layers"], qkv_dim=s["qkv"], mlp_dim=s["mlp"], max_len=s["max_len"],
            **switches,
        )  # fmt: skip
        eval_model = TransformerLM(
            dataclasses.replace(cfg, deterministic=True, return_hidden=False)
        )

        def init(rng: jax.Array) -> Any:
            tokens = jnp.ones((s["batch"], s["length"]), jnp.float32)
            params = eval_model.init(rng, tokens)["params"]
            return TrainState.create(  # type: ignore[no-untyped-call]
                apply_fn=eval_model.apply, params=params, tx=_optimizer()
            )

        step = jax.jit(
            functools.partial(_train_step, cfg=cfg, chunks=s["chunks"]), donate_argnums=(0,)
        )
        if not concrete:
            key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
            return step, (jax.eval_shape(init, jax.random.PRNGKey(0)), _batch(s, False), key)
        state = jax.jit(init)(jax.random.PRNGKey(0))
        return step, (state, _batch(s, True), jax.random.PRNGKey(2))

    return build


PROGRAM = register(
    RealProgram(
        name="lm1b",
        model="flax lm1b Transformer LM (flax linen), one device's share, AdamW",
        source=SOURCE,
        libraries=("flax.linen", "optax"),
        build=_builder(),
        fixes={
            "vocab-logits": _builder(return_hidden=True),
            "scan-residuals": _builder(remat=True),
        },
        tolerance=2e-2,
        notes=(
            "one device's 32 x 128 tokens of the pmapped step, under jax.jit with the state "
            "donated as the example does; data loading, eval and sampling left out"
        ),
    )
)
