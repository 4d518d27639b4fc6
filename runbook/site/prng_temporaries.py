"""The `prng-temporaries` page: the reports beside our figures, the generator settings that
change the temporaries, and the claims. The reproduction and its fixes are in
`runbook.cases.prng_temporaries`."""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .. import _cache, _case_types, _subprocess, _targets
from .._case import CaseResult, measure_case
from .._measure import MemoryReport, measure
from .._render import Table, fmt_bytes
from ..cases.prng_temporaries import CASE, make_key, normal, normal_sharded
from ._claims import Claim, verdict
from ._history import Note, load_versions
from ._pages import cited_reports_table

# What the reports say, summarised; ours is measured beside it.
REPORTS = {
    "openxla/xla#10415, jax-ml/jax#20328": "threefry2x32 needs twice the output's size "
    "(its counters and its bits) on top of the output",
    "jax-ml/jax#21045": "jax.random.uniform of a 4 GiB bf16 array on a TPU v4 (jax 0.4.26) "
    "allocates about 20 GB",
    "jax-ml/jax#17865": "jax.random.bernoulli needs several times its output to turn bits "
    "into booleans",
    "jax-ml/jax#19893": "initialising large parameters runs out of memory, and sharding them "
    "cannot help: every device holds threefry's bits for the whole array",
}

SHARDS = 8  # devices the array is drawn sharded over (rows split, `P("x", None)`)

# jax-ml/jax#21045's program: a (524288, 4096) bf16 uniform array, 4 GiB.
UNIFORM_21045 = (524288, 4096)

SETTINGS = (  # (key implementation, jax_threefry_partitionable) the page compares
    ("threefry2x32", True),
    ("threefry2x32", False),
    ("rbg", True),
)


def _partitionable_default() -> bool:
    """This JAX's default for ``jax_threefry_partitionable`` (False before 0.5)."""
    # Newer jax releases type this attribute; older ones do not (hence both codes).
    value: bool = jax.config.jax_threefry_partitionable  # type: ignore[attr-defined,unused-ignore]
    return value


def _setting_json(impl: str, partitionable: bool, scale: str, target: str | None) -> dict[str, Any]:
    size = CASE.scale(scale)
    key = jax.eval_shape(lambda: make_key(0, impl))
    shape = (size["rows"], size["cols"])
    # The flag is read when the program is lowered: set it around the measurement.
    with jax.threefry_partitionable(partitionable):
        report = measure(lambda k: normal(k, shape), key, target=target)
    return {"temp": report.temp, "output": report.output, "total": report.total}


def settings(scale: str = "seed", target: str | None = None) -> list[dict[str, Any]]:
    """`normal` compiled under each of `SETTINGS`: its temporaries and output, in bytes."""
    found = []
    for impl, partitionable in SETTINGS:
        request = {"kind": "prng-setting", "impl": impl, "partitionable": partitionable,
                   "scale": scale, "target": target}  # fmt: skip
        compute = functools.partial(_setting_json, impl, partitionable, scale, target)
        figures = _cache.cached(request, compute, module=__name__)
        found.append({"impl": impl, "partitionable": partitionable, **figures})
    return found


def settings_table(found: list[dict[str, Any]], caption: str = "") -> Table:
    rows = [
        [s["impl"], str(s["partitionable"]), fmt_bytes(s["output"]), fmt_bytes(s["temp"]),
         f"{s['temp'] / s['output']:.2f}x"]
        for s in found
    ]  # fmt: skip
    return Table(
        ["key", "jax_threefry_partitionable", "output", "temporaries", "temporaries / output"],
        rows,
        caption,
    )


def _sharded_json(scale: str, target: str | None) -> list[dict[str, Any]]:
    """In a process with `SHARDS` devices (or for a target): `normal_sharded` per flag."""
    size = CASE.scale(scale)
    shape = (size["rows"], size["cols"])
    found = []
    with _targets.compiling_for(target):
        mesh = Mesh(np.array(_case_types.devices(SHARDS)), ("x",))
        key = jax.eval_shape(lambda: make_key(0, "threefry2x32"))
        key = jax.ShapeDtypeStruct(
            key.shape, key.dtype, sharding=NamedSharding(mesh, PartitionSpec())
        )
        rows = NamedSharding(mesh, PartitionSpec("x", None))
        for partitionable in (True, False):
            with jax.threefry_partitionable(partitionable):
                report = measure(lambda k: normal_sharded(k, shape, rows), key, target=target)
            found.append({"partitionable": partitionable, "temp": report.temp,
                          "output": report.output})  # fmt: skip
    return found


