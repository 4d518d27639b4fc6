"""Flax's ImageNet example: ResNet-50 (v1.5, bottleneck blocks) with batch norm, SGD.

The model (flax.linen) is a 7x7 stride-2 stem, batch norm, ReLU and max-pool, then four
stages of 3, 4, 6 and 3 bottleneck blocks (1x1, 3x3 with the stride, 1x1 to four times
the width; the last batch norm of each block starts at zero; a projection on the shortcut
where shapes change), global average pooling and a dense classifier. Batch norm (momentum
0.9, epsilon 1e-5) keeps running statistics in the mutable ``batch_stats`` collection,
which the step updates. The loss is softmax cross-entropy against one-hot labels plus an
L2 penalty of 1e-4 / 2 on the weight matrices; SGD with Nesterov momentum 0.9 (optax) on a
linear warmup then cosine schedule. The step returns the new state (parameters, momentum,
batch statistics) and the loss and accuracy.

Authors' scale (configs/default.py): batch 128 at 224 x 224 x 3, 1,000 classes, float32
(``half_precision`` off). The example pmaps the step over the devices, which split the
batch; we compile it for one device holding the whole batch of 128 under `jax.jit`, with
the cross-device `pmean`s dropped. Kept: the model, initialisers, dtypes, loss, weight
penalty, optimizer and the mutable batch statistics; the example's pmap donates nothing.
Changed: data loading, evaluation, checkpoints and the dynamic loss scale (off in float32)
are left out; images and labels are abstract inputs.

The fixes:

- donation: `jax.jit` with ``donate_argnums=(0,)`` (the state).
- scan-residuals: `nn.remat` of each bottleneck block (its activations recomputed in the
  backward pass instead of kept for all 16 blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import common_utils, train_state

from ._program import Builder, Built, RealProgram, register

SOURCE = (
    "https://github.com/google/flax/blob/"
    "594b4529fa84bbbba5d5031d12968d355d03850f/examples/imagenet/train.py"
)
SCALES: dict[str, dict[str, Any]] = {
    "authors": {"stages": (3, 4, 6, 3), "filters": 64, "classes": 1000, "batch": 128,
                "image": 224},
    "tiny": {"stages": (1, 1), "filters": 4, "classes": 10, "batch": 4, "image": 32},
}  # fmt: skip


class BottleneckResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.conv(self.filters * 4, (1, 1))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        shortcut = x
        if shortcut.shape != y.shape:
            shortcut = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(x)
            shortcut = self.norm(name="norm_proj")(shortcut)
        return nn.relu(shortcut + y)


class ResNet(nn.Module):
    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32
    remat: bool = False  # ours, for the fix

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(
            nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
            dtype=self.dtype,
        )  # fmt: skip
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")  # type: ignore[no-untyped-call]
        block = nn.remat(BottleneckResNetBlock) if self.remat else BottleneckResNetBlock
        n = 0
        for i, size in enumerate(self.stage_sizes):
            for j in range(size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                # the name flax gives the block unwrapped, so remat keeps the same weights
                name = f"BottleneckResNetBlock_{n}"
                x = block(self.num_filters * 2**i, conv, norm, strides, name=name)(x)
                n += 1
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dense(self.num_classes, dtype=self.dtype)(x)
        return jnp.asarray(x, self.dtype)


class TrainState(train_state.TrainState):  # type: ignore[no-untyped-call]
    batch_stats: Any


def _schedule(
    base: float, steps_per_epoch: int, warmup: float = 5.0, epochs: float = 100.0
) -> optax.Schedule:
    """Linear warmup over `warmup` epochs, then cosine decay over the rest."""
    warm = optax.linear_schedule(0.0, base, int(warmup * steps_per_epoch))
    cosine = optax.cosine_decay_schedule(base, int((epochs - warmup) * steps_per_epoch))
    return optax.join_schedules([warm, cosine], [int(warmup * steps_per_epoch)])


# lr 0.1 * 128 / 256; imagenet2012's 1,281,167 training images at 128 a step.
LEARNING_RATE = _schedule(0.1 * 128 / 256, 1_281_167 // 128)


def _train_step(state: TrainState, batch: dict[str, jax.Array], classes: int) -> Any:
    def loss_fn(params: Any) -> tuple[jax.Array, tuple[Any, jax.Array]]:
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        labels = common_utils.onehot(  # type: ignore[no-untyped-call]
            batch["label"], num_classes=classes
        )
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=labels))
        l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
        return loss + 1e-4 * 0.5 * l2, (new_model_state, logits)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (new_model_state, logits)), grads = grad_fn(state.params)
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
        "learning_rate": LEARNING_RATE(state.step),
    }
    new_state = state.apply_gradients(  # type: ignore[no-untyped-call]
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )
    return new_state, metrics


def _builder(donate: bool = False, remat: bool = False) -> Builder:
    """The step with the fix's switches on (none: the program as the example has it)."""

    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        model = ResNet(s["stages"], s["classes"], s["filters"], remat=remat)
        size = s["image"]

        def init(rng: jax.Array) -> Any:
            variables = model.init({"params": rng}, jnp.ones((1, size, size, 3), jnp.float32))
            tx = optax.sgd(LEARNING_RATE, momentum=0.9, nesterov=True)
            return TrainState.create(  # type: ignore[no-untyped-call]
                apply_fn=model.apply, params=variables["params"], tx=tx,
                batch_stats=variables["batch_stats"],
            )  # fmt: skip

        step = jax.jit(
            functools.partial(_train_step, classes=s["classes"]),
            donate_argnums=(0,) if donate else (),
        )
        images = (s["batch"], size, size, 3)
        if not concrete:
            batch: dict[str, Any] = {
                "image": jax.ShapeDtypeStruct(images, jnp.float32),
                "label": jax.ShapeDtypeStruct((s["batch"],), jnp.int32),
            }
            return step, (jax.eval_shape(init, jax.random.key(0)), batch)
        key, data, labels = jax.random.split(jax.random.key(0), 3)
        data_batch = {
            "image": jax.random.normal(data, images, jnp.float32),
            "label": jax.random.randint(labels, (s["batch"],), 0, s["classes"], jnp.int32),
        }
        return step, (jax.jit(init)(key), data_batch)

    return build


PROGRAM = register(
    RealProgram(
        name="resnet50-imagenet",
        model="ResNet-50 with batch norm (flax linen), SGD momentum, one device",
        source=SOURCE,
        libraries=("flax.linen", "optax"),
        build=_builder(),
        fixes={
            "donation": _builder(donate=True),
            "scan-residuals": _builder(remat=True),
        },
        tolerance=1e-4,
        notes=(
            "the pmapped step compiled for one device holding the batch of 128; data "
            "loading, eval and checkpoints left out; images abstract"
        ),
    )
)
