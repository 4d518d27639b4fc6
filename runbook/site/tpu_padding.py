"""The `tpu-padding` page: the reports beside our figures, the padded bytes of every program
on each compiler, the layouts XLA's TPU compiler chose, and the claims. The reproduction and
its fixes are in `runbook.cases.tpu_padding`."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _cache, _targets
from .._buffers import Buffer
from .._case import CaseResult, measure_case
from .._hlo import Shape
from .._measure import MemoryReport, compile_fn, measure
from .._render import Table, fmt_bytes
from ..cases.tpu_padding import CASE, logical_bytes
from ._accelerator import on_targets, variant_table
from ._claims import Claim, verdict
from ._history import load_versions

REPORTS = {
    "google/flax#1733": "a 3-D convolution with 2 channels and 1 feature: 10.96 GB of HLO "
    "temporaries on a TPU for 140.25 MB of data, 128x and 32x expansions",
    "jax-ml/jax#7502": "take_along_axis on a (2048, 1, 128, 128) float32 array: 64 GB on a "
    "TPU, its s32 index arrays padded 32x",
    "Common advice (TPU performance guides)": "an array with a small last dimension, such as "
    "[N, 3] or [B, T, 1], grows by up to 32x or more on a TPU",
}

TPUS = ("v5e", "v5p", "v6e")
SHOWN = ("h100", *TPUS)  # the targets the page compiles every variant for
PADDED = 10.0  # a program is padded when its padding is this many times the volume's bytes
GRANULE = 4096  # bytes
RECOMMENDED = CASE.recommended or "depthwise-width"
# XLA's TPU tile for float32, (rows, lanes): the T(8,128) its compiled layouts print.
TILE = (8, 128)

# Arrays of the common advice, each stored as an input and output of `a * 2`.
SMALL_LAST = {
    "points f32[N, 3]": ((2**20, 3), jnp.float32),
    "points bf16[N, 3]": ((2**20, 3), jnp.bfloat16),
    "per-token f32[B, T, 1]": ((64, 2048, 1), jnp.float32),
}
TAKE_SHAPE = (2048, 1, 128, 128)  # jax-ml/jax#7502's array


def padding(buffer: Buffer) -> int:
    """Bytes a buffer holds beyond its shape's own: the tiles' padding (0 on CPU and GPU).

    Differences under `GRANULE` are the allocator's rounding of small buffers, not padding.
    """
    extra = buffer.size - Shape(buffer.shape).nbytes
    return extra if extra >= GRANULE else 0


def padded_bytes(report: MemoryReport) -> int:
    """The padding of a program's largest buffers, summed (the buffers `measure` keeps)."""
    return sum(padding(b) for b in report.buffers)


def most_padded(report: MemoryReport) -> Buffer | None:
    """The buffer with the most padding, None when none is padded."""
    found = max(report.buffers, key=padding, default=None)
    return found if found is not None and padding(found) else None


def expansion(buffer: Buffer) -> float:
    return buffer.size / max(Shape(buffer.shape).nbytes, 1)


def results(names: Sequence[str] = SHOWN) -> dict[str, CaseResult]:
    """Every variant at seed scale, with its buffers, on this backend and each target."""
    return on_targets(CASE.name, names=names, every_variant=None)


def padding_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Per compiler: each variant's total, and the padding in its largest buffers."""
    found = found if found is not None else results()
    floor = fmt_bytes(next(iter(found.values())).reports[0].lower_bound)
    return variant_table(
        found,
        lambda r: f"{fmt_bytes(r.total)} ({fmt_bytes(padded_bytes(r))} padding)",
        f"Total per variant, and in brackets the bytes its largest buffers hold beyond their "
        f"shapes; the floor (input and output, unpadded) is {floor}. jax {jax.__version__}, "
        "one device, seed scale.",
    )


def _layout_json(shape: tuple[int, ...], dtype: Any, target: str) -> dict[str, Any]:
    """The layout XLA chose for an array that is a program's input and output."""
    with _targets.compiling_for(target):
        args = _targets.place((jax.ShapeDtypeStruct(shape, dtype),), target)
        compiled = compile_fn(lambda a: a * 2, *args)
    text = compiled.as_text()
    head = text.splitlines()[0]
    layout = re.search(r"entry_computation_layout=\{\((.*?)\)->", head)
    stored = compiled.memory_analysis().argument_size_in_bytes
    return {"layout": layout[1] if layout else "", "stored": int(stored)}


