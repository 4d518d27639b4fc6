"""Single-device corpus programs: each mechanism written as users write it, and clean ones.

Every build function returns ``(fn, args)``. The programs are our own, drawn from the
public reports named in each `source`; none is a case's own program.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from ._entry import Built, program

S = jax.ShapeDtypeStruct
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32


def _mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


# --- gather-grad --------------------------------------------------------------------------


@program(
    "gather-grad",
    source="jax-ml/jax#30015 (gradient of a gather by a tuple of index columns)",
    shape="grad; a dict of three coordinate vectors indexing a volume",
)
def volume_lookup_grad() -> Built:
    def loss(vol: jax.Array, coords: dict[str, jax.Array]) -> jax.Array:
        picked = vol[coords["z"], coords["y"], coords["x"]]
        return jnp.mean(picked**2)

    n = 1 << 20
    coords = {k: S((n,), i32) for k in "xyz"}
    return jax.grad(loss), (S((64, 64, 64), f32), coords)


@program(
    "gather-grad",
    source="jax-ml/jax#891 (memory of the gradient of many gathers)",
    shape="grad of bilinear sampling of an image at float points, four corner gathers",
)
def bilinear_sample() -> Built:
    def sample(img: jax.Array, pts: jax.Array) -> jax.Array:
        y0 = jnp.floor(pts[:, 0]).astype(i32)
        x0 = jnp.floor(pts[:, 1]).astype(i32)
        fy, fx = pts[:, 0] - y0, pts[:, 1] - x0

        def at(dy: int, dx: int) -> jax.Array:
            return img[y0 + dy, x0 + dx]

        top = at(0, 0) * (1 - fx) + at(0, 1) * fx
        bottom = at(1, 0) * (1 - fx) + at(1, 1) * fx
        return jnp.sum((top * (1 - fy) + bottom * fy) ** 2)

    return jax.jit(jax.grad(sample)), (S((512, 512), f32), S((1 << 20, 2), f32))


@program(
    "gather-grad",
    source="jax-ml/jax#1979 (scatter-add of gathered values, indices far larger than data)",
    shape="scatter-add into a 2-D histogram from separate row and column vectors",
)
def histogram_2d() -> Built:
    def hist(rows: jax.Array, cols: jax.Array, weights: jax.Array) -> jax.Array:
        return jnp.zeros((256, 256), f32).at[rows, cols].add(weights)

    n = 1 << 21
    return hist, (S((n,), i32), S((n,), i32), S((n,), f32))


# --- pmap-loop (an unrolled Python loop) ----------------------------------------------------


@program(
    "pmap-loop",
    source="jax-ml/jax#1979 and the pmap-loop case's report (a Python loop over rows)",
    shape="a Python loop over a dict of feature groups, one Gram matrix each",
)
def gram_per_group() -> Built:
    def score(groups: dict[str, jax.Array]) -> jax.Array:
        total = jnp.zeros((), f32)
        for name in sorted(groups):
            g = groups[name]
            total = total + jnp.sum(jnp.exp(-(g @ g.T)))
        return total

    groups = {f"g{i}": S((512, 64), f32) for i in range(8)}
    return jax.jit(score), (groups,)


@program(
    "pmap-loop",
    source="jax-ml/jax#3865 (a batch processed piecewise in a Python loop)",
    shape="a nested helper called per chunk in a Python loop, results summed",
)
def chunked_python_loop() -> Built:
    def kernel(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.sum(jnp.tanh(a[:, None, :] * b[None, :, :]), axis=-1)

    def total(xs: jax.Array, ys: jax.Array) -> jax.Array:
        acc = jnp.zeros((), f32)
        for i in range(xs.shape[0]):
            acc += jnp.sum(jnp.cos(kernel(xs[i], ys[i])))
        return acc

    return total, (S((8, 128, 32), f32), S((8, 128, 32), f32))


@program(
    "pmap-loop",
    source="the pmap-loop case's report (an ensemble evaluated member by member)",
    shape="an ensemble of MLPs as a list of dicts, a Python loop over members",
)
def ensemble_loop() -> Built:
    def predict(members: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        outs = jnp.zeros((x.shape[0], 8), f32)
        for m in members:
            h = jax.nn.gelu(x @ m["w1"])
            outs = outs + jax.nn.softmax(h @ m["w2"])
        return outs / len(members)

    member = {"w1": S((128, 1024), f32), "w2": S((1024, 8), f32)}
    return jax.jit(predict), ([member] * 6, S((2048, 128), f32))


# --- scan-residuals -----------------------------------------------------------------------


@program(
    "scan-residuals",
    source="jax-ml/jax#27748 (remat around each block of scan steps, params in the carry)",
    shape="remat(scan) per block in a Python loop; params ride in the carry",
)
def remat_blocks_params_in_carry() -> Built:
    def step(
        carry: tuple[dict[str, jax.Array], jax.Array], x: jax.Array
    ) -> tuple[tuple[dict[str, jax.Array], jax.Array], None]:
        p, h = carry
        return (p, jnp.tanh(h @ p["w"] + x * p["u"])), None

    def loss(p: dict[str, jax.Array], h: jax.Array, xs: jax.Array) -> jax.Array:
        carry = (p, h)
        for block in jnp.split(xs, 4):
            carry = jax.remat(lambda c, blk=block: lax.scan(step, c, blk)[0])(carry)
        return jnp.sum(carry[1] ** 2)

    p = {"w": S((256, 256), f32), "u": S((256,), f32)}
    return jax.grad(loss), (p, S((128, 256), f32), S((512, 128, 256), f32))


@program(
    "scan-residuals",
    source="jax-ml/jax#3186 (grad of a loop that is cheap forward)",
    shape="fori_loop with a static trip count, an LSTM-like pytree carry, dict params",
)
def fori_lstm_grad() -> Built:
    def loss(p: dict[str, jax.Array], xs: jax.Array) -> jax.Array:
        def body(t: jax.Array, hc: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            h, c = hc
            gates = h @ p["wh"] + xs[t] @ p["wx"]
            i, f, g, o = jnp.split(gates, 4, axis=-1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            return jax.nn.sigmoid(o) * jnp.tanh(c), c

        h0 = jnp.zeros((xs.shape[1], p["wh"].shape[0]), f32)
        h, _ = lax.fori_loop(0, xs.shape[0], body, (h0, h0))
        return jnp.mean(h)

    p = {"wh": S((128, 512), f32), "wx": S((64, 512), f32)}
    return jax.grad(loss), (p, S((256, 64, 64), f32))


@program(
    "scan-residuals",
    source="apple/axlearn#1171 (checkpoint around the scan instead of its body)",
    shape="checkpoint in the wrong place: around the whole scan, not the step",
)
def checkpoint_outside_scan() -> Built:
    def rollout(w: jax.Array, x0: jax.Array, forces: jax.Array) -> jax.Array:
        def step(x: jax.Array, f: jax.Array) -> tuple[jax.Array, None]:
            v = jnp.sin(x @ w) + f
            return x + 0.01 * jnp.tanh(v) * jnp.cos(v), None

        return lax.scan(step, x0, forces)[0]

    def loss(w: jax.Array, x0: jax.Array, forces: jax.Array) -> jax.Array:
        return jnp.sum(jax.checkpoint(rollout)(w, x0, forces) ** 2)

    return jax.grad(loss), (S((128, 128), f32), S((256, 128), f32), S((512, 256, 128), f32))


# --- frozen-params ------------------------------------------------------------------------


def _backbone_loss(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    h = x
    for k in sorted(params["backbone"]):
        h = jnp.tanh(h @ params["backbone"][k])
    return jnp.mean((h @ params["head"]["w"]) ** 2)


def _backbone_params(layers: int = 4, width: int = 1024) -> dict[str, dict[str, S]]:
    return {
        "backbone": {f"l{i}": S((width, width), f32) for i in range(layers)},
        "head": {"w": S((width, 16), f32)},
    }


def _frozen_step(tx: optax.GradientTransformation) -> Built:
    params = _backbone_params()

    def step(
        params: dict[str, dict[str, jax.Array]], state: optax.OptState, x: jax.Array
    ) -> tuple[dict[str, dict[str, jax.Array]], optax.OptState]:
        grads = jax.grad(_backbone_loss)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = jax.eval_shape(tx.init, params)
    return jax.jit(step, donate_argnums=(0, 1)), (params, state, S((256, 1024), f32))


def _labels(params: dict[str, dict[str, S]]) -> dict[str, dict[str, str]]:
    return {
        k: dict.fromkeys(v, "frozen" if k == "backbone" else "train") for k, v in params.items()
    }


@program(
    "frozen-params",
    source="google-research/big_vision#14 (freezing with optax.scale(0.0) costs memory)",
    shape="backbone frozen by optax.multi_transform with scale(0.0), donated step",
)
def frozen_by_scale_zero() -> Built:
    labels = _labels(_backbone_params())
    tx = optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.scale(0.0)}, labels)
    return _frozen_step(tx)


@program(
    source="google-deepmind/optax#477 (multi_transform + set_to_zero; its gradients unused)",
    shape="backbone frozen by optax.multi_transform with set_to_zero, donated step",
)
def frozen_by_set_to_zero() -> Built:
    labels = _labels(_backbone_params())
    tx = optax.multi_transform({"train": optax.sgd(1e-2), "frozen": optax.set_to_zero()}, labels)
    return _frozen_step(tx)


@program(
    "frozen-params",
    source="google-deepmind/optax#290 (optax.masked to freeze part of a Flax model)",
    shape="backbone frozen by optax.masked(set_to_zero) in a chain with adam",
)
def frozen_by_mask() -> Built:
    params = _backbone_params()
    mask = {k: dict.fromkeys(v, k == "backbone") for k, v in params.items()}
    tx = optax.chain(optax.masked(optax.set_to_zero(), mask), optax.adam(1e-3))
    return _frozen_step(tx)


@program(
    "frozen-params",
    source="google-deepmind/optax#290 (is a masked-out gradient still computed?)",
    shape="hand-written SGD, backbone update multiplied by a zero learning rate",
)
def frozen_by_zero_lr() -> Built:
    params = _backbone_params()

    def step(
        params: dict[str, dict[str, jax.Array]], x: jax.Array
    ) -> dict[str, dict[str, jax.Array]]:
        grads = jax.grad(_backbone_loss)(params, x)
        lr = {"backbone": 0.0, "head": 1e-2}
        return {
            k: jax.tree.map(lambda p, g, k=k: p - lr[k] * g, params[k], grads[k]) for k in params
        }

    return jax.jit(step, donate_argnums=0), (params, S((256, 1024), f32))


@program(
    "frozen-params",
    source="jax-ml/jax#23316 (LoRA: most of the gradient pytree is zeros)",
    shape="stop_gradient on the backbone's weights, gradient of the whole dict returned",
)
def stop_gradient_backbone() -> Built:
    def loss(params: dict[str, dict[str, jax.Array]], x: jax.Array) -> jax.Array:
        frozen = {"backbone": jax.lax.stop_gradient(params["backbone"]), "head": params["head"]}
        return _backbone_loss(frozen, x)

    return jax.jit(jax.grad(loss)), (_backbone_params(), S((256, 1024), f32))


# --- vocab-logits -------------------------------------------------------------------------


@program(
    "vocab-logits",
    source="jax-ml/jax#35906 (the [N, V] logits dominate training memory)",
    shape="optax cross-entropy on a tied embedding, dict params, gradient",
)
def tied_embedding_ce() -> Built:
    def loss(p: dict[str, jax.Array], h: jax.Array, y: jax.Array) -> Any:
        logits = (h @ p["proj"]) @ p["embed"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    p = {"embed": S((32000, 256), f32), "proj": S((256, 256), f32)}
    return jax.grad(loss), (p, S((1024, 256), f32), S((1024,), i32))


@program(
    "vocab-logits",
    source="apple/axlearn#1236 (logits of every position of a batch of sequences)",
    shape="bf16 (batch, seq, vocab) logits, log_softmax and take_along_axis",
)
def seq_log_softmax_bf16() -> Built:
    def nll(w: jax.Array, h: jax.Array, y: jax.Array) -> jax.Array:
        logp = jax.nn.log_softmax(jnp.einsum("bsd,vd->bsv", h, w).astype(f32), axis=-1)
        return -jnp.take_along_axis(logp, y[..., None], axis=-1).mean()

    return jax.value_and_grad(nll), (
        S((16384, 512), bf16),
        S((4, 256, 512), bf16),
        S((4, 256), i32),
    )


@program(
    "vocab-logits",
    source="NVIDIA-NeMo/Automodel#3907 (full logits for every position, forward only)",
    shape="forward sampling distribution: temperature softmax over the vocabulary",
)
def sampling_probs() -> Built:
    def probs(w: jax.Array, h: jax.Array) -> jax.Array:
        return jnp.max(jax.nn.softmax((h @ w) / 0.7, axis=-1), axis=-1)

    return jax.jit(probs), (S((256, 50000), f32), S((512, 256), f32))


# --- vmap-materialize ---------------------------------------------------------------------


@program(
    "vmap-materialize",
    source="jax-ml/jax#11319 (a vmapped function needs the whole batch's intermediates)",
    shape="per-example gradients: vmap(grad) of an MLP with dict params",
)
def per_example_grads() -> Built:
    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        return jnp.sum(_mlp(p, x) ** 2)

    def norms(p: dict[str, jax.Array], xs: jax.Array) -> Any:
        g = jax.vmap(jax.grad(loss), in_axes=(None, 0))(p, xs)
        return sum(jnp.sum(v**2, axis=tuple(range(1, v.ndim))) for v in jax.tree.leaves(g))

    p = {"w1": S((256, 512), f32), "b1": S((512,), f32), "w2": S((512, 10), f32)}
    return jax.jit(norms), (p, S((128, 256), f32))


@program(
    "vmap-materialize",
    source="jax-ml/jax#23548 (vmap over points builds a huge broadcast difference)",
    shape="nested vmap of an RBF kernel between point sets, then reduced",
)
def nested_vmap_rbf() -> Built:
    def rbf(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.exp(-jnp.sum((a - b) ** 2))

    def kde(xs: jax.Array, ys: jax.Array) -> jax.Array:
        k = jax.vmap(lambda a: jax.vmap(lambda b: rbf(a, b))(ys))(xs)
        return jnp.log(k.mean(axis=1))

    return jax.jit(kde), (S((2048, 64), f32), S((2048, 64), f32))


@program(
    "vmap-materialize",
    source="jax-ml/jax#14808 (excessive allocation of a vmapped refinement)",
    shape="vmap over a batch of a function that builds an outer product per item",
)
def vmap_outer_trace() -> Built:
    def per_item(v: jax.Array) -> jax.Array:
        m = jnp.outer(v, v)
        return jnp.trace(jnp.tanh(m))

    return jax.jit(jax.vmap(per_item)), (S((64, 512), f32),)


# --- closure-constant ---------------------------------------------------------------------


@program(
    "closure-constant",
    source="jax-ml/jax#16278 (closing over a large array inside a jitted loop)",
    shape="a lambda closing over a concrete NumPy table, used in fori_loop",
)
def closure_in_fori() -> Built:
    table = np.random.default_rng(0).standard_normal((64, 256, 64), np.float32)

    def f(x: jax.Array) -> Any:
        def body(i: jax.Array, acc: jax.Array) -> Any:
            return acc + jnp.asarray(table)[i] @ x

        return lax.fori_loop(0, 64, body, jnp.zeros((256,), f32))

    return jax.jit(f), (S((64,), f32),)


@program(
    "closure-constant",
    source="jax-ml/jax#10596 (a large array captured by a jitted function)",
    shape="an object's method jitted with its weights as attributes (self.table)",
)
def method_captures_weights() -> Built:
    class Model:
        def __init__(self) -> None:
            rng = np.random.default_rng(1)
            self.table = jnp.asarray(rng.standard_normal((2048, 512), np.float32))

        @functools.partial(jax.jit, static_argnums=0)
        def __call__(self, x: jax.Array) -> jax.Array:
            return jax.nn.relu(x @ self.table.T)

    return Model(), (S((16, 512), f32),)


@program(
    "closure-constant",
    source="jax-ml/jax#11448 (arrays captured inside lax.cond become constants)",
    shape="a dict of concrete arrays captured by both branches of lax.cond",
)
def cond_captures_dict() -> Built:
    rng = np.random.default_rng(2)
    banks = {k: rng.standard_normal((1024, 256), np.float32) for k in ("a", "b")}

    def f(flag: jax.Array, x: jax.Array) -> Any:
        return lax.cond(flag, lambda v: v @ banks["a"], lambda v: v @ banks["b"], x)

    return jax.jit(f), (S((), jnp.bool_), S((8, 1024), f32))


# --- donation -----------------------------------------------------------------------------


@program(
    "donation",
    source="jax-ml/jax#1733 (a train step holds two copies of the weights)",
    shape="SGD with momentum by hand on dict params, jitted without donation",
)
def momentum_undonated() -> Built:
    def step(
        p: dict[str, jax.Array], m: dict[str, jax.Array], x: jax.Array
    ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
        g = jax.grad(lambda p: jnp.mean(_mlp(p, x) ** 2))(p)
        m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree.map(lambda p, m: p - 1e-3 * m, p, m), m

    p = {"w1": S((1024, 2048), f32), "b1": S((2048,), f32), "w2": S((2048, 1024), f32)}
    return jax.jit(step), (p, p, S((64, 1024), f32))


@program(
    "donation",
    source="jax-ml/jax#1273 (the peak doubles under jit without donate_argnums)",
    shape="an exponential moving average of a parameter pytree, no gradient at all",
)
def ema_update() -> Built:
    def ema(avg: list[jax.Array], new: list[jax.Array]) -> list[jax.Array]:
        return [0.999 * a + 0.001 * n for a, n in zip(avg, new, strict=True)]

    tree = [S((2048, 2048), f32), S((2048, 1024), f32)]
    return jax.jit(ema), (tree, tree)


@program(
    "donation",
    source="jax-ml/jax#9237 (donation that does not happen is easy to miss)",
    shape="a key-value cache updated at one position, returned, not donated",
)
def kv_cache_write() -> Built:
    def write(
        cache: dict[str, jax.Array], kv: dict[str, jax.Array], pos: jax.Array
    ) -> dict[str, jax.Array]:
        return {k: lax.dynamic_update_slice_in_dim(cache[k], kv[k], pos, 1) for k in cache}

    cache = {k: S((8, 4096, 512), bf16) for k in ("k", "v")}
    kv = {k: S((8, 1, 512), bf16) for k in ("k", "v")}
    return jax.jit(write), (cache, kv, S((), i32))


# --- prng-temporaries ---------------------------------------------------------------------


@program(
    "prng-temporaries",
    source="jax-ml/jax#17865 (bernoulli needs several times its output)",
    shape="dropout: a bernoulli mask over a large activation",
)
def dropout_mask() -> Built:
    def drop(key: jax.Array, x: jax.Array) -> jax.Array:
        keep = jax.random.bernoulli(key, 0.9, x.shape)
        return jnp.where(keep, x / 0.9, 0.0)

    return jax.jit(drop), (S((2,), jnp.uint32), S((4096, 4096), f32))


@program(
    "prng-temporaries",
    source="jax-ml/jax#19893 (initialising large parameters runs out of memory)",
    shape="initialise a dict of layers with jax.random.normal from split keys",
)
def init_params() -> Built:
    def init(key: jax.Array) -> dict[str, jax.Array]:
        keys = jax.random.split(key, 3)
        shapes = {"a": (2048, 2048), "b": (2048, 1024), "c": (1024, 2048)}
        return {
            n: 0.02 * jax.random.normal(k, s, f32)
            for (n, s), k in zip(shapes.items(), keys, strict=True)
        }

    return jax.jit(init), (S((2,), jnp.uint32),)


@program(
    "prng-temporaries",
    source="jax-ml/jax#21045 (uniform of a large array on a TPU needs more than its size)",
    shape="Monte Carlo estimate from a large uniform sample, reduced at once",
)
def monte_carlo_pi() -> Built:
    def estimate(key: jax.Array) -> jax.Array:
        u = jax.random.uniform(key, (1 << 23, 2))
        return 4 * jnp.mean(jnp.sum(u**2, axis=1) < 1)

    return jax.jit(estimate), (S((2,), jnp.uint32),)


# --- inplace-copy -------------------------------------------------------------------------


@program(
    "inplace-copy",
    source="jax-ml/jax#9132 (an .at[].set() runs out of place, silently)",
    shape="a donated state dict: one row replaced, then the old row compared",
)
def update_then_compare() -> Built:
    def step(state: dict[str, jax.Array], row: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
        new = state["table"].at[7].set(row)
        drift = jnp.sum(jnp.abs(new - state["table"]))
        return {"table": new}, drift

    return jax.jit(step, donate_argnums=0), ({"table": S((8192, 1024), f32)}, S((1024,), f32))


@program(
    "inplace-copy",
    source="jax-ml/jax#1034 (a buffer updated one row at a time in a loop)",
    shape="a computed buffer, scatter-updated, while the original is still returned",
)
def keep_before_and_after() -> Built:
    def f(x: jax.Array, idx: jax.Array, vals: jax.Array) -> tuple[jax.Array, jax.Array]:
        base = jnp.sin(x) * 2.0
        patched = base.at[idx].add(vals)
        return patched, base.mean(axis=0)

    return jax.jit(f), (S((4096, 1024), f32), S((64,), i32), S((64, 1024), f32))


@program(
    "inplace-copy",
    source="jax-ml/jax#40101 (a small update inside a loop rewrites the whole buffer)",
    shape="fori_loop writing one row per step, then reading the old buffer against the new",
)
def loop_update_reads_old() -> Built:
    def fill(buf: jax.Array, xs: jax.Array) -> Any:
        def body(i: jax.Array, carry: tuple[jax.Array, jax.Array]) -> Any:
            b, change = carry
            nb = b.at[i].set(xs[i])
            return nb, change + jnp.sum(jnp.abs(nb - b))

        return lax.fori_loop(0, xs.shape[0], body, (buf, jnp.zeros((), f32)))

    return jax.jit(fill, donate_argnums=0), (S((4096, 1024), f32), S((16, 1024), f32))


# --- attention-scores ---------------------------------------------------------------------


def _heads(x: jax.Array, w: jax.Array, h: int) -> jax.Array:
    b, t, _ = x.shape
    return (x @ w).reshape(b, t, h, -1)


@program(
    "attention-scores",
    source="google/flax#2858 (attention's T x T weights saved for the backward pass)",
    shape="multi-head self-attention with a dict of projections, gradient",
)
def mha_grad() -> Built:
    def loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        q, k, v = (_heads(x, p[n], 8) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return jnp.mean(o**2)

    p = {n: S((256, 256), f32) for n in "qkv"}
    return jax.grad(loss), (p, S((2, 1024, 256), f32))


@program(
    "attention-scores",
    source="jax-ml/jax#20145 (T x T logits and probabilities materialised)",
    shape="causal attention, forward, bf16, mask applied with jnp.where",
)
def causal_attention_bf16() -> Built:
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        t = q.shape[1]
        s = jnp.einsum("btd,bsd->bts", q, k).astype(f32)
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
        return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1).astype(bf16), v)

    x = S((8, 2048, 64), bf16)
    return jax.jit(attend), (x, x, x)


@program(
    "attention-scores",
    source="pytorch/pytorch#72450 (attention with bias tensors, memory of the backward)",
    shape="attention with an additive pair bias, value_and_grad over queries and bias",
)
def biased_attention_grad() -> Built:
    def loss(q: jax.Array, k: jax.Array, bias: jax.Array) -> jax.Array:
        s = q @ jnp.swapaxes(k, -1, -2) + bias
        return jnp.sum(jax.nn.softmax(s, axis=-1) @ k)

    return jax.value_and_grad(loss, argnums=(0, 2)), (
        S((4, 768, 32), f32),
        S((4, 768, 32), f32),
        S((768, 768), f32),
    )


# --- several mechanisms at once -----------------------------------------------------------


@program(
    "donation",
    "vocab-logits",
    source="jax-ml/jax#1733 with jax-ml/jax#35906 (an LM head trained without donation)",
    shape="undonated SGD step on an output projection with a large vocabulary",
)
def lm_head_step_undonated() -> Built:
    def step(w: jax.Array, h: jax.Array, y: jax.Array) -> Any:
        g = jax.grad(lambda w: optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean())(w)
        return w - 0.1 * g

    return jax.jit(step), (S((256, 32000), f32), S((512, 256), f32), S((512,), i32))


@program(
    "scan-residuals",
    "prng-temporaries",
    source="jax-ml/jax#3186 with jax-ml/jax#17865 (dropout inside a scanned recurrence)",
    shape="grad of a scanned recurrence over inputs dropped out as a whole sequence",
)
def scan_with_dropout() -> Built:
    def loss(w: jax.Array, h0: jax.Array, xs: jax.Array, key: jax.Array) -> jax.Array:
        xs = xs * jax.random.uniform(key, xs.shape)

        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(h @ w + x), None

        return jnp.sum(lax.scan(step, h0, xs)[0])

    args = (S((256, 256), f32), S((256, 256), f32), S((256, 256, 256), f32), S((2,), jnp.uint32))
    return jax.grad(loss), args


# --- clean programs: memory-heavy for good reasons ----------------------------------------


@program(source="a user's inference pipeline", shape="a chain of large matrix products")
def matmul_chain() -> Built:
    def chain(a: jax.Array, bs: list[jax.Array]) -> jax.Array:
        for b in bs:
            a = jnp.tanh(a @ b)
        return a

    return jax.jit(chain), (S((2048, 2048), f32), [S((2048, 2048), f32)] * 4)


@program(
    source="jax-ml/jax#3186's advice (checkpoint the step)",
    shape="a short scan with its step checkpointed",
)
def checkpointed_scan() -> Built:
    def loss(w: jax.Array, h0: jax.Array, xs: jax.Array) -> jax.Array:
        step = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x), None))
        return jnp.sum(lax.scan(step, h0, xs)[0])

    return jax.grad(loss), (S((512, 512), f32), S((256, 512), f32), S((64, 256, 512), f32))


@program(
    source="jax-ml/jax#1733's fix (donate the state)",
    shape="an AdamW MLP train step with parameters and optimizer state donated",
)
def donated_adamw_step() -> Built:
    tx = optax.adamw(1e-3)

    def step(
        p: dict[str, jax.Array], s: optax.OptState, x: jax.Array
    ) -> tuple[dict[str, jax.Array], optax.OptState]:
        g = jax.grad(lambda p: jnp.mean(_mlp(p, x) ** 2))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    p = {"w1": S((1024, 4096), f32), "b1": S((4096,), f32), "w2": S((4096, 1024), f32)}
    return jax.jit(step, donate_argnums=(0, 1)), (
        p,
        jax.eval_shape(tx.init, p),
        S((512, 1024), f32),
    )


@program(
    source="jax-ml/jax#20145 (flash attention: scores one block at a time)",
    shape="blockwise attention with an online softmax over key blocks (scan)",
)
def flash_style_attention() -> Built:
    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        kb, vb = k.reshape(-1, 128, k.shape[-1]), v.reshape(-1, 128, v.shape[-1])

        def block(
            carry: tuple[jax.Array, jax.Array, jax.Array], kv: tuple[jax.Array, jax.Array]
        ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
            m, l, acc = carry
            s = q @ kv[0].T
            m2 = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m2[:, None])
            scale = jnp.exp(m - m2)
            return (m2, l * scale + p.sum(-1), acc * scale[:, None] + p @ kv[1]), None

        t, d = q.shape
        init = (jnp.full((t,), -jnp.inf), jnp.zeros((t,)), jnp.zeros((t, d)))
        _, l, acc = lax.scan(block, init, (kb, vb))[0]
        return acc / l[:, None]

    x = S((4096, 64), f32)
    return jax.jit(attend), (x, x, x)


@program(
    source="jax-ml/jax#35906's fix (cross-entropy one chunk of tokens at a time)",
    shape="chunked cross-entropy with lax.map over token chunks",
)
def chunked_cross_entropy() -> Built:
    def loss(w: jax.Array, h: jax.Array, y: jax.Array) -> Any:
        def chunk(args: tuple[jax.Array, jax.Array]) -> Any:
            hc, yc = args
            return optax.softmax_cross_entropy_with_integer_labels(hc @ w, yc).sum()

        return lax.map(chunk, (h.reshape(16, -1, h.shape[-1]), y.reshape(16, -1))).sum()

    return jax.jit(loss), (S((256, 32000), f32), S((2048, 256), f32), S((2048,), i32))


@program(
    source="jax-ml/jax#11319's advice (lax.map with batch_size instead of vmap)",
    shape="per-example work mapped in batches rather than vmapped at once",
)
def batched_map() -> Built:
    def per_item(v: jax.Array) -> jax.Array:
        return jnp.trace(jnp.tanh(jnp.outer(v, v)))

    return jax.jit(lambda xs: lax.map(per_item, xs, batch_size=4)), (S((64, 512), f32),)


@program(source="a user's image model", shape="a convolutional network's forward pass")
def conv_forward() -> Built:
    def net(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        for w in ws:
            x = jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), "SAME"))
        return x.mean()

    ws = [S((64, 3, 3, 3), f32), S((64, 64, 3, 3), f32), S((64, 64, 3, 3), f32)]
    return jax.jit(net), (ws, S((16, 3, 128, 128), f32))


@program(
    source="the inplace-copy case's fix (read the old value before writing)",
    shape="a donated ring buffer written one slot per fori_loop step",
)
def donated_ring_buffer() -> Built:
    def fill(buf: jax.Array, xs: jax.Array, start: jax.Array) -> Any:
        def body(i: jax.Array, b: jax.Array) -> Any:
            slot = (start + i) % b.shape[0]
            return lax.dynamic_update_slice_in_dim(b, jnp.tanh(xs[i])[None], slot, 0)

        return lax.fori_loop(0, xs.shape[0], body, buf)

    return jax.jit(fill, donate_argnums=0), (S((4096, 1024), f32), S((16, 1024), f32), S((), i32))


@program(
    source="jax-ml/jax#23457 (an embedding lookup, one index per token)",
    shape="an embedding lookup by one int32 index vector, then a projection",
)
def embedding_forward() -> Built:
    def embed(table: jax.Array, ids: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.take(table, ids, axis=0) @ w

    return jax.jit(embed), (S((50000, 512), f32), S((4096,), i32), S((512, 512), f32))


@program(
    source="google/flax#2858 (attention at a short sequence length)",
    shape="a transformer block's forward at 128 tokens, weights in a dict",
)
def short_transformer_block() -> Built:
    def block(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        q, k, v = (_heads(x, p[n], 8) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(x.shape)
        return x + jax.nn.gelu(o @ p["up"]) @ p["down"]

    p = {**{n: S((512, 512), f32) for n in "qkv"}, "up": S((512, 2048), f32),
         "down": S((2048, 512), f32)}  # fmt: skip
    return jax.jit(block), (p, S((32, 128, 512), f32))
