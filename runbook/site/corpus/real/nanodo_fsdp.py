"""nanodo: Google DeepMind's minimal decoder-only transformer, trained with FSDP.

The model (flax.linen) is a pre-LayerNorm GPT: token and position embeddings, `N` blocks
of causal multi-head attention written as two einsums with a float32 softmax, a GELU MLP,
and logits from the token embedding (``embed.attend``). Every weight carries a
`nn.with_partitioning` annotation that splits one axis over the mesh axis ``"data"`` (the
model dimension of the embeddings, the input dimension of the projections): FSDP on one
axis that also splits the batch. The training step is nanodo's own: the batch arrives
replicated and is constrained to ``P("data")``, the loss is next-token cross-entropy on
integer labels weighted by non-padding, the optimizer AdamW (b2 0.98, eps 1e-9, weight
decay 0.1, warmup then cosine) inside `optax.MultiSteps`, and `jax.jit` gets the state's
shardings as in- and out-shardings and donates the state and the batch.

Authors' scale (nanodo/configs/default.py): D=512, H=8, L=512, N=6, F=2048, bfloat16
compute, global batch 256 over 8 devices, vocabulary 32,100 (the 32,000 + 100 extra ids
SentencePiece model it ships). Kept: the modules, initialisers, partitioning, dtypes,
optimizer and the jit call. Changed: data loading and metrics are left out (the step
returns the state and the loss), the tokens are an abstract input, and the vocabulary is
a number rather than read from the tokenizer.

Nothing constrains the activations: the partitioner sees a batch split on ``"data"`` and
an embedding whose model dimension is split on ``"data"`` too, and is free to keep the
activations and logits of the whole global batch on every device. The fixes:

- resharding: `jax.lax.with_sharding_constraint` of the activations (after the
  embedding and each block) and of the logits to ``P("data")`` on the batch.
- vocab-logits: the loss a slice of the vocabulary at a time
  (`runbook.cases.vocab_logits.loss_vocab_tiles`) instead of the full logits.
- attention-scores: `runbook.cases.attention_scores.attention_blockwise` for the causal
  attention (the scores in float32 blocks, never ``L x L``).
- scan-residuals: nanodo's own ``remat=True`` (`nn.remat` of each block).

No donation fix: nanodo's jit already donates the state and the batch.
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
from flax.training.train_state import TrainState
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from runbook import _case_types
from runbook.cases.attention_scores import attention_blockwise
from runbook.cases.vocab_logits import loss_vocab_tiles

from ._program import Builder, Built, RealProgram, register

DEVICES = 8
SOURCE = (
    "https://github.com/google-deepmind/nanodo/blob/"
    "003211b3aa525d04431a2b72fb38fd527472758e/nanodo/model.py"
)
SCALES: dict[str, dict[str, int]] = {
    "authors": {"D": 512, "H": 8, "L": 512, "N": 6, "F": 2048, "V": 32100, "batch": 256},
    "tiny": {"D": 32, "H": 4, "L": 32, "N": 2, "F": 64, "V": 96, "batch": 16},
}


@dataclasses.dataclass(frozen=True)
class DoConfig:
    """nanodo's hyper-parameters, and the switches our fixes turn."""

    D: int  # model width
    H: int  # heads
    L: int  # context length
    N: int  # blocks
    V: int  # vocabulary
    F: int  # MLP width
    dtype: Any = jnp.bfloat16
    fsdp_enabled: bool = True
    remat: bool = False
    # ours, for the fixes: where to pin the activations, blockwise attention, and a model
    # that returns the final hidden state (the loss then unembeds a slice at a time).
    act_sharding: NamedSharding | None = None
    blockwise: bool = False
    return_hidden: bool = False


KERNEL_INIT = nn.initializers.xavier_uniform()
EMBED_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
# One axis of each weight split over "data" (nanodo/fsdp.py).
PARTITIONS = {
    "embedding": (None, "data"),
    "attn_in_proj": ("data", None, None),
    "attn_out_proj": (None, None, "data"),
    "mlp_kernel": ("data", None),
}


def _init(kind: str, cfg: DoConfig) -> Any:
    base = EMBED_INIT if kind == "embedding" else KERNEL_INIT
    return nn.with_partitioning(base, PARTITIONS[kind]) if cfg.fsdp_enabled else base


def _pin(x: jax.Array, cfg: DoConfig) -> jax.Array:
    if cfg.act_sharding is None:
        return x
    pinned: jax.Array = jax.lax.with_sharding_constraint(x, cfg.act_sharding)
    return pinned


class Mlp(nn.Module):
    cfg: DoConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = functools.partial(
            nn.Dense, use_bias=False, dtype=self.cfg.dtype,
            kernel_init=_init("mlp_kernel", self.cfg),
        )  # fmt: skip
        return dense(self.cfg.D)(jax.nn.gelu(dense(self.cfg.F)(x)))


class CausalAttn(nn.Module):
    cfg: DoConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        head = cfg.D // cfg.H
        proj = functools.partial(
            nn.DenseGeneral, axis=-1, features=(cfg.H, head), use_bias=False,
            dtype=cfg.dtype, kernel_init=_init("attn_in_proj", cfg),
        )  # fmt: skip
        q = proj(name="query")(x) / head**0.5
        k = proj(name="key")(x)
        v = proj(name="value")(x)
        if cfg.blockwise:
            out = attention_blockwise(q, k, v, min(128, x.shape[1]), 1.0)
        else:
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
            length = x.shape[1]
            causal = jnp.tril(jnp.ones((1, 1, length, length), jnp.bool_))
            lowest = jnp.finfo(cfg.dtype).min  # type: ignore[no-untyped-call]
            scores = jnp.where(causal, scores, lowest)
            probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
            out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(
            features=cfg.D, axis=(-2, -1), use_bias=False, dtype=cfg.dtype,
            kernel_init=_init("attn_out_proj", cfg), name="attn_out_proj",
        )(out)  # fmt: skip