def stored_layout(label: str, target: str) -> dict[str, Any]:
    """`SMALL_LAST[label]` as `target` stores it: its layout, stored and logical bytes."""
    shape, dtype = SMALL_LAST[label]
    request = {
        "kind": "tpu-padding-layout",
        "shape": list(shape),
        "dtype": jnp.dtype(dtype).name,
        "target": target,
    }
    found = _cache.cached(request, lambda: _layout_json(shape, dtype, target), module=__name__)
    return {**found, "logical": math.prod(shape) * jnp.dtype(dtype).itemsize}


def layouts_table(targets: Sequence[str] = TPUS) -> Table:
    """The common advice's arrays as each TPU target stores them."""
    chosen = [t for t in targets if _targets.unavailable(t) is None]
    rows = []
    for label in SMALL_LAST:
        row = [label]
        for t in chosen:
            found = stored_layout(label, t)
            row.append(f"{found['layout']}: {found['stored'] / found['logical']:.2f}x")
        rows.append(row)
    return Table(
        ["array", *[f"{t} layout: stored / logical" for t in chosen]],
        rows,
        f"Each array the input and output of `a * 2`, compiled without the device, jax "
        f"{jax.__version__}. In a layout, {{0,1}} lists dimensions minor first; T(a,b) is the "
        "tile.",
    )


def _take(x: jax.Array) -> jax.Array:
    """jax-ml/jax#7502's program: take_along_axis with indices of the array's own shape."""
    return jnp.take_along_axis(x, jnp.zeros_like(x, jnp.int32), 1)


def _take_json(target: str | None) -> dict[str, Any]:
    x = jax.ShapeDtypeStruct(TAKE_SHAPE, jnp.float32)
    report = measure(jax.jit(_take), x, name="take_along_axis", buffers=True, target=target)
    worst = most_padded(report)
    return {"temp": report.temp, "worst": dataclasses.asdict(worst) if worst else None}


def take_along_axis(target: str | None) -> tuple[int, Buffer | None]:
    """jax-ml/jax#7502's program compiled for `target` (None: this backend): its
    temporaries and its most padded buffer."""
    request = {"kind": "tpu-padding-take", "target": target or jax.default_backend()}
    found = _cache.cached(request, lambda: _take_json(target), module=__name__)
    return found["temp"], Buffer(**found["worst"]) if found["worst"] else None


