"""The `vmap-materialize` page: its claims, the reports beside our figures, real runs of every
variant and of a Python loop, and jax-ml/jax#21377's pairwise kernels measured. The
reproductions and their fixes are in `runbook.cases.vmap_materialize`."""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _cache, _subprocess
from .._case import CaseResult, measure_case
from .._errors import DoesNotFitError
from .._measure import MemoryReport, measure
from .._render import Table, fmt_bytes
from .._runtime import runtime_peak
from ..cases.vmap_materialize import (
    CASE,
    PAIRWISE_BATCH,
    _in_flight,
    _inputs,
    activations_mapped,
    activations_vmap,
    floor_bytes,
    gram_matmul,
    gram_nested,
    kernel_21377,
    per_example,
    per_example_jit,
    python_loop,
    rbf,
)
from ._claims import Claim, verdict
from ._pages import cited_reports_table

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# What the reports say, quoted; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#23358": "vmap(lambda i: x.at[i].set(7).sum()) over 100k indices: out of "
    "memory allocating 40 GB",
    "jax-ml/jax#21377": "after successive vmaps, one gigantic matrix is created (kernel "
    "matrices of a (1000, 30) input, vmapped over 30 masks of the dimensions)",
}


# --- run time and the Python loop ------------------------------------------------------------


def _loop_json(scale: str, repeats: int) -> dict[str, Any]:
    """`python_loop` run for real in this (fresh) process: resident-set peak and best time."""
    from .._host import settle, status

    size = CASE.scale(scale)
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(8)))
    base = settle()
    x, idx = _inputs(size, {}, True)
    host = [np.int32(i) for i in np.asarray(idx)]
    jax.block_until_ready(per_example_jit(x, host[0]))  # compile outside the measurement
    gc.collect()
    settle()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    python_loop(x, host)
    measured = status("VmHWM") - base
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        python_loop(x, host)
        times.append(time.perf_counter() - start)
    return {"measured": int(measured), "seconds": min(times), "calls": len(host)}


def loop_run(scale: str | None = None, repeats: int = 3) -> dict[str, Any]:
    """`python_loop` at a runnable scale, in a fresh process: ``measured`` (resident-set
    peak growth, inputs included), ``seconds`` (best of `repeats`), ``calls``."""
    scale = scale or CASE.runnable_scale
    request = {"kind": "python-loop", "case": CASE.name, "scale": scale, "repeats": repeats}
    run: dict[str, Any] = _cache.cached(
        request,
        functools.partial(_subprocess.call, f"{__name__}:_loop_json", scale=scale, repeats=repeats),
        module=__name__,
    )
    return run


def loop_program(scale_name: str = "seed", target: str | None = None) -> MemoryReport:
    """The program the Python loop compiles and calls once per index, measured."""
    x, _ = _inputs(CASE.scales[scale_name], {}, False)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    return measure(per_example, x, i, name="python loop, one call", target=target)


LOOP_SCALES = ("small", "medium")  # where vmap and the Python loop both run


def runtimes(scale: str | None = None) -> dict[str, Any]:
    """Every variant run for real at a runnable scale (fresh processes), and the Python loop.

    Returns ``{"peaks": [RuntimePeak, ...], "loop": loop_run(scale), "versus": {scale:
    (vmap's RuntimePeak, loop_run(scale))}}``, the last for each of `LOOP_SCALES`.
    """
    peaks = [runtime_peak(CASE.name, v.name, scale=scale) for v in CASE.variants
             if CASE.available(v)]  # fmt: skip
    versus = {s: (runtime_peak(CASE.name, "vmap", scale=s), loop_run(s)) for s in LOOP_SCALES}
    return {"peaks": peaks, "loop": loop_run(scale), "versus": versus}


def versus_table(runs: Mapping[str, Any]) -> Table:
    """vmap against the Python loop at each of `LOOP_SCALES`: measured peak and run time."""
    rows = []
    for s, (v, loop) in runs["versus"].items():
        n = CASE.scales[s]["n"]
        rows.append([f"{n:,}", fmt_bytes(v.measured), fmt_bytes(loop["measured"]),
                     f"{v.seconds * 1e3:.1f} ms", f"{loop['seconds'] * 1e3:.1f} ms"])  # fmt: skip
    return Table(
        ["indices (= size of x)", "vmap: peak", "loop: peak", "vmap: time", "loop: time"],
        rows,
        "Each run in a fresh process; peak: resident-set growth, inputs included; time: best "
        "of three. The loop keeps each call's result as a jax.Array, then fetches them all.",
    )


