"""vmap-materialize: every verdict, every fix's result, the issue's targets."""

from __future__ import annotations

import dataclasses
import functools
import json

import pytest

import runbook
from runbook._cli import main
from runbook.cases import vmap_materialize as vm
from runbook.cases.vmap_materialize import CASE
from runbook.site import vmap_materialize as page


@pytest.fixture(scope="module")
def seed(timed):
    return timed("vmap-materialize")


@pytest.fixture(scope="module")
def pairwise():
    return page.pairwise_costs()


@pytest.fixture(scope="module")
def runs():
    return page.runtimes()


@pytest.fixture(scope="module")
def verdicts(seed, runs, pairwise):
    return {c.key: c.verdict for c in page.claims(seed[0], runs, pairwise)}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("vmap-materialize")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants)
    assert seconds < 60


def test_vmap_holds_one_copy_of_x_per_index(seed):
    n = CASE.scales["seed"]["n"]
    repro = seed[0].one("vmap")
    assert repro.temp == pytest.approx(n * 4 * n, rel=1e-3)


def test_memory_follows_the_examples_in_flight(seed):
    """Each variant within 1% of inputs + output + its in-flight copies of x."""
    result = seed[0]
    for name in ("vmap", "rolled", *(f"map-{k}" for k in vm.BATCH_SIZES)):
        r = result.one(name)
        assert r.total == pytest.approx(vm.floor_bytes(name, CASE.scales["seed"]["n"]), rel=0.01), (
            name
        )


def test_recommended_fix_saves_and_sits_near_its_floor(seed):
    result = seed[0]
    repro = max(result.select(role="reproduction"), key=lambda r: r.total)
    fix = result.one(vm.RECOMMENDED, **repro.params)
    assert repro.total / fix.total >= 1.5
    assert fix.overhead <= 1.25


def test_fixes_give_the_same_result():
    checks = runbook.verify("vmap-materialize", "tiny")
    fixes = {v.name for v in CASE.variants if v.role == "fix"}
    assert {c["name"] for c in checks} == fixes
    assert all(c["same"] for c in checks), checks


def test_same_result_check_catches_a_wrong_fix(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key

    def off_by_one(x, idx):
        return vm.set_and_sum_rewrite(x, idx) + 1e-2

    wrong = dataclasses.replace(CASE.variant("rewrite"), name="wrong", program=lambda p: off_by_one)
    monkeypatch.setattr(vm, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, wrong)))
    checks = runbook.verify("vmap-materialize", "tiny")
    assert [c["same"] for c in checks if c["name"] == "wrong"] == [False]


def test_python_loop_computes_the_same():
    x, idx = vm._inputs(CASE.scales["tiny"], {}, True)
    got = vm.python_loop(x, list(idx[:50]))
    want = vm.set_and_sum(x, idx[:50])
    assert abs(got - want).max() <= 1e-5 * (abs(want).max() + 1)


def test_runs_agree_with_predictions_and_measure_the_loop(runs):
    assert {p.name for p in runs["peaks"]} == {v.name for v in CASE.variants}
    assert all(p.agrees for p in runs["peaks"]), runs["peaks"]
    small, medium = (runs["versus"][s] for s in page.LOOP_SCALES)
    # vmap's real peak grows with n squared: about 4x from n to 2n.
    assert medium[0].measured / small[0].measured > 3
    assert runs["loop"]["calls"] == CASE.scales[CASE.runnable_scale]["n"]


def test_pairwise_report_builds_the_n_n_d_array(pairwise):
    s = page.PAIRWISE["seed"]
    first = pairwise[0]["largest"]
    assert first.shape == f"f32[{s['n']},{s['n']},{s['d']}]"
    # lax.map over the masks keeps it: it does not depend on the mask.
    assert pairwise[1]["largest"].shape == first.shape
    # The matrix product with lax.map is the smallest.
    totals = [c["report"].total for c in pairwise]
    assert totals[-1] == min(totals)


def test_pairwise_rewrites_give_the_same_result():
    checks = page.pairwise_checks()
    assert len(checks) == len(page.pairwise_programs()) - 2
    assert all(c["same"] for c in checks), checks


def test_claims_on_a_target_decide_run_time_as_not_measurable(verdicts):
    found = {c.key: c for c in page.claims(target="h100")}
    assert set(found) == set(verdicts)
    assert found["forty-gb"].verdict == "confirmed"
    assert found["map-slower"].verdict == "not reproducible here"


def test_tables_and_figure(seed, runs, pairwise):
    result = seed[0]
    assert [row[0] for row in page.reports_table(result, pairwise).rows] == list(page.REPORTS)
    assert len(page.loop_table(runs).rows) == len(CASE.variants) + 1
    assert len(page.versus_table(runs).rows) == len(page.LOOP_SCALES)
    assert len(page.pairwise_table(pairwise, page.pairwise_checks()).rows) == len(pairwise)
    fig = page.tradeoff_figure(result, runs)
    assert len(fig.axes) == 2
    assert len(fig.axes[0].lines[0].get_xdata()) == len(vm.BATCH_SIZES) + 2


def test_detector_names_the_case_and_links_the_fix():
    x, idx = vm._inputs(CASE.scales["seed"], {}, False)
    d = runbook.diagnose(vm.set_and_sum, x, idx, measure_fixes=False)
    assert d.findings[0].case == "vmap-materialize"
    assert d.findings[0].copy == "runbook.cases.vmap_materialize.set_and_sum_mapped"
    fixed = runbook.diagnose(functools.partial(vm.set_and_sum_mapped, batch_size=100), x, idx)
    assert not [f for f in fixed.findings if f.case == "vmap-materialize"]


def test_cli_json(capsys):
    assert main(["run", "vmap-materialize", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "vmap-materialize"
    assert {v["role"] for v in data["variants"]} == {"reproduction", "fix"}
    for v in data["variants"]:
        b = v["bytes"]
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert v["lower_bound"] > 0