def sharded(scale: str = "seed", target: str | None = None) -> list[dict[str, Any]]:
    """`normal_sharded` over `SHARDS` devices, with `jax_threefry_partitionable` True and
    False: per device, the temporaries and the output (the shard), in bytes.

    On CPU the devices are forced in a child process (they must exist before JAX starts).
    """
    request = {"kind": "prng-sharded", "scale": scale, "target": target, "shards": SHARDS}
    if target is None and jax.device_count() < SHARDS:
        compute = functools.partial(
            _subprocess.call, f"{__name__}:_sharded_json", devices=SHARDS, scale=scale,
            target=None,
        )  # fmt: skip
    else:
        compute = functools.partial(_sharded_json, scale, target)
    found: list[dict[str, Any]] = _cache.cached(request, compute, module=__name__)
    return found


def sharded_table(
    found: list[dict[str, Any]], unsharded: list[dict[str, Any]], caption: str = ""
) -> Table:
    """`sharded(...)` per flag: each device's temporaries beside its shard's size and beside
    the temporaries of the whole array drawn on one device."""
    rows = []
    for s in found:
        whole = _at(unsharded, "threefry2x32", s["partitionable"])
        rows.append([
            str(s["partitionable"]), fmt_bytes(s["output"]), fmt_bytes(s["temp"]),
            f"{s['temp'] / s['output']:.2f}x", fmt_bytes(whole["temp"]),
        ])  # fmt: skip
    return Table(
        ["jax_threefry_partitionable", "shard (per device)",
         f"temporaries per device, {SHARDS} shards", "temporaries / shard",
         "temporaries, whole array on one device"],
        rows,
        caption,
    )  # fmt: skip


@functools.cache
def uniform_21045(target: str | None = None) -> MemoryReport:
    """jax-ml/jax#21045's call, compiled (nothing is allocated), once per process: the
    reports table and the claims read the same compile."""
    key = jax.eval_shape(lambda: make_key(0, "threefry2x32"))

    def draw(k: jax.Array) -> jax.Array:
        return jax.random.uniform(k, UNIFORM_21045, jnp.bfloat16, minval=-1, maxval=1)

    return measure(draw, key, name="uniform-21045", target=target)


def reports_table(result: CaseResult, found: list[dict[str, Any]]) -> Table:
    repro = result.one("threefry")
    target = result.provenance.target or None  # "" on this process's backend
    uniform = uniform_21045(target)
    ours = [
        (
            f"{fmt_bytes(repro.temp)} of temporaries for a {fmt_bytes(repro.output)} array "
            f"({repro.temp / repro.output:.2f}x)"
        ),
        f"{fmt_bytes(uniform.temp)} of temporaries for its {fmt_bytes(uniform.output)} array",
        "not measured here: the same bits-to-values chain as normal and uniform",
        _sharded_evidence(sharded(result.scale, target), found),
    ]
    return cited_reports_table(REPORTS, ours, result.provenance.label())