def loop_table(runs: Mapping[str, Any]) -> Table:
    """The Python loop beside `vmap` and the recommended fix, run at the runnable scale."""
    by = {p.name: p for p in runs["peaks"]}
    loop = runs["loop"]
    rows = [[p.name, fmt_bytes(p.measured), f"{p.seconds * 1e3:.1f} ms",
             f"{p.seconds / by['vmap'].seconds:.2f}x"]
            for p in runs["peaks"]]  # fmt: skip
    rows.append(["python loop", fmt_bytes(loop["measured"]), f"{loop['seconds'] * 1e3:.1f} ms",
                 f"{loop['seconds'] / by['vmap'].seconds:.2f}x"])  # fmt: skip
    n = CASE.scales[CASE.runnable_scale]["n"]
    return Table(
        ["variant", "measured peak", "run time", "time vs vmap"],
        rows,
        f"Scale {CASE.runnable_scale!r} (n={n:,}), each in a fresh process, best of three; "
        f"peak: {runs['peaks'][0].method} (the loop's: the same, {loop['calls']:,} calls).",
    )


def tradeoff_figure(result: CaseResult, runs: Mapping[str, Any]) -> Figure:
    """Memory (seed scale, compile time) and run time (runnable scale) against the number of
    examples in flight: 1 (rolled), k (lax.map), every index (vmap)."""
    import matplotlib.pyplot as plt

    n_seed = CASE.scales[result.scale]["n"]
    n_run = CASE.scales[CASE.runnable_scale]["n"]
    by_time = {p.name: p.seconds for p in runs["peaks"]}
    names = [r.name for r in result.reports if _in_flight(r.name, 1) or r.name == "vmap"]
    names = sorted(names, key=lambda v: _in_flight(v, n_seed))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    ks = [_in_flight(v, n_seed) for v in names]
    gib = [result.one(v).total / 2**30 for v in names]
    left.loglog(ks, gib, "o-", color="C0", label="total bytes, compile time")
    left.loglog(ks, [floor_bytes(v, n_seed) / 2**30 for v in names], "k+", ms=12,
                label="floor: inputs, output, a copy of x per example")  # fmt: skip
    left.axhline(result.one("rewrite").total / 2**30, color="C2", ls="--", label="rewrite")
    for v, k, g in zip(names, ks, gib, strict=True):
        left.annotate(v, (k, g), textcoords="offset points", xytext=(6, -12))
    left.set(xlabel="examples in flight", ylabel="GiB",
             title=f"memory, n = {n_seed:,} (seed)")  # fmt: skip
    left.legend(fontsize=8)
    run_ks = [_in_flight(v, n_run) for v in names if v in by_time]
    right.semilogx(run_ks, [by_time[v] * 1e3 for v in names if v in by_time], "o-", color="C1",
                   label="lax.map / vmap")  # fmt: skip
    for v in names:
        if v in by_time:
            right.annotate(v, (_in_flight(v, n_run), by_time[v] * 1e3),
                           textcoords="offset points", xytext=(6, -12))  # fmt: skip
    right.axhline(runs["loop"]["seconds"] * 1e3, color="C3", ls=":", label="python loop")
    right.axhline(by_time["rewrite"] * 1e3, color="C2", ls="--", label="rewrite")
    right.set_yscale("log")
    right.set(xlabel="examples in flight", ylabel="ms (best of three)",
              title=f"run time, n = {n_run:,} (runnable)")  # fmt: skip
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


# --- jax-ml/jax#21377: a pairwise kernel under successive vmaps --------------------------------

PAIRWISE = {
    "seed": {"n": 8192, "d": 32, "masks": 32},
    "small": {"n": 2048, "d": 32, "masks": 32},
    "tiny": {"n": 64, "d": 8, "masks": 8},
}


def pairwise_programs() -> list[tuple[str, Any]]:
    """(label, function of ``(xs, masks, ys)``): the report's program, then its rewrites."""
    k21377 = functools.partial(gram_nested, kernel_21377)
    nested = functools.partial(gram_nested, rbf)
    return [
        ("#21377's kernel, nested vmap; vmap over masks (as reported)",
         functools.partial(activations_vmap, k21377)),
        (f"#21377's kernel, nested vmap; lax.map over masks, {PAIRWISE_BATCH} at a time",
         functools.partial(activations_mapped, k21377)),
        ("RBF kernel, nested vmap; vmap over masks", functools.partial(activations_vmap, nested)),
        (f"RBF kernel, nested vmap; lax.map, {PAIRWISE_BATCH} at a time",
         functools.partial(activations_mapped, nested)),
        ("RBF kernel, matrix product; vmap over masks",
         functools.partial(activations_vmap, gram_matmul)),
        (f"RBF kernel, matrix product; lax.map, {PAIRWISE_BATCH} at a time",
         functools.partial(activations_mapped, gram_matmul)),
    ]  # fmt: skip


