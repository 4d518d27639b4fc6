"""The `pmap-loop` page's machinery: the write-up's claims, decided per device on 4
devices (simulated in a child process when this one has fewer).

The programs themselves are in `runbook.cases.pmap_loop`; the write-up's own
`expensive_func` (`toy_expensive`, which cannot show the problem) is here, for the page.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _cache, _subprocess, _targets
from .._case import CaseResult, measure_case
from .._measure import MemoryReport, _name, compile_lowered, lower_fn, measure, program_hash
from .._render import fmt_bytes
from ..cases._setup.pmap_loop import replicated_args, serial_args, sharded_pmap_args
from ..cases.pmap_loop import (
    _WIDTH,
    CASE,
    DEVICES,
    _pmapped,
    fori_sum,
    loop_sum,
    options,
)
from ._claims import Claim, verdict

# How each compiler spells a matrix product in its optimised program: a dot, a YNNPACK
# kernel on CPU, a cuBLAS call on GPU, a convolution (inside a fusion) on TPU.
_PRODUCT = re.compile(r" dot\(| convolution\(|__ynn_fusion|custom_call_target=\"__cublas")


def toy_expensive(row: jax.Array) -> jax.Array:
    """The write-up's `expensive_func`: it fuses into a single reduction, no intermediate."""
    return jnp.sum(row**2)