def _at_default(
    split: list[dict[str, Any]], found: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Under this JAX's default flag: the whole array on one device, then per device
    sharded; and per device sharded under the other setting."""
    default = _partitionable_default()
    many = next(s for s in split if s["partitionable"] == default)
    other = next(s for s in split if s["partitionable"] != default)
    return _at(found, "threefry2x32", default), many, other


def _sharded_evidence(split: list[dict[str, Any]], found: list[dict[str, Any]]) -> str:
    default = _partitionable_default()
    one, many, other = _at_default(split, found)
    return (
        f"with this JAX's default (partitionable={default}): {fmt_bytes(many['temp'])} per "
        f"device over {SHARDS} shards of {fmt_bytes(many['output'])}, against "
        f"{fmt_bytes(one['temp'])} on one device; with partitionable={not default}: "
        f"{fmt_bytes(other['temp'])} per device"
    )


def _at(found: list[dict[str, Any]], impl: str, partitionable: bool) -> dict[str, Any]:
    return next(s for s in found if s["impl"] == impl and s["partitionable"] == partitionable)


def claims(
    result: CaseResult | None = None,
    found: list[dict[str, Any]] | None = None,
    *,
    target: str | None = None,
    scale: str = "seed",
) -> list[Claim]:
    """The reports' claims and the common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        found: `settings(...)` (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case("prng-temporaries", scale, target=target)
    found = found or settings(result.scale, target)
    repro, rbg, blocked = (result.one(n) for n in ("threefry", "rbg", "blocked"))
    on, off = _at(found, "threefry2x32", True), _at(found, "threefry2x32", False)
    uniform = uniform_21045(target)
    split = sharded(result.scale, target)
    one, many, _ = _at_default(split, found)
    share = repro.temp / repro.output
    return [
        Claim(
            "threefry-twice",
            "threefry2x32 needs at least twice the output in temporaries (openxla/xla#10415, "
            "jax-ml/jax#20328).",
            verdict(share >= 2),
            f"jax.random.normal of a {fmt_bytes(repro.output)} array: {fmt_bytes(repro.temp)} "
            f"of temporaries ({share:.2f}x the output).",
        ),
        Claim(
            "rbg-avoids",
            "An rbg key avoids the temporaries (the workaround offered in jax-ml/jax#20328).",
            verdict(rbg.temp < 0.05 * rbg.output),
            f"with an rbg key: {fmt_bytes(rbg.temp)} of temporaries "
            f"({rbg.temp / rbg.output:.2f}x the output), against {fmt_bytes(repro.temp)} "
            "with threefry2x32.",
        ),
        Claim(
            "partitionable-costs",
            "jax_threefry_partitionable=True needs more temporaries than False.",
            verdict(on["temp"] - off["temp"] > 0.01 * on["output"]),
            f"{fmt_bytes(on['temp'])} with True, {fmt_bytes(off['temp'])} with False "
            f"(the running JAX defaults to {_partitionable_default()}).",
        ),
        Claim(
            "uniform-21045",
            "uniform in bf16 needs several times its output (jax-ml/jax#21045, reported on a TPU v4).",
            verdict(uniform.temp >= 2 * uniform.output),
            f"{fmt_bytes(uniform.temp)} of temporaries for a {fmt_bytes(uniform.output)} array.",
        ),
        Claim(
            "sharding-cannot-help",
            "Drawing the array already sharded does not reduce each device's temporaries "
            "(jax-ml/jax#19893).",
            # Where one device needs almost nothing there is nothing for sharding to reduce.
            "not reproducible here"
            if one["temp"] < 0.05 * one["output"]
            else verdict(many["temp"] >= 0.5 * one["temp"]),
            _sharded_evidence(split, found) + ".",
        ),
        Claim(
            "blocked-bounded",
            "Drawing the array in blocks of rows keeps the temporaries to a few blocks.",
            verdict(blocked.total <= 1.25 * blocked.lower_bound),
            f"{fmt_bytes(blocked.temp)} of temporaries; total {fmt_bytes(blocked.total)}, "
            f"{blocked.overhead:.3f}x the floor (the array).",
        ),
    ]


def _default_flag(evidence: str) -> str | None:
    """The flag's default a release ran with, as the sharding claim's evidence records it."""
    match = re.search(r"default \(partitionable=(True|False)\)", evidence)
    return match.group(1) if match else None


def sharding_by_release(releases: list[dict[str, Any]] | None = None) -> Note:
    """jax-ml/jax#19893's verdict per release, grouped by the flag's default there."""
    groups: dict[tuple[str, str | None], list[str]] = {}
    for release in releases if releases is not None else load_versions():
        found = release.get("claims", {}).get("cases", {}).get(CASE.name) or {}
        claim = next(
            (c for c in found.get("claims", []) if c["key"] == "sharding-cannot-help"), None
        )
        if claim:
            groups.setdefault((claim["verdict"], _default_flag(claim["evidence"])), []).append(
                release["jax"]
            )
    parts = [
        f"{verdict} on {', '.join(names)} (jax_threefry_partitionable defaulting to {default})"
        for (verdict, default), names in groups.items()
    ]
    return Note(
        "jax-ml/jax#19893 ('sharding cannot help'), decided on CPU by each release of the "
        f"version matrix: {'; '.join(parts)}."
    )