def _pairwise_inputs(
    scale: Mapping[str, int], concrete: bool
) -> (
    tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]
    | tuple[jax.Array, jax.Array, jax.Array]
):
    n, d, m = scale["n"], scale["d"], scale["masks"]
    if not concrete:
        f: Callable[..., jax.ShapeDtypeStruct] = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
        return f(n, d), f(m, d), f(m, n)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((n, d), dtype=np.float32) / np.sqrt(d)
    masks = rng.integers(0, 2, (m, d)).astype(np.float32)
    return jnp.asarray(xs), jnp.asarray(masks), jnp.asarray(rng.standard_normal((m, n), np.float32))


def pairwise_costs(
    scale: str = "seed", target: str | None = None, *, first: int | None = None
) -> list[dict[str, Any]]:
    """Every `pairwise_programs` program (or the `first` ones) measured, buffers kept:
    ``label``, ``report``, ``largest`` (its largest buffer), or ``skipped`` (the reason)
    where a target refuses it."""
    args = _pairwise_inputs(PAIRWISE[scale], False)
    rows: list[dict[str, Any]] = []
    for label, fn in pairwise_programs()[:first]:
        try:
            r = measure(fn, *args, name=label, buffers=True, target=target)
        except DoesNotFitError as e:
            rows.append({"label": label, "skipped": str(e)})
            continue
        rows.append({"label": label, "report": r, "largest": r.buffers[0]})
    return rows


def pairwise_checks(scale: str = "tiny") -> list[dict[str, Any]]:
    """Each rewrite run on real arrays against its reference: the report's program for the
    #21377 kernel, the nested-vmap RBF program for the RBF ones. Error as `runbook.verify`'s."""
    args = _pairwise_inputs(PAIRWISE[scale], True)
    programs = pairwise_programs()
    out = [np.asarray(jax.jit(fn)(*args)) for _, fn in programs]
    checks = []
    for i, (label, _) in enumerate(programs):
        ref = 0 if i < 2 else 2
        if i == ref:
            continue
        err = float(np.max(np.abs(out[i] - out[ref]) / (np.abs(out[ref]) + 1.0)))
        checks.append({"label": label, "max_rel_error": err, "same": err <= 1e-4})
    return checks


def pairwise_table(costs: list[dict[str, Any]], checks: Sequence[Mapping[str, Any]]) -> Table:
    """`pairwise_costs` as a table, with the same-result check of each rewrite."""
    same = {c["label"]: c for c in checks}
    first = next(c["report"] for c in costs if "report" in c)
    rows = []
    for c in costs:
        check = same.get(c["label"])
        agrees = "reference" if check is None else (
            f"{'yes' if check['same'] else 'NO'} ({check['max_rel_error']:.1e})")  # fmt: skip
        if "report" not in c:
            rows.append([c["label"], "does not fit", "-", "-", agrees])
            continue
        b = c["largest"]
        rows.append([c["label"], fmt_bytes(c["report"].total), f"{b.shape} {fmt_bytes(b.size)}",
                     f"{first.total / c['report'].total:.2f}x", agrees])  # fmt: skip
    s = PAIRWISE["seed"]
    return Table(
        ["program", "total", "largest buffer", "saving vs the report's", "same result?"],
        rows,
        f"n={s['n']:,} points of d={s['d']}, {s['masks']} masks; compile time. Same result: "
        f"real arrays at n={PAIRWISE['tiny']['n']}, tolerance 1e-4. {first.provenance.label()}.",
    )


# --- the reports and the claims --------------------------------------------------------------


def reports_table(result: CaseResult, pairwise: list[dict[str, Any]]) -> Table:
    """What each report says beside what we measure for the same program."""
    n = CASE.scales[result.scale]["n"]
    repro = result.one("vmap")
    first = pairwise[0]
    got = (
        f"{fmt_bytes(first['largest'].size)} {first['largest'].shape} in a program of "
        f"{fmt_bytes(first['report'].total)}"
        if "report" in first
        else first["skipped"]
    )
    s = PAIRWISE["seed"]
    ours = [
        (
            f"n={n:,}: {fmt_bytes(repro.total)} ({repro.total / 1e9:.1f} GB), of which "
            f"{fmt_bytes(repro.temp)} temporaries: {repro.temp / (4 * n):,.0f} copies of x"
        ),
        f"n={s['n']:,}, d={s['d']}, {s['masks']} masks, float32: largest buffer {got}",
    ]
    return cited_reports_table(
        REPORTS, ours, f"{result.provenance.label()}; compile time, {result.scale} scale."
    )


