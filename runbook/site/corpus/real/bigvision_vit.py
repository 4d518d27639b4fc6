"""big_vision's ViT-B/16 trained on ImageNet-1k: one device's share of the step.

The model (flax.linen) is big_vision's plain ViT: a 16x16 patch convolution, learned
position embeddings, a class token (``pool_type="tok"``), 12 pre-LayerNorm encoder blocks
of `nn.MultiHeadDotProductAttention` (12 heads) and a GELU MLP (3072), a final LayerNorm, a
tanh pre-logits layer (``rep_size=True``) and a zero-initialised 1000-way head, all in
float32 (``dtype_mm="float32"``). The step is big_vision's ``update_fn``: the rng folded
with the optimizer's step count, mixup (``p=0.5``, the "medium2" setting of B/16), softmax
cross-entropy against one-hot labels, and big_vision's optax chain for vit_i1k: global-norm
clipping at 1.0, ``scale_by_adam`` with a bfloat16 first moment, lr 0.001, decoupled weight
decay 1e-4 on the kernels, a 10k-step warmup into a cosine; ``jax.jit`` donates the state.

Authors' scale (big_vision/configs/vit_i1k.py, variant B/16): global batch 4096, 224x224
images, 197 tokens. We compile one device's share of it: 512 images, the batch of each of
8 data-parallel devices (parameters and optimizer state replicated, as big_vision's default
sharding strategy has them). Kept: the model's modules, initialisers, dtypes, the optimizer
and the update. Changed: the input pipeline and the logged measurements are left out, the
model's dictionary of intermediates is not built (the step never reads it), and mixup runs
on the device's own batch directly (big_vision's shard_map of it does the same per device).

The fixes:

- attention-scores: an ``attention_fn`` that runs the heads one at a time under
  `jax.checkpoint`, so no ``heads x 197 x 197`` scores are kept for the gradient. The
  runbook's own blockwise attention is causal, and 197 tokens divide into no blocks, so
  this module has its own (non-causal) one.
- scan-residuals: big_vision's remat policy (``nothing_saveable``) on each encoder block.
  big_vision applies it with ``scan=True`` (`nn.scan` over stacked blocks); we keep the
  Python loop and its parameter layout so that the results compare leaf by leaf.

- grad-accumulation: mixup over the whole batch, as the step does it, then the gradient
  summed over micro-batches of the mixed images
  (`runbook.cases.grad_accumulation.accumulate_gradients`) before one update.

No donation fix: big_vision's jit already donates the train state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from runbook.cases.grad_accumulation import accumulate_gradients

from ._program import Builder, Built, RealProgram, register

SOURCE = (
    "https://github.com/google-research/big_vision/blob/"
    "5f95305cdb93f8da81fb21178a5024cff5ad4f96/big_vision/models/vit.py"
)
# B/16 at 224 px, 512 images per device (4096 / 8); 300 epochs of 99% of ImageNet-1k.
SCALES: dict[str, dict[str, int]] = {
    "authors": {"image": 224, "patch": 16, "width": 768, "depth": 12, "mlp": 3072,
                "heads": 12, "classes": 1000, "batch": 512, "steps": 92_892},
    "tiny": {"image": 32, "patch": 8, "width": 32, "depth": 2, "mlp": 64,
             "heads": 2, "classes": 10, "batch": 4, "steps": 100},
}  # fmt: skip
WARMUP = 10_000
MIXUP_P = 0.5
ACCUMULATE = 8  # micro-batches in the grad-accumulation fix (64 images each at 512)


def attention_heads_checkpointed(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
    """Non-causal softmax attention one head at a time, each head under `jax.checkpoint`.

    Inputs ``(batch, tokens, heads, head_dim)``, as flax passes them to an ``attention_fn``.
    `jax.lax.map` runs the heads one after another and the gradient recomputes each head's
    ``tokens x tokens`` probabilities instead of keeping those of every head.
    """
    scale = query.shape[-1] ** -0.5

    @jax.checkpoint
    def head(qkv: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        q, k, v = qkv
        probs = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q * scale, k), axis=-1)
        return jnp.einsum("bqk,bkd->bqd", probs, v)

    heads = tuple(jnp.moveaxis(x, 2, 0) for x in (query, key, value))
    out: jax.Array = jax.lax.map(head, heads)
    return jnp.moveaxis(out, 0, 2)


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = functools.partial(
            nn.Dense, kernel_init=nn.initializers.xavier_uniform(),
            bias_init=nn.initializers.normal(stddev=1e-6),
        )  # fmt: skip
        return dense(x.shape[-1])(nn.gelu(dense(self.mlp_dim)(x)))


class Encoder1DBlock(nn.Module):
    mlp_dim: int
    num_heads: int
    attention_fn: Callable[..., jax.Array] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            kernel_init=nn.initializers.xavier_uniform(),
            attention_fn=self.attention_fn or nn.dot_product_attention,
        )(y, y)
        x = x + y
        return x + MlpBlock(self.mlp_dim)(nn.LayerNorm()(x))


class Encoder(nn.Module):
    depth: int
    mlp_dim: int
    num_heads: int
    remat: bool = False
    attention_fn: Callable[..., jax.Array] | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        block: Any = Encoder1DBlock
        if self.remat:
            block = nn.remat(Encoder1DBlock,
                             policy=jax.checkpoint_policies.nothing_saveable)  # fmt: skip
        for i in range(self.depth):
            x = block(self.mlp_dim, self.num_heads, self.attention_fn, name=f"encoderblock_{i}")(x)
        out: jax.Array = nn.LayerNorm(name="encoder_norm")(x)
        return out


class ViT(nn.Module):
    num_classes: int
    patch: int
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    remat: bool = False
    attention_fn: Callable[..., jax.Array] | None = None

    @nn.compact
    def __call__(self, image: jax.Array) -> jax.Array:
        x = nn.Conv(self.width, (self.patch, self.patch), strides=(self.patch, self.patch),
                    padding="VALID", name="embedding")(image)  # fmt: skip
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        posemb = self.param(
            "pos_embedding", nn.initializers.normal(stddev=1 / np.sqrt(c)), (1, h * w, c)
        )
        x = x + posemb
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = Encoder(self.depth, self.mlp_dim, self.num_heads, self.remat, self.attention_fn,
                    name="Transformer")(x)  # fmt: skip
        x = nn.tanh(nn.Dense(self.width, name="pre_logits")(x[:, 0]))
        return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x)


def _schedule(total: int) -> Callable[[jax.Array], jax.Array]:
    """big_vision's ``decay_type="cosine"`` with a linear warmup, base 1 (lr is scaled apart)."""

    def step_fn(step: jax.Array) -> jax.Array:
        progress = jnp.clip((step - WARMUP) / (total - WARMUP), 0.0, 1.0)
        lr = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.asarray(lr * jnp.minimum(1.0, step / WARMUP), jnp.float32)

    return step_fn


