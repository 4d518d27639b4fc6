"""live-references: the live bytes of real runs, the verdicts, the fixes' result, the floor
on every target, the watched loop and the CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json

import jax
import pytest

import runbook
import runbook.site
from runbook._cli import main
from runbook.cases import live_references
from runbook.cases.live_references import CASE, LOOPS, param_bytes
from runbook.runs import live_references as runs
from runbook.site import live_references as page

KEY = page.KEY_FIGURE
SEED = CASE.scales["seed"]
ONE = param_bytes(SEED)
STEPS = SEED["steps"]


@pytest.fixture(scope="module")
def seed(timed):
    return timed("live-references")


@pytest.fixture(scope="module")
def figures(seed):
    return {r.name: r.figures for r in seed[0].reports}


@pytest.fixture(scope="module")
def verdicts(seed):
    return {c.key: c.verdict for c in page.claims(seed[0])}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    assert verdicts == recorded("live-references")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants)
    assert seconds < 60
    for r in result.reports:
        assert set(r.figures) == set(runs.FIGURES)


def test_reproductions_grow_by_a_parameter_copy_per_step(figures):
    for name in ("keep-arrays", "cache-arrays", "cycle"):
        f = figures[name]
        # One copy of the parameters per step after the first, and a scalar loss or none.
        assert (STEPS - 1) * ONE <= f["live_growth"] <= (STEPS - 1) * (ONE + 64), name
        assert f["live_per_step"] == f["live_growth"] // (STEPS - 1)
        assert f["live_after_collect"] == 0, name


def test_fixes_stay_flat_and_the_bar_holds(figures):
    repro = figures["keep-arrays"][KEY]
    for name in ("keep-floats", "cycle-broken"):
        f = figures[name]
        assert f["live_growth"] == 0, name
        assert f["live_first_step"] <= 64, name  # the last step's loss at most
        assert f["live_after_loop"] == 0, name
    assert figures[page.RECOMMENDED][KEY] * 1.5 <= repro


def test_what_each_holder_keeps_after_the_loop(figures):
    k, c, y = figures["keep-arrays"], figures["cache-arrays"], figures["cycle"]
    assert k["live_after_loop"] >= (STEPS - 1) * ONE  # the log returned keeps them
    assert k["live_after_drop"] == 0  # dropped: freed by reference counting at once
    assert c["live_after_loop"] == 0  # the cache went with the loop's closure
    assert y["live_after_drop"] >= STEPS * ONE  # unreachable, still alive: the cycles
    assert y["live_after_collect"] == 0


def test_compile_time_totals_are_the_same_and_hold_the_floor_on_every_target(seed, measured_here):
    floor = live_references.floor_bytes(SEED)
    results = {"cpu": seed[0]}
    for target in ("h100", "v5e"):
        results[target], seconds = measured_here("live-references", target)
        assert seconds < 60, target
    for where, result in results.items():
        totals = {r.name: r.total for r in result.reports}
        assert len(set(totals.values())) == 1, (where, totals)  # one program for all
        for r in result.reports:
            assert r.lower_bound == floor
            assert r.total >= floor, (where, r.name)
        fix = result.one(page.RECOMMENDED)
        assert fix.total <= 1.25 * floor, where


def test_fixes_give_the_same_result(seed):
    rows = page.same_result()
    assert [r["name"] for r in rows] == ["keep-floats", "cycle-broken"]
    assert all(r["same"] for r in rows), rows
    assert runbook.site.verify_table(rows, "live-references").rows[0][-1] == "yes"


def test_same_result_check_catches_a_wrong_loop(monkeypatch):
    def wrong(params, steps, on_step=None):
        p, log = live_references.train_keep_floats(params, steps, on_step)
        return p * 1.01, log

    monkeypatch.setitem(LOOPS, "keep-floats", wrong)
    got = runs._runs_json(256, 4, False)  # in this process: it sees the patched loop
    rows = {r["name"]: r["same"] for r in page.checks(got["errors"], 4)}
    assert rows == {"keep-floats": False, "cycle-broken": True}


def test_a_scale_that_would_not_fit_is_refused():
    with pytest.raises(runbook.WontFitError):
        runs.check_fits({"size": 2**30, "steps": 10**4})


def test_watched_loop_marks_every_step_and_reuses_the_case_loops(monkeypatch):
    marks = []
    page.watched_loop("keep-floats", 3, lambda: marks.append(1))
    assert len(marks) == 3
    calls = []
    monkeypatch.setitem(LOOPS, "cycle", lambda p, steps, on_step: calls.append(steps))
    page.watched_loop("cycle", 2, lambda: None)
    assert calls == [2]
    with pytest.raises(runbook.RunbookError, match="unknown variant"):
        page.watched_loop("nope", 1, lambda: None)


def test_watched_reproduction_grows_between_marks():
    live = []
    page.watched_loop(
        "keep-arrays", 4, lambda: live.append(sum(a.nbytes for a in jax.live_arrays()))
    )
    assert [b - a for a, b in itertools.pairwise(live)] == [ONE + 4] * 3


def test_loops_are_named_by_their_variants():
    assert set(LOOPS) == {v.name for v in CASE.variants}
    assert LOOPS["keep-arrays"] is live_references.train_keep_arrays
    assert LOOPS[page.RECOMMENDED] is live_references.train_keep_floats


def test_tables_and_chart_cover_every_variant_and_report(seed):
    result = seed[0]
    assert len(page.live_table(result).rows) == len(CASE.variants)
    assert [row[0] for row in page.reports_table(result).rows] == list(page.REPORTS)
    fig = page.live_chart(result)
    lines = fig.axes[0].get_lines()
    assert len(lines) == len(CASE.variants)
    assert all(len(line.get_xdata()) == STEPS for line in lines)


def test_each_claim_is_decided_and_the_guard_only_where_the_option_exists(verdicts):
    assert set(verdicts) == {
        "log-grows", "floats-flat", "drop-frees", "rebind-grows", "error-holds",
        "cycle-delays", "cache-holds", "loop-constant-leaks", "guard-names-cycle",
        "analysis-shows",
    }  # fmt: skip
    for key in ("log-grows", "floats-flat", "drop-frees", "cycle-delays", "cache-holds"):
        assert verdicts[key] == "confirmed", key
    assert verdicts["analysis-shows"] == "refuted"
    has_guard = hasattr(jax.config, "jax_array_garbage_collection_guard")
    assert (verdicts["guard-names-cycle"] == "not reproducible here") == (not has_guard)


def test_claims_need_live_figures(seed):
    stripped = dataclasses.replace(
        seed[0], reports=tuple(dataclasses.replace(r, figures={}) for r in seed[0].reports)
    )
    with pytest.raises(runbook.RunbookError, match="no real-run figures"):
        page.claims(stripped)


def test_claims_are_not_decided_for_a_target():
    with pytest.raises(runbook.RunbookError, match="h100"):
        page.claims(target="h100")


def test_cli_json_prints_the_figures(capsys, figures):
    assert main(["run", "live-references", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    got = {v["name"]: v["figures"] for v in data["variants"]}
    assert set(got) == {v.name for v in CASE.variants}
    assert got["keep-arrays"][KEY] >= (STEPS - 1) * ONE
    assert got[page.RECOMMENDED][KEY] == 0
