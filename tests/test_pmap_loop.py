"""pmap-loop: every verdict, every fix's result, the issue's targets (4 simulated devices)."""

from __future__ import annotations

import pytest

import runbook
from runbook.cases import pmap_loop
from runbook.site import pmap_loop as page


@pytest.fixture(scope="module")
def seed(timed):
    return timed("pmap-loop")


@pytest.fixture(scope="module")
def verdicts():
    return {c.key: c.verdict for c in page.claims()}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("pmap-loop")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert result.provenance.devices == 4
    assert seconds < 60


def sweep(result, name, part="temp"):
    return [
        getattr(r, part) for r in sorted(result.select(name), key=lambda r: r.params["iterations"])
    ]


def test_reproduction_grows_with_iterations(seed):
    temps = sweep(seed[0], "pmap-loop")
    assert temps == sorted(temps)
    assert temps[-1] >= 2 * temps[0]


def test_recommended_fix_is_flat_sharded_and_near_its_floor(seed):
    result = seed[0]
    fix = result.select("shard_map-fori")
    totals = [r.total for r in fix]
    assert max(totals) <= 1.01 * min(totals)
    repro = result.one("pmap-loop", iterations=1)
    assert fix[0].argument * 4 <= repro.argument * 1.01
    assert all(r.overhead <= 1.10 for r in fix)


def test_fixes_give_the_same_result():
    checks = runbook.verify("pmap-loop", "tiny")
    names = {c["name"] for c in checks}
    assert names == {v.name for v in pmap_loop.CASE.variants if v.role == "fix"}
    assert all(c["same"] for c in checks), checks