def _optimizer(params: Any, total: int) -> optax.GradientTransformation:
    kernels = jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", "") == "kernel", params
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.scale_by_adam(mu_dtype=jnp.bfloat16),
        optax.scale(0.001),
        optax.add_decayed_weights(0.0001, kernels),
        optax.scale_by_schedule(_schedule(total)),
        optax.scale(-1.0),
    )


def _count(opt_state: Any) -> jax.Array:
    """The optimizer's step, from its `ScaleByScheduleState` (big_vision's ``get_count``)."""
    found = [
        s.count
        for s in jax.tree.leaves(
            opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState)
        )
        if isinstance(s, optax.ScaleByScheduleState)
    ]
    count: jax.Array = found[0]
    return count


def _update_fn(
    model: ViT, tx: optax.GradientTransformation, micro_batches: int = 1
) -> Callable[..., Any]:
    def update_fn(train_state: Any, rng: jax.Array, batch: Any) -> tuple[Any, jax.Array]:
        images, labels = batch["image"], batch["labels"]
        rng = jax.random.fold_in(rng, _count(train_state["opt"]))
        rng, rng_mixup = jax.random.split(rng)
        a = jax.random.beta(rng_mixup, MIXUP_P, MIXUP_P)
        a = jnp.maximum(a, 1.0 - a)
        images, labels = (a * t + (1 - a) * jnp.roll(t, 1, axis=0) for t in (images, labels))

        def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
            images, labels = batch
            logits = cast(jax.Array, model.apply({"params": params}, images))
            return jnp.mean(-jnp.sum(labels * jax.nn.log_softmax(logits), axis=-1))

        params, opt = train_state["params"], train_state["opt"]
        if micro_batches > 1:
            loss, grads = accumulate_gradients(loss_fn, params, (images, labels), micro_batches)
        else:
            loss, grads = jax.value_and_grad(loss_fn)(params, (images, labels))
        updates, opt = tx.update(grads, opt, params)
        return {"params": optax.apply_updates(params, updates), "opt": opt}, loss

    return update_fn


def _builder(remat: bool = False, attention: bool = False, accumulate: bool = False) -> Builder:
    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        model = ViT(
            s["classes"], s["patch"], s["width"], s["depth"], s["mlp"], s["heads"], remat,
            attention_heads_checkpointed if attention else None,
        )  # fmt: skip
        image = jax.ShapeDtypeStruct((s["batch"], s["image"], s["image"], 3), jnp.float32)
        labels = jax.ShapeDtypeStruct((s["batch"], s["classes"]), jnp.float32)
        rng = jax.random.PRNGKey(0)
        params = jax.eval_shape(lambda r, x: model.init(r, x)["params"], rng, image)
        tx = _optimizer(params, s["steps"])
        micro_batches = min(ACCUMULATE, s["batch"]) if accumulate else 1
        step = jax.jit(_update_fn(model, tx, micro_batches), donate_argnums=(0,))
        if not concrete:
            opt = jax.eval_shape(tx.init, params)
            rng_s = jax.ShapeDtypeStruct(rng.shape, rng.dtype)
            return step, ({"params": params, "opt": opt}, rng_s, {"image": image, "labels": labels})
        k_init, k_image, k_label = jax.random.split(rng, 3)
        real = model.init(k_init, jnp.zeros(image.shape, image.dtype))["params"]
        # The head starts at zero; move it off, so that every gradient depends on the inputs.
        head = real["head"]["kernel"]
        real["head"]["kernel"] = 0.02 * jax.random.normal(k_init, head.shape, head.dtype)
        batch = {
            "image": jax.random.normal(k_image, image.shape, image.dtype),
            "labels": jax.nn.one_hot(
                jax.random.randint(k_label, (s["batch"],), 0, s["classes"]), s["classes"]
            ),
        }
        return step, ({"params": real, "opt": tx.init(real)}, rng, batch)

    return build


PROGRAM = register(
    RealProgram(
        name="bigvision-vit-b16",
        model="big_vision ViT-B/16 ImageNet step (flax linen), one of 8 devices, scale_by_adam",
        source=SOURCE,
        libraries=("flax.linen", "optax"),
        build=_builder(),
        fixes={
            "attention-scores": _builder(attention=True),
            "scan-residuals": _builder(remat=True),
            "grad-accumulation": _builder(accumulate=True),
        },
        tolerance=1e-4,
        notes="input pipeline and logged norms left out; 512 images = 4096 over 8 devices",
    )
)
