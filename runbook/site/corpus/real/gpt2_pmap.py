"""GPT-2 small in flax.linen, trained data-parallel with `jax.pmap` over 8 devices.

The model is a Flax port of GPT-2 after Karpathy's build-nanoGPT (benkoska/gpt2-jax):
token and learned position embeddings (a plain `jnp.take` of the table), 12 pre-LayerNorm
blocks of causal self-attention (one fused ``c_attn`` projection, then
`jax.nn.dot_product_attention` with ``is_causal=True`` and the XLA implementation) and a
GELU MLP, a final LayerNorm, and logits from the token embedding (``wte.attend``, in the
compute dtype). The loss is softmax cross-entropy against one-hot targets, as the port has
it (it avoids integer labels on bfloat16 logits). The optimizer clips the global norm to 1,
then AdamW (b1 0.9, b2 0.95, weight decay 0.1 on the matrices only) on a warmup-then-cosine
schedule. The step is `jax.pmap`ped over the axis ``"batch"``: loss and gradients are
averaged with `lax.pmean`, and it returns the new state and the port's measurements (loss,
gradient and parameter norms). The pmap donates nothing.

Authors' scale (configs/default.py): 12 layers, width 768, 12 heads, context 1024,
vocabulary padded to 50,304, bfloat16 compute with float32 parameters; each sequence is
1,025 tokens (input and shifted target). Per device we take 16 sequences, 16 x 1024 tokens
(the port's default is 512 sequences over the devices, with ``grad_accum_steps`` to split
them when memory runs short). Kept: the modules, initialisers, dtypes, loss, optimizer and
the pmap. Changed: data loading, logging and checkpoints are left out; the tokens are an
abstract input; gradient accumulation is off (the port's default of one step). The port has
no dropout, so no prng-temporaries fix.

The fixes:

- donation: the same pmap with ``donate_argnums=(0,)`` (the state).
- vocab-logits: the model returns the final hidden state and the loss takes the vocabulary
  a slice at a time (`runbook.cases.vocab_logits.loss_vocab_tiles`), never the
  ``tokens x 50,304`` logits nor their one-hot targets.
- attention-scores: `runbook.cases.attention_scores.attention_blockwise` in place of
  `jax.nn.dot_product_attention` (no ``1024 x 1024`` scores per head).
- scan-residuals: `nn.remat` of each block (the residuals of a block recomputed in the
  backward pass instead of kept for all 12).
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
from jax import lax

from runbook import _case_types
from runbook.cases.attention_scores import attention_blockwise
from runbook.cases.vocab_logits import loss_vocab_tiles

from ._program import Builder, Built, RealProgram, register

DEVICES = 8
SOURCE = (
    "https://github.com/benkoska/gpt2-jax/blob/63e3b3a7d7e402b4c13df583f8ee1a3573995c85/train.py"
)
SCALES: dict[str, dict[str, int]] = {
    "authors": {"V": 50304, "T": 1024, "D": 768, "H": 12, "L": 12, "batch": 16, "block": 128},
    "tiny": {"V": 96, "T": 32, "D": 32, "H": 4, "L": 2, "batch": 2, "block": 16},
}


@dataclasses.dataclass(frozen=True)
class Gpt2Config:
    """The port's model sizes, and the switches our fixes turn."""

    vocab_size: int
    block_size: int
    emb_dim: int
    num_heads: int
    num_layers: int
    dtype: Any = jnp.bfloat16
    # ours, for the fixes
    blockwise: int = 0  # block of `attention_blockwise`; 0: jax.nn.dot_product_attention
    remat: bool = False
    return_hidden: bool = False


NORMAL = nn.initializers.normal(0.02)


class Attention(nn.Module):
    cfg: Gpt2Config
    proj_init: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        heads = self.cfg.num_heads
        qkv = nn.Dense(3 * width, kernel_init=NORMAL, dtype=self.cfg.dtype, name="c_attn")(x)
        q, k, v = (
            part.reshape(batch, length, heads, width // heads)
            for part in jnp.split(qkv, 3, axis=-1)
        )
        if self.cfg.blockwise:
            out = attention_blockwise(q, k, v, self.cfg.blockwise)
        else:
            out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        return nn.DenseGeneral(
            width, axis=(-2, -1), kernel_init=self.proj_init, dtype=self.cfg.dtype,
            name="c_proj",
        )(out)  # fmt: skip


class Mlp(nn.Module):
    cfg: Gpt2Config
    proj_init: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        width = x.shape[-1]
        h = nn.Dense(4 * width, kernel_init=NORMAL, dtype=self.cfg.dtype, name="c_fc")(x)
        h = nn.gelu(h)
        return nn.Dense(width, kernel_init=self.proj_init, dtype=self.cfg.dtype, name="c_proj")(h)


class Block(nn.Module):
    cfg: Gpt2Config
    proj_init: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + Attention(self.cfg, self.proj_init, name="attn")(nn.LayerNorm(name="ln_1")(x))
        return x + Mlp(self.cfg, self.proj_init, name="mlp")(nn.LayerNorm(name="ln_2")(x))


class Embed(nn.Module):
    """A table looked up with `jnp.take` (no cast), attended in the compute dtype."""

    num_embeddings: int
    features: int
    dtype: Any

    def setup(self) -> None:
        self.embedding = self.param("embedding", NORMAL, (self.num_embeddings, self.features))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding, ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        return x.astype(self.dtype) @ self.embedding.astype(self.dtype).T


class GPT(nn.Module):
    cfg: Gpt2Config

    @nn.compact
    def __call__(self, ids: jax.Array) -> Any:
        cfg = self.cfg
        wte = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype, name="wte")
        wpe = Embed(cfg.block_size, cfg.emb_dim, cfg.dtype, name="wpe")
        x = wte(ids) + wpe(jnp.arange(ids.shape[1], dtype=jnp.int32))
        proj_init = nn.initializers.normal(0.02 / np.sqrt(2 * cfg.num_layers))
        block = nn.remat(Block) if cfg.remat else Block
        for i in range(cfg.num_layers):
            x = block(cfg, proj_init, name=str(i))(x)
        x = nn.LayerNorm(name="ln_f")(x)
        if cfg.return_hidden:
            return x
        return wte.attend(x)


