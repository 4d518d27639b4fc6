"""Flax's ImageNet example: ResNet-50 trained data-parallel with `jax.pmap` on 8 devices.

The classic pmap loop: the train state (parameters, batch-norm statistics, SGD momentum) is
replicated with a leading device axis, each device gets its slice of the batch, computes
the loss (softmax cross-entropy plus an L2 penalty of 1e-4 on the kernels) and its
gradient, and `lax.pmean` over the axis ``"batch"`` averages the gradients and the metrics
before every device applies the same update (`optax.sgd`, Nesterov momentum 0.9, a 5-epoch
linear warmup into a cosine). The model is the example's flax.linen ResNet-50 (bottleneck
blocks, `nn.BatchNorm` with momentum 0.9 and per-device statistics, float32).

Authors' scale (examples/imagenet/configs/v100_x8.py, "8 x Nvidia V100"): global batch
512, 64 images of 224x224 per device, 1000 classes, float32 (``half_precision=False``).
Kept: the model, the loss, the optimizer and the ``jax.pmap(..., axis_name="batch")`` call,
which donates nothing. Changed: the input pipeline, checkpoints and evaluation are left
out; the batch is an abstract input with the device axis in front.

The fixes:

- donation: the same pmap with ``donate_argnums=(0,)``: the old state's buffers hold the
  new state.
- pmap-loop: the runbook's recommended way off pmap, `jax.jit` of `jax.shard_map` over a
  mesh of the same 8 devices, the state and batch in the same stacked layout (there is no
  Python loop inside this step; the producer keeps the fix only if it measures a saving).
- scan-residuals: `nn.remat` of each bottleneck block, as in resnet50-imagenet (its
  activations recomputed in the backward pass instead of kept for all 16 blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from runbook import _case_types

from ._program import Builder, Built, RealProgram, register

DEVICES = 8
SOURCE = (
    "https://github.com/google/flax/blob/"
    "594b4529fa84bbbba5d5031d12968d355d03850f/examples/imagenet/train.py"
)
STEPS_PER_EPOCH = 1_281_167 // 512
SCALES: dict[str, dict[str, Any]] = {
    "authors": {"stages": (3, 4, 6, 3), "filters": 64, "image": 224, "classes": 1000,
                "per_device": 64},
    "tiny": {"stages": (1, 1), "filters": 8, "image": 32, "classes": 10, "per_device": 2},
}  # fmt: skip


class BottleneckResNetBlock(nn.Module):
    filters: int
    conv: Any
    norm: Any
    strides: tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        residual = x
        y = nn.relu(self.norm()(self.conv(self.filters, (1, 1))(x)))
        y = nn.relu(self.norm()(self.conv(self.filters, (3, 3), self.strides)(y)))
        y = self.norm(scale_init=nn.initializers.zeros_init())(
            self.conv(self.filters * 4, (1, 1))(y)
        )
        if residual.shape != y.shape:
            residual = self.conv(self.filters * 4, (1, 1), self.strides, name="conv_proj")(x)
            residual = self.norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


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
        x = nn.Dense(self.num_classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))
        return jnp.asarray(x, self.dtype)


class TrainState(train_state.TrainState):  # type: ignore[no-untyped-call]
    batch_stats: Any


def _learning_rate_fn(base: float = 0.1 * 512 / 256, warmup: int = 5) -> optax.Schedule:
    warm = optax.linear_schedule(0.0, base, warmup * STEPS_PER_EPOCH)
    cosine = optax.cosine_decay_schedule(base, (100 - warmup) * STEPS_PER_EPOCH)
    return optax.join_schedules([warm, cosine], [warmup * STEPS_PER_EPOCH])


def _train_step(
    state: TrainState, batch: dict[str, jax.Array], learning_rate_fn: optax.Schedule,
    classes: int,
) -> tuple[TrainState, dict[str, jax.Array]]:  # fmt: skip
    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],
            mutable=["batch_stats"],
        )
        one_hot = jax.nn.one_hot(batch["label"], classes)
        loss = jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot))
        weight_l2 = sum(jnp.sum(x**2) for x in jax.tree.leaves(params) if x.ndim > 1)
        return loss + 0.0001 * 0.5 * weight_l2, (new_model_state, logits)

    (loss, (new_model_state, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params
    )
    grads = lax.pmean(grads, axis_name="batch")
    metrics = {
        "loss": loss,
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
    }
    metrics = lax.pmean(metrics, axis_name="batch")
    metrics["learning_rate"] = learning_rate_fn(state.step)
    new_state: TrainState = state.apply_gradients(  # type: ignore[no-untyped-call]
        grads=grads, batch_stats=new_model_state["batch_stats"]
    )
    return new_state, metrics


def _shard_mapped(step: Callable[..., Any], mesh: Mesh) -> Any:
    """The same per-device step under `jax.jit` + `jax.shard_map`, layout unchanged: every
    input and output keeps its leading device axis, split over the mesh axis "batch"."""

    def per_device(state: Any, batch: Any) -> Any:
        squeeze = functools.partial(jax.tree.map, lambda x: x[0])
        out = step(squeeze(state), squeeze(batch))
        return jax.tree.map(lambda x: x[None], out)

    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("batch"), out_specs=P("batch")))


def _builder(donate: bool = False, shard_map: bool = False, remat: bool = False) -> Builder:
    def build(scale: str, concrete: bool) -> Built:
        s = SCALES[scale]
        devices = _case_types.devices(DEVICES)
        model = ResNet(s["stages"], s["classes"], s["filters"], remat=remat)
        tx = optax.sgd(_learning_rate_fn(), momentum=0.9, nesterov=True)
        image = jax.ShapeDtypeStruct((1, s["image"], s["image"], 3), jnp.float32)

        def create(key: jax.Array, x: jax.Array) -> TrainState:
            variables = model.init({"params": key}, x)
            return TrainState.create(  # type: ignore[no-any-return, no-untyped-call]
                apply_fn=model.apply, params=variables["params"], tx=tx,
                batch_stats=variables["batch_stats"],
            )  # fmt: skip

        step = functools.partial(_train_step, learning_rate_fn=_learning_rate_fn(),
                                 classes=s["classes"])  # fmt: skip
        if shard_map:
            mesh = Mesh(np.array(devices), ("batch",))
            fn = _shard_mapped(step, mesh)
            # Its abstract inputs are split over its mesh, as a user's would be: on a
            # target's devices, an input with no sharding would sit on one device alone.
            split = {"sharding": NamedSharding(mesh, P("batch"))}
        else:
            fn = jax.pmap(step, axis_name="batch", devices=devices,
                          donate_argnums=(0,) if donate else ())  # fmt: skip
            split = {}  # a pmap places its inputs itself
        n, b = DEVICES, s["per_device"]
        batch_shape = {"image": (n, b, s["image"], s["image"], 3), "label": (n, b)}
        if not concrete:
            shape = jax.eval_shape(create, jax.random.key(0), image)
            state = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype, **split), shape
            )
            abstract = {
                "image": jax.ShapeDtypeStruct(batch_shape["image"], jnp.float32, **split),
                "label": jax.ShapeDtypeStruct(batch_shape["label"], jnp.int32, **split),
            }
            return fn, (state, abstract)
        k_init, k_image, k_label = jax.random.split(jax.random.key(0), 3)
        one = create(k_init, jnp.ones(image.shape, image.dtype))
        state = jax.tree.map(lambda x: jnp.stack([jnp.asarray(x)] * n), one)
        batch = {
            "image": jax.random.normal(k_image, batch_shape["image"]),
            "label": jax.random.randint(k_label, batch_shape["label"], 0, s["classes"]),
        }
        return fn, (state, batch)

    return build


PROGRAM = register(
    RealProgram(
        name="flax-imagenet-pmap",
        model="flax examples/imagenet ResNet-50, jax.pmap data parallel on 8 devices, SGD",
        source=SOURCE,
        libraries=("flax.linen", "optax", "jax.pmap"),
        build=_builder(),
        fixes={
            "donation": _builder(donate=True),
            "pmap-loop": _builder(shard_map=True),
            "scan-residuals": _builder(remat=True),
        },
        devices=DEVICES,
        tolerance=1e-4,
        notes="input pipeline, checkpoints and evaluation left out; batch abstract",
    )
)