def claims(
    result: CaseResult | None = None,
    runs: Mapping[str, Any] | None = None,
    pairwise: list[dict[str, Any]] | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
) -> list[Claim]:
    """The claims of the reports and of common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        runs: `runtimes()` (run here when not given; only on this backend: a target's run
            time cannot be measured without its device).
        pairwise: `pairwise_costs` for the same compiler (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    # With buffers: the accelerator section measured the same programs so (cached).
    result = result or measure_case(CASE.name, scale, target=target, buffers=True)
    target = result.provenance.target or None
    n = CASE.scales[result.scale]["n"]
    pw_scale = result.scale if result.scale in PAIRWISE else "small"
    if pairwise is None:
        pairwise = pairwise_costs(pw_scale, target=target, first=1)
    if runs is None and target is None:
        runs = runtimes()
    repro = result.one("vmap")
    out = []
    copies = repro.temp / (4 * n)
    out.append(
        Claim(
            "forty-gb",
            "vmap of x.at[i].set(7).sum() over 100k indices needs about 40 GB (jax-ml/jax#23358).",
            verdict(abs(repro.total / 40e9 - 1) < 0.1)
            if result.scale == "seed"
            else "not reproducible here",
            f"n={n:,}: {fmt_bytes(repro.total)} ({repro.total / 1e9:.1f} GB); its "
            f"temporaries are {copies:,.0f} copies of x, one per index.",
        )
    )
    first = pairwise[0]
    if "report" in first:
        s = PAIRWISE[pw_scale]
        big = first["largest"]
        gigantic = big.shape.endswith(f"[{s['n']},{s['n']},{s['d']}]")
        evidence = (
            f"n={s['n']:,}, d={s['d']}, {s['masks']} masks: largest buffer {big.shape} "
            f"({fmt_bytes(big.size)}, made by "
            f"{big.op.rsplit('/', 1)[-1] or big.instruction}) of {fmt_bytes(first['report'].total)}"
            ": the kernel's (n, n, d) terms, which do not depend on the mask: vmap computes "
            "them once for all masks."
        )
        out.append(
            Claim(
                "gigantic",
                "Successive vmaps of a pairwise kernel create one gigantic (n, n, d) array "
                "(jax-ml/jax#21377).",
                verdict(gigantic),
                evidence,
            )
        )
    else:
        out.append(
            Claim(
                "gigantic",
                "Successive vmaps of a pairwise kernel create one gigantic "
                "(n, n, d) array (jax-ml/jax#21377).",
                "not reproducible here",
                f"{first['label']}: {first['skipped']}",
            )
        )
    one = loop_program(result.scale, target)
    if runs is not None:
        by = {p.name: p for p in runs["peaks"]}
        worse = []
        parts = []
        for s_name, (v, loop) in runs["versus"].items():
            if v.measured > loop["measured"] or v.seconds > loop["seconds"]:
                worse.append(s_name)
            parts.append(
                f"n={CASE.scales[s_name]['n']:,}: vmap {fmt_bytes(v.measured)} in "
                f"{v.seconds * 1e3:.1f} ms, the loop {fmt_bytes(loop['measured'])} in "
                f"{loop['seconds'] * 1e3:.1f} ms"
            )
        out.append(
            Claim(
                "better-than-loop",
                "vmap is always better than a Python loop.",
                verdict(not worse and repro.total <= one.total + 8 * n),
                "measured peaks and run times: " + "; ".join(parts) + f". vmap's memory "
                f"grows with n squared: at n={n:,} it needs {fmt_bytes(repro.total)} (compile "
                f"time), where each call of the loop needs {fmt_bytes(one.total)}.",
            )
        )
        maps = [by[v.name] for v in CASE.variants if v.name.startswith("map-") and v.name in by]
        best = min(maps, key=lambda p: p.seconds)
        out.append(
            Claim(
                "map-slower",
                "lax.map is always slower than vmap.",
                verdict(all(p.seconds > by["vmap"].seconds for p in maps)),
                f"at n={CASE.scales[CASE.runnable_scale]['n']:,}: vmap "
                f"{by['vmap'].seconds * 1e3:.1f} ms; "
                + ", ".join(f"{p.name} {p.seconds * 1e3:.1f} ms" for p in maps)
                + f"; rolled {by['rolled'].seconds * 1e3:.1f} ms. Fastest lax.map: {best.name}, "
                f"{best.seconds / by['vmap'].seconds:.2f}x vmap's time.",
            )
        )
    else:
        out.append(
            Claim(
                "better-than-loop",
                "vmap is always better than a Python loop.",
                verdict(repro.total <= one.total + 8 * n),
                f"memory only (run time needs the device): at n={n:,}, vmap needs "
                f"{fmt_bytes(repro.total)}; each call of the loop {fmt_bytes(one.total)}.",
            )
        )
        out.append(
            Claim(
                "map-slower",
                "lax.map is always slower than vmap.",
                "not reproducible here",
                "a run time; compiling for a target without its device measures none.",
            )
        )
    return out