def _schedule(
    peak: float = 6e-4, low: float = 6e-5, total: int = 19073, warmup: int = 715
) -> optax.Schedule:
    """The port's schedule: linear warmup from 0, cosine down to a tenth."""

    def schedule(step: jax.Array) -> jax.Array:
        ratio = jnp.clip((step - warmup) / (total - warmup), 0.0, 1.0)
        lr = low + (peak - low) * 0.5 * (1 + jnp.cos(ratio * jnp.pi))
        return jnp.minimum(lr, peak * step / warmup)

    return schedule


def _optimizer(params: Any) -> optax.GradientTransformation:
    decay = jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(_schedule(), b1=0.9, b2=0.95, weight_decay=0.1, mask=decay),
    )


def _train_step(state: TrainState, batch: jax.Array, cfg: Gpt2Config) -> Any:
    def loss_fn(params: Any) -> Any:
        x, y = batch[:, :-1], batch[:, 1:]
        out = state.apply_fn({"params": params}, x)
        if cfg.return_hidden:
            w = params["wte"]["embedding"].astype(cfg.dtype).T  # (D, V)
            h = out.reshape(-1, cfg.emb_dim).astype(cfg.dtype)
            return loss_vocab_tiles(h, w, y.reshape(-1)) / y.size
        targets = jax.nn.one_hot(y, out.shape[-1])
        return optax.softmax_cross_entropy(out, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    loss, grads = lax.pmean((loss, grads), axis_name="batch")
    new_state = state.apply_gradients(grads=grads)  # type: ignore[no-untyped-call]
    grad_norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
    param_norm = jnp.sqrt(sum(jnp.vdot(p, p) for p in jax.tree.leaves(new_state.params)))
    return new_state, {"loss": loss, "l2_grads": grad_norm, "l2_params": param_norm}


def _replicated(tree: Any, n: int) -> Any:
    """A leading device axis on every leaf (abstract leaves stay abstract)."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((n, *x.shape), x.dtype)
        return jnp.broadcast_to(x, (n, *jnp.shape(x)))

    return jax.tree.map(one, tree)


def _builder(donate: bool = False, blockwise: bool = False, **switches: bool) -> Builder:
    """The step with the fix's switches on (none: the program as the port has it)."""

    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        cfg = Gpt2Config(
            vocab_size=s["V"], block_size=s["T"], emb_dim=s["D"], num_heads=s["H"],
            num_layers=s["L"], blockwise=s["block"] if blockwise else 0, **switches,
        )  # fmt: skip
        model = GPT(cfg)

        def init(rng: jax.Array) -> Any:
            params = model.init(rng, jnp.ones((1, s["T"]), jnp.int32))["params"]
            return TrainState.create(  # type: ignore[no-untyped-call]
                apply_fn=model.apply, params=params, tx=_optimizer(params)
            )

        step = jax.pmap(
            functools.partial(_train_step, cfg=cfg),
            axis_name="batch",
            devices=_case_types.devices(DEVICES),
            donate_argnums=(0,) if donate else (),
        )
        batch_shape = (DEVICES, s["batch"], s["T"] + 1)
        if not concrete:
            state = jax.eval_shape(init, jax.random.key(0))
            return step, (_replicated(state, DEVICES), jax.ShapeDtypeStruct(batch_shape, jnp.int32))
        key, data = jax.random.split(jax.random.key(0))
        state = _replicated(jax.jit(init)(key), DEVICES)
        batch = jax.random.randint(data, batch_shape, 0, s["V"], jnp.int32)
        return step, (state, batch)

    return build


PROGRAM = register(
    RealProgram(
        name="gpt2-pmap",
        model="GPT-2 small (flax linen), jax.pmap over 8 devices, AdamW",
        source=SOURCE,
        libraries=("flax.linen", "optax", "jax.pmap"),
        build=_builder(),
        fixes={
            "donation": _builder(donate=True),
            "vocab-logits": _builder(return_hidden=True),
            "attention-scores": _builder(blockwise=True),
            "scan-residuals": _builder(remat=True),
        },
        devices=DEVICES,
        tolerance=2e-2,
        notes=(
            "data loading, logging and checkpoints left out; tokens abstract; 16 sequences "
            "per device (the port splits 512 over its devices); the port has no dropout"
        ),
    )
)
