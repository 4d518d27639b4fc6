"""prng-temporaries: every verdict, the bars on every target shown, the distribution check,
the detector on programs written differently."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import runbook
from runbook import _targets
from runbook.cases import prng_temporaries as pt
from runbook.cases.prng_temporaries import CASE
from runbook.site import prng_temporaries as page
from runbook.site import verify_table

TARGETS = [None, "h100", "v5e"]  # the ones the page shows


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: t or "cpu")
def seed(request, measured_here):
    if request.param and _targets.unavailable(request.param):
        pytest.skip(_targets.unavailable(request.param))
    return measured_here("prng-temporaries", request.param)


def test_verdicts_are_the_ones_this_release_recorded(recorded):
    assert {c.key: c.verdict for c in page.claims()} == recorded("prng-temporaries")


def test_measured_within_a_minute_per_target(seed):
    result, seconds = seed
    assert {r.name for r in result.reports} == {v.name for v in CASE.variants}
    assert seconds < 60


def test_the_recommended_fix_is_near_its_floor_on_every_target_shown(seed):
    fix = seed[0].one(CASE.recommended)
    assert fix.lower_bound == pt.floor_bytes(CASE.scales["seed"])
    assert fix.total <= 1.25 * fix.lower_bound


def test_on_cpu_the_reproduction_needs_several_arrays_and_the_fix_far_less():
    result = runbook.measure_case("prng-temporaries", "seed")
    repro, fix = result.one("threefry"), result.one(CASE.recommended)
    assert repro.temp >= 2 * repro.output
    assert repro.total >= 1.5 * fix.total


@pytest.mark.parametrize("scale", ["tiny", CASE.runnable_scale])
def test_the_distribution_check_finds_the_fixes_the_same(scale):
    checks = runbook.verify("prng-temporaries", scale)
    assert {c["name"] for c in checks} == {"rbg", "blocked"}
    assert all(c["compared"] == "distribution" for c in checks), checks
    assert all(c["tolerance"] == CASE.significance for c in checks), checks
    assert all(c["p_value"] >= CASE.significance for c in checks), checks
    assert all(c["same"] for c in checks), checks


# Draws of another distribution, through `runbook.verify`'s own path: a uniform of the same
# mean and spread (mean and standard deviation alone would not tell it apart) and a normal
# of spread 1.25. At tiny (4096 numbers) a spread of 1.05 is too close to be told apart.
WRONG = {
    "uniform": lambda k, shape: jax.random.uniform(k, shape, jnp.float32, -(3**0.5), 3**0.5),
    "wide": lambda k, shape: 1.25 * pt.normal(k, shape),
}


def test_the_distribution_check_tells_another_distribution_apart(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key
    wrong = [
        dataclasses.replace(
            CASE.variant("threefry"), name=name, role="fix", program=pt._program(fn)
        )
        for name, fn in WRONG.items()
    ]
    monkeypatch.setattr(pt, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, *wrong)))
    checks = {c["name"]: c for c in runbook.verify("prng-temporaries", "tiny")}
    assert {name: c["same"] for name, c in checks.items()} == {
        "rbg": True,
        "blocked": True,
        "uniform": False,
        "wide": False,
    }, checks
    assert all(checks[name]["p_value"] < CASE.significance for name in WRONG), checks


def test_the_verify_table_shows_the_test():
    checks = runbook.verify("prng-temporaries", "tiny")
    table = verify_table(checks, "prng-temporaries", "tiny")
    assert table.columns == [
        "fix",
        "params",
        "numbers tested",
        "KS statistic",
        "p-value",
        "significance",
        "same distribution?",
    ]
    assert [row[2] for row in table.rows] == ["4096", "4096"]  # 64 x 64, every number
    assert [row[-1] for row in table.rows] == ["yes", "yes"]
    assert "Kolmogorov-Smirnov" in table.caption


def test_blocked_rejects_rows_that_do_not_divide():
    with pytest.raises(ValueError, match="do not divide"):
        pt.normal_blocked(pt.make_key(0, "threefry2x32"), (100, 8), blocks=64)


# Written unlike the case: other distributions, an old-style uint32 key, a model init, dropout.
KEY = jax.eval_shape(lambda: jax.random.key(0))


def _init(k):
    return {"w": jax.random.truncated_normal(k, -2, 2, (4096, 4096)), "b": jnp.zeros(4096)}


def _dropout(k, x):
    return jnp.where(jax.random.bernoulli(k, 0.9, x.shape), x / 0.9, 0)


OTHERS = {
    "uniform-bf16": (lambda k: jax.random.uniform(k, (8192, 4096), jnp.bfloat16, -1, 1), KEY),
    "bernoulli": (lambda k: jax.random.bernoulli(k, 0.3, (4096, 4096)), KEY),
    "init": (_init, KEY),
    "raw-key": (
        lambda k: 0.02 * jax.random.normal(k, (4096, 2048)),
        jax.ShapeDtypeStruct((2,), jnp.uint32),
    ),
    "dropout": (_dropout, KEY, jax.ShapeDtypeStruct((4096, 4096), jnp.float32)),
}


def _mine(found):
    return [f for f in found.findings if f.case == "prng-temporaries"]


@pytest.mark.parametrize("name", OTHERS)
def test_the_detector_finds_the_bits_in_programs_written_otherwise(name):
    fn, *args = OTHERS[name]
    assert _mine(runbook.diagnose(fn, *args)), name


def test_the_detector_is_silent_on_the_fix_and_on_bits_that_are_not_random():
    key = jax.eval_shape(lambda: pt.make_key(0, "threefry2x32"))
    fixed = runbook.diagnose(lambda k: pt.normal_blocked(k, (4096, 4096)), key)
    assert sum(f.bytes for f in _mine(fixed)) <= 0.05 * fixed.report.total
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    cumsum = runbook.diagnose(
        lambda a: jnp.cumsum(a.astype(jnp.uint32), axis=0).astype(jnp.float32), x
    )
    assert not _mine(cumsum)


def test_the_flag_is_read_when_the_program_is_lowered():
    found = {(s["impl"], s["partitionable"]): s for s in page.settings("small")}
    on, off = found[("threefry2x32", True)], found[("threefry2x32", False)]
    assert on["temp"] != off["temp"]


def test_drawing_sharded_gives_the_same_numbers_on_one_device():
    key = pt.make_key(0, "threefry2x32")
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    sharded = pt.normal_sharded(key, (64, 64), one)
    assert sharded.sharding == one
    assert jnp.array_equal(sharded, pt.normal(key, (64, 64)))


def test_sharded_generation_is_measured_per_device_in_a_child():
    found = page.sharded("small")  # a child with the devices forced
    assert [s["partitionable"] for s in found] == [True, False]
    size = CASE.scales["small"]
    assert all(s["output"] == size["rows"] * size["cols"] * 4 // page.SHARDS for s in found)
    on, off = found
    assert off["temp"] > on["temp"]  # each device makes more than its shard's bits
