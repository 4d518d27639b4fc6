"""`attention-scores`: attention materialises the (T x T) score matrix, and its gradient keeps it.

``softmax(q k^T) v`` over T tokens makes a ``T x T`` score matrix per head, and its gradient
keeps the probabilities (or their gradients) alive at full size: memory quadratic in T.
Reports: jax-ml/jax PR #20145, google/flax#2858, diffusers / big_vision reports. Below: the
reproduction and its fixes, for ``(batch, tokens, heads, head_dim)`` inputs (the layout of
`jax.nn.dot_product_attention`); all causal, the fixes ``causal=False`` on request."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._case_types import Case
from ._setup import attention_scores as _setup

BLOCK = 128  # tokens per block of `attention_blockwise` (queries and keys alike)
CHUNK = 512  # queries per chunk of `attention_chunked`


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The reproduction: JAX's own attention, XLA's implementation (the default off GPU)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def attention_cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """The GPU fix: cuDNN's fused (flash) attention; compiles for NVIDIA GPUs only."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def attention_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    chunk: int = CHUNK,
    scale: float | None = None,
    causal: bool = True,
) -> jax.Array:
    """Queries in chunks, each under `jax.checkpoint` (Rabe & Staats, arXiv 2112.05682):
    `jax.lax.map` runs the chunks one after another, each making ``chunk x T`` scores that
    the gradient computes again instead of keeping. The tokens must divide into chunks;
    `scale` defaults to ``1 / sqrt(head_dim)``; `causal` (static) False: every key is seen.
    """
    b, t, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    cols = jnp.arange(t)

    def rows(start: jax.Array) -> jax.Array:
        qc = lax.dynamic_slice_in_dim(q, start, chunk, axis=1)
        s = jnp.einsum("bqhd,bkhd->bhqk", qc, k, preferred_element_type=jnp.float32)
        if causal:  # a Python bool: the unmasked program has no mask in it at all
            seen = cols[None, :] <= (start + jnp.arange(chunk))[:, None]
            s = jnp.where(seen, s * scale, -jnp.inf)
        else:
            s = s * scale
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)

    out = lax.map(jax.checkpoint(rows), jnp.arange(0, t, chunk))  # (t // chunk, b, chunk, h, d)
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, d)


def _block(x: jax.Array, i: jax.Array, head: jax.Array, size: int) -> jax.Array:
    """Block `i` (of `size` tokens) of one head of `x` ``(b, t, h, d)``: ``(b, size, d)``.
    One head's rows are contiguous: no transposed heads-major copy of `x` is made."""
    b, _, _, d = x.shape
    return lax.dynamic_slice(x, (0, i * size, head, 0), (b, size, 1, d))[:, :, 0]


def _put(x: jax.Array, block: jax.Array, i: jax.Array, head: jax.Array, size: int) -> jax.Array:
    """`x` with block `i` of one head replaced by `block` ``(b, size, d)``, in place."""
    return lax.dynamic_update_slice(x, block[:, :, None].astype(x.dtype), (0, i * size, head, 0))


def _row(x: jax.Array, i: jax.Array, head: jax.Array, size: int) -> jax.Array:
    """Block `i` of one head of a per-row statistic ``(b, h, t)``: ``(b, size)``."""
    return lax.dynamic_slice(x, (0, head, i * size), (x.shape[0], 1, size))[:, 0]


def _put_row(x: jax.Array, row: jax.Array, i: jax.Array, head: jax.Array, size: int) -> jax.Array:
    return lax.dynamic_update_slice(x, row[:, None].astype(x.dtype), (0, head, i * size))


def _scores(
    qi: jax.Array, kj: jax.Array, i: jax.Array, j: jax.Array, scale: float, causal: bool
) -> jax.Array:
    """Block (i, j) of one head's scaled float32 scores ``(b, size, size)``, masked if causal."""
    s = jnp.einsum("bqd,bkd->bqk", qi, kj, preferred_element_type=jnp.float32)
    if not causal:
        return s * scale
    size = qi.shape[1]
    rows, cols = i * size + jnp.arange(size), j * size + jnp.arange(size)
    return jnp.where(cols[None, :] <= rows[:, None], s * scale, -jnp.inf)