def _on_tpu(result: CaseResult) -> bool:
    return result.provenance.backend == "tpu"


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The reports' claims and the common advice, decided on this backend or for `target`.

    Args:
        result: the case measured with buffers (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case(CASE.name, scale, target=target, buffers=True)
    repro, tpu = result.one("ndhwc-conv"), _on_tpu(result)
    volume = logical_bytes(CASE.scales[scale], CASE.scales[scale]["channels"])[0]
    worst = most_padded(repro)
    not_here = "not reproducible here"
    where = "this compiler stores no array in tiles" if not tpu else ""

    def padded(name: str) -> str:
        report = result.one(name)
        return f"{name}: {fmt_bytes(report.total)}, {fmt_bytes(padded_bytes(report))} of padding"

    take_temp, take_worst = take_along_axis(target)
    stored = {label: stored_layout(label, target) for label in SMALL_LAST} if tpu and target else {}
    small_growth = max((s["stored"] / s["logical"] for s in stored.values()), default=1.0)
    return [
        Claim(
            "few-channels-padded",
            "A 3-D convolution with 2 channels and 1 feature needs many times its data in "
            "temporaries on a TPU (google/flax#1733).",
            verdict(padded_bytes(repro) >= PADDED * volume) if tpu else not_here,
            f"{padded('ndhwc-conv')}, for a {fmt_bytes(volume)} volume"
            + (
                f"; its most padded buffer {worst.shape}, {expansion(worst):.0f}x its shape's bytes"
                if worst
                else ""
            )
            + ".",
        ),
        Claim(
            "tiles-128",
            "XLA's TPU compiler pads the dimension it stores in the 128-wide place of a tile "
            "up to 128.",
            verdict(worst is not None and expansion(worst) >= 64) if tpu else not_here,
            f"{worst.shape} is stored in {fmt_bytes(worst.size)}, {expansion(worst):.0f}x its "
            f"{fmt_bytes(Shape(worst.shape).nbytes)}."
            if worst
            else f"{where}.",
        ),
        Claim(
            "small-last-dim",
            "An array with a small last dimension, such as [N, 3] or [B, T, 1], grows by up "
            "to 32x or more on a TPU.",
            verdict(small_growth >= 8) if stored else not_here,
            "; ".join(
                f"{label}: {s['layout']}, {s['stored'] / s['logical']:.2f}x"
                for label, s in stored.items()
            )
            + "."
            if stored
            else f"{where or 'decided per TPU target'}.",
        ),
        Claim(
            "channels-first",
            "Naming a large dimension last (a channels-first convolution) avoids the padding.",
            verdict(padded_bytes(result.one("channels-first")) * 2 < padded_bytes(repro))
            if padded_bytes(repro)
            else not_here,
            f"{padded('ndhwc-conv')}; {padded('channels-first')}.",
        ),
        Claim(
            "take-along-axis-7502",
            "take_along_axis on a (2048, 1, 128, 128) array pads its index arrays 32x on a TPU "
            "(jax-ml/jax#7502).",
            verdict(take_worst is not None and expansion(take_worst) >= 16) if tpu else not_here,
            f"{fmt_bytes(take_temp)} of temporaries; "
            + (
                f"most padded buffer {take_worst.shape}, {expansion(take_worst):.1f}x"
                if take_worst
                else "no buffer is padded"
            )
            + ".",
        ),
    ]


def reports_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Each report beside what the compiler for a v5e gives for the same program."""
    found = found if found is not None else results()
    tpu = found.get("v5e")
    if tpu is None:
        return Table(["report", "what it saw"], [[k, v] for k, v in REPORTS.items()])
    decided = {c.key: c for c in claims(tpu, target="v5e")}
    keys = ("few-channels-padded", "take-along-axis-7502", "small-last-dim")
    rows = [
        [report, said, decided[k].verdict, decided[k].evidence]
        for (report, said), k in zip(REPORTS.items(), keys, strict=True)
    ]
    return Table(
        ["report", "what it saw", "verdict for a v5e", "measured (compile-time prediction)"],
        rows,
        f"Compiled for a TPU v5e without the device, jax {jax.__version__}.",
    )


def _times_floor(release: Mapping[str, Any], target: str | None, name: str) -> str:
    where = release if target is None else release.get("targets", {}).get(target, {})
    if target is not None and where.get("status") != "ok":
        return "no compiler" if where.get("status") == "not applicable" else "failed"
    case = where.get("cases", {}).get(CASE.name) or {}
    found = next((v for v in case.get("variants", []) if v["name"] == name), None)
    if found is None or found.get("status", "ok") != "ok":
        return "not measured"
    return f"{found['bytes']['total'] / found['lower_bound']:.1f}x"


def by_release(releases: Sequence[Mapping[str, Any]] | None = None) -> Table:
    """Per release of the version matrix: the reproduction's and the recommended fix's total
    against the floor, on CPU and compiled for a v5e (where that release's libtpu exists)."""
    shown = ("ndhwc-conv", RECOMMENDED)
    rows = []
    for release in releases if releases is not None else load_versions():
        if CASE.name not in release.get("cases", {}):
            continue
        rows.append(
            [release["jax"]]
            + [_times_floor(release, t, n) for t in (None, "v5e")
               for n in shown]
        )  # fmt: skip
    return Table(
        ["jax"] + [f"{n}, {t}" for t in ("CPU", "v5e") for n in shown],
        rows,
        "Total / floor at seed scale, from the committed version matrix (`nox -s versions`); "
        "v5e compiled without the device, with each release's own libtpu.",
    )  # fmt: skip