class TBlock(nn.Module):
    cfg: DoConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x + CausalAttn(self.cfg)(nn.LayerNorm(dtype=self.cfg.dtype, use_bias=False)(x))
        return h + Mlp(self.cfg)(nn.LayerNorm(dtype=self.cfg.dtype, use_bias=False)(h))


class TransformerDo(nn.Module):
    cfg: DoConfig

    def setup(self) -> None:
        cfg = self.cfg
        self.embed = nn.Embed(cfg.V, cfg.D, embedding_init=_init("embedding", cfg))
        self.pos_embed = nn.Embed(cfg.L, cfg.D, embedding_init=_init("embedding", cfg))
        block = nn.remat(TBlock) if cfg.remat else TBlock
        self.blocks = [block(cfg) for _ in range(cfg.N)]
        self.out_ln = nn.LayerNorm(dtype=cfg.dtype, use_bias=False)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        y = self.embed(tokens)
        y += self.pos_embed(jnp.arange(tokens.shape[1])[None])
        y = _pin(y, self.cfg)
        for block in self.blocks:
            y = _pin(block(y), self.cfg)
        y = self.out_ln(y)
        if self.cfg.return_hidden:
            hidden: jax.Array = y.astype(jnp.float32)
            return hidden
        return _pin(self.embed.attend(y.astype(jnp.float32)), self.cfg)


def _schedule(steps: int = 100_000, warmup: int = 1000) -> optax.Schedule:
    """nanodo's default: linear warmup 1.6e-4 -> 1.6e-3, cosine back to 1.6e-4."""
    peak, low = 0.0016, 0.00016
    return optax.join_schedules(
        [
            optax.linear_schedule(low, peak, warmup),
            optax.cosine_decay_schedule(peak, steps - warmup, alpha=low / peak),
        ],
        boundaries=[warmup],
    )


def _optimizer() -> optax.GradientTransformation:
    adamw = optax.adamw(_schedule(), b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)
    return optax.MultiSteps(adamw, 1)


def _in_out(batch: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Inputs, next-token targets (padded with 0) and weights (0 on padding)."""
    y = jnp.pad(batch[:, 1:], ((0, 0), (0, 1)))
    return batch, y, (y != 0).astype(jnp.float32)


def _train_step(state: TrainState, in_BxL: jax.Array, mesh: Mesh, cfg: DoConfig) -> Any:
    in_BxL = jax.lax.with_sharding_constraint(in_BxL, NamedSharding(mesh, P("data")))

    def loss_fn(params: Any) -> jax.Array:
        x, y, weights = _in_out(in_BxL)
        out = state.apply_fn({"params": params}, x)
        ntokens = weights.sum()
        if cfg.return_hidden:
            w = nn.unbox(params["embed"]["embedding"]).T  # (D, V)
            total = loss_vocab_tiles(out.reshape(-1, cfg.D), w, y.reshape(-1), weights.reshape(-1))
            return total / ntokens
        losses = optax.losses.softmax_cross_entropy_with_integer_labels(out, y)
        return jnp.sum(losses * weights) / ntokens

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        step=opt_state.gradient_step + 1,
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
    )
    return new_state, loss


def _builder(pin: bool = False, **switches: bool) -> Builder:
    """The step with the fix's switches on (none: the program as nanodo has it)."""

    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        mesh = Mesh(np.array(_case_types.devices(DEVICES)), ("data",))
        act = NamedSharding(mesh, P("data")) if pin else None
        cfg = DoConfig(
            D=s["D"], H=s["H"], L=s["L"], N=s["N"], V=s["V"], F=s["F"],
            act_sharding=act, **switches,
        )  # fmt: skip
        model = TransformerDo(cfg)

        def init(rng: jax.Array, tokens: jax.Array) -> TrainState:
            params = model.init(rng, tokens)["params"]
            return TrainState.create(  # type: ignore[no-any-return, no-untyped-call]
                apply_fn=model.apply, params=params, tx=_optimizer()
            )

        tokens = jax.ShapeDtypeStruct((1, s["L"]), jnp.int32)
        shape = jax.eval_shape(init, jax.random.key(0), tokens)
        shardings = nn.get_sharding(shape, mesh)
        step = jax.jit(
            functools.partial(_train_step, mesh=mesh, cfg=cfg),
            in_shardings=(shardings, NamedSharding(mesh, P())),
            out_shardings=(shardings, NamedSharding(mesh, P())),
            donate_argnames=("state", "in_BxL"),
        )
        batch_shape = (s["batch"], s["L"])
        if not concrete:
            return step, (shape, jax.ShapeDtypeStruct(batch_shape, jnp.int32))
        key, data = jax.random.split(jax.random.key(0))
        state = jax.jit(init, out_shardings=shardings)(key, jnp.zeros((1, s["L"]), jnp.int32))
        batch = jax.random.randint(data, batch_shape, 0, s["V"], jnp.int32)
        return step, (state, batch)

    return build


PROGRAM = register(
    RealProgram(
        name="nanodo-fsdp",
        model="nanodo decoder-only LM (flax linen), FSDP over 8 devices, AdamW",
        source=SOURCE,
        libraries=("flax.linen", "optax", "jax.sharding"),
        build=_builder(),
        fixes={
            "resharding": _builder(pin=True),
            "vocab-logits": _builder(return_hidden=True),
            "attention-scores": _builder(blockwise=True),
            "scan-residuals": _builder(remat=True),
        },
        devices=DEVICES,
        tolerance=2e-3,
        notes="data loading and metrics left out; tokens abstract; vocabulary 32,100 given",
    )
)
