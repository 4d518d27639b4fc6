"""One KV-cache decode step of flax's lm1b Transformer language model.

The model is the lm1b decoder (see `lm1b`) built with ``decode=True``: each
`nn.SelfAttention` keeps a ``cache`` collection (``cached_key``, ``cached_value`` of shape
``(batch, max_decode_len, heads, head_dim)`` and a ``cache_index``), and the position
embedding its own index. One step feeds one token per row: each layer projects it, writes
its key and value into the cache at the index with `lax.dynamic_update_slice`, attends
over the whole cache under a mask of the positions filled so far, and the step returns the
next-token logits and the updated cache. This is the example's ``tokens_ids_to_logits``
(``apply`` with ``mutable=["cache"]``), which its temperature sampler calls once per token
inside a `lax.while_loop`; here it is jitted on its own, as a user's decode loop in Python
would, and donates nothing.

Authors' sampling scale (lm1b configs/default.py and train.py): the model of `lm1b`
(vocabulary 30,000, 6 layers, width 512, 8 heads of 64, MLP 2048, bfloat16 compute),
``max_predict_length`` 50, and one prompt per device (the example pads its single prompt to
the device count and pmaps the sampler). The source already writes the cache in place
(no concatenation of past and new keys), so inplace-copy has no fix to offer. Kept: the
modules, cache layout and dtypes. Changed: the sampler's loop, top-k and the tokenizer are
left out; the step is jitted alone; the token and cache are abstract inputs.

The fix:

- donation: `jax.jit` with ``donate_argnums=(1,)`` (the cache), so the updated keys and
  values are written into the old cache's buffers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._program import Builder, Built, RealProgram, register
from .lm1b import SCALES as LM1B_SCALES
from .lm1b import TransformerConfig, TransformerLM

SOURCE = (
    "https://github.com/google/flax/blob/"
    "0e5fc04018f1a20bdf32e9868c6a9eda38407424/examples/lm1b/models.py"
)
DECODE: dict[str, dict[str, int]] = {
    "authors": {"batch": 1, "max_decode_len": 50},
    "tiny": {"batch": 2, "max_decode_len": 8},
}


def _config(scale: str) -> TransformerConfig:
    s = LM1B_SCALES[scale]
    return TransformerConfig(
        vocab_size=s["vocab"], emb_dim=s["emb"], num_heads=s["heads"], num_layers=s["layers"],
        qkv_dim=s["qkv"], mlp_dim=s["mlp"], max_len=s["max_len"], deterministic=True,
        decode=True,
    )  # fmt: skip


def _tokens_to_logits(
    params: Any, cache: Any, ids: jax.Array, cfg: TransformerConfig
) -> tuple[jax.Array, Any]:
    """One token per row in, next-token logits ``(batch, vocab)`` and the new cache out."""
    logits, new_vars = TransformerLM(cfg).apply(
        {"params": params, "cache": cache}, ids, mutable=["cache"]
    )
    return logits.squeeze(axis=1), new_vars["cache"]


def _builder(donate: bool = False) -> Builder:
    def build(scale: str, concrete: bool) -> Built:
        cfg, d = _config(scale), DECODE[scale]
        model = TransformerLM(cfg)
        shape = (d["batch"], d["max_decode_len"])

        def init(rng: jax.Array) -> Any:
            return model.init(rng, jnp.ones(shape, cfg.dtype))

        step = jax.jit(
            functools.partial(_tokens_to_logits, cfg=cfg),
            donate_argnums=(1,) if donate else (),
        )
        ids_shape = (d["batch"], 1)
        if not concrete:
            variables = jax.eval_shape(init, jax.random.PRNGKey(0))
            ids = jax.ShapeDtypeStruct(ids_shape, jnp.int32)
            return step, (variables["params"], variables["cache"], ids)
        variables = jax.jit(init)(jax.random.PRNGKey(0))
        params, cache = variables["params"], variables["cache"]
        # Three tokens decoded already, so the step attends over a partly filled cache.
        for token in (5, 7, 11):
            _, cache = jax.jit(functools.partial(_tokens_to_logits, cfg=cfg))(
                params, cache, jnp.full(ids_shape, token, jnp.int32)
            )
        return step, (params, cache, jnp.full(ids_shape, 13, jnp.int32))

    return build


PROGRAM = register(
    RealProgram(
        name="kv-cache-decode",
        model="flax lm1b Transformer LM, one KV-cache decode step (flax linen)",
        source=SOURCE,
        libraries=("flax.linen",),
        build=_builder(),
        fixes={"donation": _builder(donate=True)},
        tolerance=1e-4,
        notes=(
            "one decode step jitted alone (the example runs it inside its sampler's "
            "while_loop); one prompt per device, 50 positions, as the example samples"
        ),
    )
)
