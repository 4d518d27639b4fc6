"""Multi-device corpus programs: evaluated in a child process with forced host devices."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ._entry import Built, program

DEVICES = 8
S = jax.ShapeDtypeStruct
f32 = jnp.float32


def _mesh(shape: tuple[int, ...] = (DEVICES,), axes: tuple[str, ...] = ("data",)) -> Mesh:
    return Mesh(np.array(jax.devices()[:DEVICES]).reshape(shape), axes)


def _placed(tree: Any, mesh: Mesh, spec: Any) -> Any:
    """`tree`'s leaves as abstract arrays with sharding `spec(leaf)` (a PartitionSpec)."""
    return jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=NamedSharding(mesh, spec(s))), tree)


def _rows(leaf: Any) -> Any:
    """Split a matrix's rows over ``data``; vectors and scalars whole."""
    return P("data", None) if len(leaf.shape) == 2 else P()


def _loss(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = x
    for name in sorted(params):
        h = jnp.tanh(h @ params[name])
    return jnp.mean(h**2)


def _layers(count: int, width: int) -> dict[str, Any]:
    return {f"layer{i}": S((width, width), f32) for i in range(count)}


def _adam_step(tx: optax.GradientTransformation) -> Any:
    def step(params: dict[str, jax.Array], state: Any, x: jax.Array) -> tuple[Any, Any]:
        grads = jax.grad(_loss)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


@program(
    "sharding-replicated",
    source="jax-ml/jax#19893 (state whole on every device of a data-parallel job)",
    shape="Adam on dict params left replicated (P()) while the batch is split",
    devices=DEVICES,
)
def replicated_adam() -> Built:
    mesh, tx = _mesh(), optax.adam(1e-3)
    params = _layers(4, 1024)
    state = jax.eval_shape(tx.init, params)
    x = S((256, 1024), f32, sharding=NamedSharding(mesh, P("data")))
    whole = lambda leaf: P()
    args = (_placed(params, mesh, whole), _placed(state, mesh, whole), x)
    return jax.jit(_adam_step(tx), donate_argnums=(0, 1)), args


@program(
    "sharding-replicated",
    source="jax-ml/jax#14075 (parameters replicated over a 2-D mesh)",
    shape="SGD with momentum written by hand, state replicated over a 2 x 4 mesh",
    devices=DEVICES,
)
def replicated_momentum_2d() -> Built:
    mesh = _mesh((2, 4), ("data", "model"))
    params = _layers(3, 1024)

    def step(p: dict[str, jax.Array], m: dict[str, jax.Array], x: jax.Array) -> tuple[Any, Any]:
        g = jax.grad(_loss)(p, x)
        m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree.map(lambda p, m: p - 1e-2 * m, p, m), m

    whole = lambda leaf: P()
    x = S((256, 1024), f32, sharding=NamedSharding(mesh, P("data")))
    args = (_placed(params, mesh, whole), _placed(params, mesh, whole), x)
    return jax.jit(step, donate_argnums=(0, 1)), args


@program(
    "sharding-replicated",
    source="jax-ml/jax#26946 (FSDP whose gathered weights all live at once)",
    shape="row-split layers gathered whole for a Python loop over layers, then used",
    devices=DEVICES,
)
def gathered_layers_loop() -> Built:
    mesh = _mesh()
    params = _layers(8, 1024)
    whole = NamedSharding(mesh, P())

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        full = {k: jax.lax.with_sharding_constraint(w, whole) for k, w in p.items()}
        return _loss(full, x)

    def step(p: dict[str, jax.Array], x: jax.Array) -> Any:
        g = jax.grad(loss)(p, x)
        return jax.tree.map(lambda p, g: p - 1e-2 * g, p, g)

    x = S((64, 1024), f32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(step, donate_argnums=0), (_placed(params, mesh, _rows), x)


@program(
    "sharding-replicated",
    source="jax-ml/jax#16679 (the state split, yet memory as if replicated)",
    shape="FSDP half done: Adam state row-split, a Python loop over layers gathers them all",
    devices=DEVICES,
)
def fsdp_python_loop_adam() -> Built:
    mesh, tx = _mesh(), optax.adam(1e-3)
    params = _layers(4, 1024)
    state = jax.eval_shape(tx.init, params)
    x = S((256, 1024), f32, sharding=NamedSharding(mesh, P("data")))
    args = (_placed(params, mesh, _rows), _placed(state, mesh, _rows), x)
    return jax.jit(_adam_step(tx), donate_argnums=(0, 1)), args


@program(
    source="the sharding-replicated case's fix (a scan over stacked, split layers)",
    shape="stacked layers split over the devices, scanned with a checkpointed layer",
    devices=DEVICES,
)
def fsdp_scanned_layers() -> Built:
    mesh = _mesh()

    def loss(stacked: jax.Array, x: jax.Array) -> jax.Array:
        layer = jax.checkpoint(lambda h, w: (jnp.tanh(h @ w), None))
        return jnp.mean(jax.lax.scan(layer, x, stacked)[0] ** 2)

    def step(stacked: jax.Array, x: jax.Array) -> Any:
        return stacked - 1e-2 * jax.grad(loss)(stacked, x)

    stacked = S((8, 1024, 1024), f32, sharding=NamedSharding(mesh, P(None, "data", None)))
    x = S((64, 1024), f32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(step, donate_argnums=0), (stacked, x)


@program(
    source="jax-ml/jax#14075 (model-parallel layers: each device keeps its slice)",
    shape="a tensor-parallel MLP step: columns then rows split over the devices",
    devices=DEVICES,
)
def tensor_parallel_mlp() -> Built:
    mesh = _mesh()

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return jnp.mean((jax.nn.gelu(x @ p["up"]) @ p["down"]) ** 2)

    def step(p: dict[str, jax.Array], x: jax.Array) -> Any:
        return jax.tree.map(lambda p, g: p - 1e-2 * g, p, jax.grad(loss)(p, x))

    split = {"up": P(None, "data"), "down": P("data", None)}
    params = {k: S((1024, 4096) if k == "up" else (4096, 1024), f32,
                   sharding=NamedSharding(mesh, spec)) for k, spec in split.items()}  # fmt: skip
    x = S((512, 1024), f32, sharding=NamedSharding(mesh, P()))
    return jax.jit(step, donate_argnums=0), (params, x)


# --- resharding: values the partitioner computes whole on every device -------------------


def _lm(vocab: int) -> dict[str, Any]:
    return {"embed": S((vocab, 512), f32), "l0": S((512, 512), f32), "l1": S((512, 512), f32)}


def _lm_loss(p: dict[str, jax.Array], tokens: jax.Array) -> jax.Array:
    """A tied-embedding LM of two GELU layers: next-token cross-entropy."""
    h = p["embed"][tokens[:, :-1]]
    for k in ("l0", "l1"):
        h = h + jax.nn.gelu(h @ p[k])
    logp = jax.nn.log_softmax(h @ p["embed"].T)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _columns(leaf: Any) -> Any:
    """Split a matrix's columns (an embedding's model dimension) over ``data``."""
    return P(None, "data")


@program(
    "resharding",
    "vocab-logits",
    source="the issue commissioning the resharding case (nanodo's FSDP step, jax 0.10.2)",
    shape="an LM step with SGD: tokens split over 'data', every weight's model dimension "
    "split over 'data' too, nothing pinning the activations",
    devices=DEVICES,
)
def fsdp_lm_unpinned() -> Built:
    mesh = _mesh()

    def step(p: dict[str, jax.Array], tokens: jax.Array) -> Any:
        return jax.tree.map(lambda w, g: w - 1e-2 * g, p, jax.grad(_lm_loss)(p, tokens))

    tokens = S((64, 257), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(step, donate_argnums=0), (_placed(_lm(2048), mesh, _columns), tokens)


@program(
    "resharding",
    source="jax-ml/jax#16679 (an FSDP model evaluated with its batch split)",
    shape="the same LM with a small vocabulary, its loss alone: an evaluation step",
    devices=DEVICES,
)
def fsdp_lm_eval_unpinned() -> Built:
    mesh = _mesh()
    tokens = S((64, 257), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(_lm_loss), (_placed(_lm(256), mesh, _columns), tokens)


@program(
    "resharding",
    source="nanodo (its batch arrives whole, before the step constrains it)",
    shape="an MLP step whose batch is passed whole (P()) to layers split by rows over 'data'",
    devices=DEVICES,
)
def fsdp_mlp_whole_batch() -> Built:
    mesh = _mesh()

    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return jnp.mean((jax.nn.gelu(x @ p["up"]) @ p["down"]) ** 2)

    def step(p: dict[str, jax.Array], x: jax.Array) -> Any:
        return jax.tree.map(lambda w, g: w - 1e-2 * g, p, jax.grad(loss)(p, x))

    shapes = {"up": S((1024, 4096), f32), "down": S((4096, 1024), f32)}
    x = S((2048, 1024), f32, sharding=NamedSharding(mesh, P()))
    return jax.jit(step, donate_argnums=0), (_placed(shapes, mesh, _rows), x)