def _forward(
    q: jax.Array, k: jax.Array, v: jax.Array, size: int, scale: float | None, causal: bool
) -> tuple[jax.Array, jax.Array]:
    """The output and each row's log-sum-exp ``(b, h, t)``: per head and query block, an
    online softmax over the key blocks it sees, written in place."""
    b, t, h, d = q.shape
    n = t // size
    scale = d**-0.5 if scale is None else scale

    def rows(at: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        out, lse = carry
        head, i = at // n, at % n
        qi = _block(q, i, head, size)

        def step(j: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            m, total, pv = acc
            s = _scores(qi, _block(k, j, head, size), i, j, scale, causal)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            fade = jnp.exp(m - m_new)
            pv_j = jnp.einsum("bqk,bkd->bqd", p.astype(v.dtype), _block(v, j, head, size),
                              preferred_element_type=jnp.float32)  # fmt: skip
            return m_new, total * fade + p.sum(-1), pv * fade[..., None] + pv_j

        init = (jnp.full((b, size), -jnp.inf), jnp.zeros((b, size)), jnp.zeros((b, size, d)))
        # Causal: the key blocks after block i are masked whole, so the loop stops at i.
        m, total, pv = lax.fori_loop(0, i + 1 if causal else n, step, init)
        out = _put(out, pv / total[..., None], i, head, size)
        return out, _put_row(lse, m + jnp.log(total), i, head, size)

    init = (jnp.zeros_like(q), jnp.zeros((b, h, t), jnp.float32))
    out, lse = lax.fori_loop(0, h * n, rows, init)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def attention_blockwise(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block: int = BLOCK,
    scale: float | None = None,
    causal: bool = True,
) -> jax.Array:
    """The fix for every target: blocks of queries and keys, with its own gradient.

    The forward pass keeps each row's log-sum-exp, not the scores; the gradient
    (`_blockwise_backward`) recomputes each ``block x block`` score block of one head where
    it needs it, one pass over query blocks (for q) and one over key blocks (k and v), in
    float32, written in place. Nothing ``T x T`` exists, nor a transposed copy of an input;
    the tokens must divide into blocks. `scale`: None for ``1 / sqrt(head_dim)``, 1.0 if q
    comes scaled. `causal` (static): each query sees the keys at or before it; False, all.
    """
    return _forward(q, k, v, block, scale, causal)[0]


def _blockwise_forward(
    q: jax.Array, k: jax.Array, v: jax.Array, block: int, scale: float | None, causal: bool
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _forward(q, k, v, block, scale, causal)
    return out, (q, k, v, lse)


def _blockwise_backward(
    size: int, scale: float | None, causal: bool, saved: tuple[jax.Array, ...], g: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    q, k, v, lse = saved
    b, t, h, d = q.shape
    f32, n = jnp.float32, t // size
    scale = d**-0.5 if scale is None else scale

    def probs(
        qi: jax.Array, kj: jax.Array, i: jax.Array, j: jax.Array, head: jax.Array
    ) -> jax.Array:
        return jnp.exp(_scores(qi, kj, i, j, scale, causal) - _row(lse, i, head, size)[..., None])

    def query_pass(at: jax.Array, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        dq, delta = carry
        head, i = at // n, at % n
        qi, gi = _block(q, i, head, size), _block(g, i, head, size)

        def out_step(j: jax.Array, acc: jax.Array) -> jax.Array:
            p = probs(qi, _block(k, j, head, size), i, j, head)
            return acc + jnp.einsum("bqk,bkd->bqd", p.astype(v.dtype), _block(v, j, head, size),
                                    preferred_element_type=f32)  # fmt: skip

        # The key blocks query block i sees: up to i if causal, else all of them.
        out = lax.fori_loop(0, i + 1 if causal else n, out_step, jnp.zeros((b, size, d), f32))
        di = jnp.einsum("bqd,bqd->bq", gi.astype(f32), out)  # rowsum(dO * O)

        def dq_step(j: jax.Array, acc: jax.Array) -> jax.Array:
            kj, vj = _block(k, j, head, size), _block(v, j, head, size)
            dp = jnp.einsum("bqd,bkd->bqk", gi, vj, preferred_element_type=f32)
            ds = probs(qi, kj, i, j, head) * (dp - di[..., None])
            return acc + jnp.einsum("bqk,bkd->bqd", ds.astype(k.dtype), kj,
                                    preferred_element_type=f32)  # fmt: skip

        dqi = lax.fori_loop(0, i + 1 if causal else n, dq_step, jnp.zeros((b, size, d), f32))
        return _put(dq, dqi * scale, i, head, size), _put_row(delta, di, i, head, size)

    dq, delta = lax.fori_loop(0, h * n, query_pass, (jnp.zeros_like(q), jnp.zeros((b, h, t), f32)))

    def key_pass(at: jax.Array, grads: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        dk, dv = grads
        head, j = at // n, at % n
        kj, vj = _block(k, j, head, size), _block(v, j, head, size)

        def step(i: jax.Array, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dkj, dvj = acc
            qi, gi = _block(q, i, head, size), _block(g, i, head, size)
            p = probs(qi, kj, i, j, head)
            dp = jnp.einsum("bqd,bkd->bqk", gi, vj, preferred_element_type=f32)
            ds = p * (dp - _row(delta, i, head, size)[..., None])
            dvj += jnp.einsum("bqk,bqd->bkd", p.astype(g.dtype), gi, preferred_element_type=f32)
            dkj += jnp.einsum("bqk,bqd->bkd", ds.astype(q.dtype), qi, preferred_element_type=f32)
            return dkj, dvj

        zeros = jnp.zeros((b, size, d), f32)
        # The query blocks that see key block j: from j on if causal, else all of them.
        dkj, dvj = lax.fori_loop(j if causal else 0, n, step, (zeros, zeros))
        return _put(dk, dkj * scale, j, head, size), _put(dv, dvj, j, head, size)

    dk, dv = lax.fori_loop(0, h * n, key_pass, (jnp.zeros_like(k), jnp.zeros_like(v)))
    return dq, dk, dv


attention_blockwise.defvjp(_blockwise_forward, _blockwise_backward)


CASE = Case(
    name="attention-scores",
    title="Attention materialises the T x T score matrix, and its gradient keeps it",
    symptom="the gradient of an attention layer runs out of memory as the sequence grows, "
    "quadratically in its length",
    devices=1,
    scales=_setup.SCALES,  # batch, heads, head_dim and the tokens measured at each scale
    variants=_setup.variants(  # each one's attention_backward; xla reproduces, the others fix
        xla=attention,
        chunked=attention_chunked,
        cudnn=attention_cudnn,
        blockwise=attention_blockwise,
        chunk=CHUNK,
        block=BLOCK,
    ),
    args=_setup.args,
    grid=lambda s: [{"tokens": t} for t in s["tokens"]],
    floor=_setup.floor,
    tolerance=0.05,
    runnable_scale="small",
    cause="the gradient keeps the T x T probabilities (or their gradient) of every head alive",
    recommended="blockwise",
)