def _count_products(
    fn: Any, *args: Any, compiler_options: dict[str, Any], target: str | None
) -> int:
    """Matrix products in `fn`'s optimised program (each unrolled iteration adds one).
    Cached like a measurement, by the program (a compile for a target is read from the
    docs' store)."""
    t = _targets.resolve(target)
    lowered = lower_fn(fn, *args, target=t)

    def compute() -> int:
        compiled = compile_lowered(lowered, name=_name(fn), compiler_options=compiler_options,
                                   target=t)  # fmt: skip
        return len(_PRODUCT.findall(compiled.as_text()))

    request = {"kind": "products", "program": program_hash(lowered), "options": compiler_options,
               "target": t.name if t else None}  # fmt: skip
    return int(_cache.cached(request, compute, module=__name__))


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """Every claim of the write-up, decided by measurements at the seed scale (per device).

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    if result is not None:
        target = result.provenance.target or None
    if target is None and jax.device_count() < DEVICES:
        data = _subprocess.call("runbook.site.pmap_loop:_claims_json", devices=DEVICES, scale=scale)
        return [Claim(**c) for c in data]
    with _targets.compiling_for(target):
        return _claims(result or measure_case("pmap-loop", scale, target=target), target)


def _claims(result: CaseResult, target: str | None) -> list[Claim]:
    opts = options() if target is None else {}
    scale = CASE.scales[result.scale]
    ks = [p["iterations"] for p in CASE.grid(scale)]
    lo, hi = ks[0], ks[-1]
    at: Callable[[str, int], MemoryReport] = lambda name, k: result.one(name, iterations=k)
    loop, serial = at("pmap-loop", hi), at("serial", hi)
    # pmap would multiply memory by the device count; schedules may differ by a few KiB.
    ratios = [at("pmap-loop", k).total / at("serial", k).total for k in ks]
    multiplied = max(ratios) > 1.5
    out = []
    out.append(
        Claim(
            "replicates",
            "pmap replicates the function on every GPU, multiplying its memory.",
            verdict(multiplied),
            f"per device, pmap-loop needs {min(ratios):.3f}x to {max(ratios):.3f}x what the "
            "single-device serial program needs over the sweep "
            f"({fmt_bytes(loop.total)} vs {fmt_bytes(serial.total)} at {hi} iterations): "
            "each device runs one copy of the per-device program.",
        )
    )
    per_iteration = (at("pmap-loop", hi).temp - at("pmap-loop", lo).temp) / (hi - lo)
    fori_flat = at("pmap-fori", hi).temp <= 1.01 * at("pmap-fori", lo).temp
    out.append(
        Claim(
            "all-gpus",
            "The for loop is compiled for all GPUs simultaneously, multiplying memory.",
            verdict(multiplied),
            "the multiplier is the iteration count, not the GPU count: temp grows from "
            f"{fmt_bytes(at('pmap-loop', lo).temp)} at {lo} to "
            f"{fmt_bytes(at('pmap-loop', hi).temp)} at {hi} iterations "
            f"({fmt_bytes(per_iteration)} per iteration) in pmap-loop and identically in "
            "serial; the rolled "
            f"loop (pmap-fori) stays {'flat' if fori_flat else 'not flat'} "
            f"at {fmt_bytes(at('pmap-fori', hi).temp)}.",
        )
    )
    args = replicated_args(scale, {"iterations": hi}, False)
    n_unrolled, n_rolled = (
        _count_products(_pmapped(f), *args, compiler_options=opts, target=target)
        for f in (loop_sum, fori_sum)
    )
    out.append(
        Claim(
            "eager-compile",
            "JAX compiles the whole function up front, loop included.",
            verdict(n_unrolled == hi and n_rolled == 1),
            f"the compiled pmap-loop program holds {n_unrolled} matrix products for {hi} "
            f"iterations (the Python loop is unrolled at trace time); pmap-fori holds {n_rolled}. "
            f"Compile time: {at('pmap-loop', hi).compile_seconds:.2f} s vs "
            f"{at('pmap-fori', hi).compile_seconds:.2f} s.",
        )
    )
    out.append(
        Claim(
            "fragmentation",
            "Memory fragmentation adds to the problem.",
            "not reproducible here",
            "the compile-time plan alone accounts for the growth (one live product per "
            "iteration); fragmentation is a property of a GPU allocator at run time, which a CPU "
            "build cannot show.",
        )
    )
    vm, fori = at("pmap-vmap", hi), at("pmap-fori", hi)
    how = (
        "vmap materialises every iteration's product at once"
        if vm.temp > loop.temp
        else "this compiler keeps vmap's products small"
    )
    out.append(
        Claim(
            "vmap",
            "Replace the loop with jax.vmap.",
            verdict(vm.total < 0.9 * loop.total),
            f"{how}: {fmt_bytes(vm.temp)} temp at {hi} iterations vs {fmt_bytes(loop.temp)} for "
            f"the loop and {fmt_bytes(fori.temp)} for lax.fori_loop; in total "
            f"{fmt_bytes(vm.total)} vs {fmt_bytes(loop.total)}.",
        )
    )
    static = measure(
        jax.jit(loop_sum, static_argnums=2),
        *serial_args(scale, {"iterations": hi}, False),
        _WIDTH,
        compiler_options=opts,
        target=target,
    )
    out.append(
        Claim(
            "static-argnums",
            "jit with static_argnums compiles the loop body only once.",
            verdict(static.temp < 0.9 * serial.temp),
            f"jax.jit(loop_sum, static_argnums=2) still unrolls: {fmt_bytes(static.temp)} temp, "
            f"the same as the serial loop ({fmt_bytes(serial.temp)}). Only a rolled loop "
            "(lax.fori_loop / lax.scan / lax.map) compiles the body once.",
        )
    )
    rep, shd = at("pmap-loop", hi), at("pmap-sharded", hi)
    out.append(
        Claim(
            "shard-inputs",
            "The inputs are not partitioned across GPUs; shard them explicitly.",
            verdict(rep.argument >= DEVICES * shd.argument * 0.99),
            f"in_axes=None puts the whole input on every device ({fmt_bytes(rep.argument)} "
            f"argument bytes per device); split by rows it is {fmt_bytes(shd.argument)}. "
            "(jax.tree_map, which the write-up names, places nothing: in_axes or a "
            "NamedSharding does.)",
        )
    )
    sm = at("shard_map-fori", hi) if result.select("shard_map-fori") else None
    pmap_sharded_fori = measure(
        _pmapped(fori_sum, sharded=True),
        *sharded_pmap_args(scale, {"iterations": hi}, False),
        compiler_options=opts,
        target=target,
    )
    out.append(
        Claim(
            "manual",
            "Distribute the work manually instead of relying on pmap.",
            verdict(sm is not None and sm.total < 0.95 * pmap_sharded_fori.total),
            f"pmap with the same two changes (rows sharded, rolled loop) needs "
            f"{fmt_bytes(pmap_sharded_fori.total)} per device; jit + shard_map needs "
            f"{fmt_bytes(sm.total) if sm else 'n/a'}. The memory comes from the loop and the "
            "replication, not from pmap itself.",
        )
    )
    return out


def _claims_json(scale: str = "seed") -> list[dict[str, str]]:
    return [dataclasses.asdict(c) for c in claims(scale=scale)]
