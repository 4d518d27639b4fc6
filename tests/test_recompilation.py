"""recompilation: the real runs' figures, every verdict, the fixes' results, the targets."""

from __future__ import annotations

import dataclasses
import json
import resource

import jax
import numpy as np
import pytest

import runbook
from runbook._case import CaseResult
from runbook._cli import main
from runbook.cases import recompilation
from runbook.cases.recompilation import CASE, bucket
from runbook.runs import recompilation as runs
from runbook.runs.recompilation import row_counts
from runbook.site import recompilation as page

KEY = page.KEY_FIGURE
SEED = CASE.scales["seed"]
CALLS = SEED["calls"]


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.fixture(scope="module")
def seed(timed):
    cpu = _cpu_seconds()
    result, seconds = timed("recompilation")
    return result, seconds, _cpu_seconds() - cpu


@pytest.fixture(scope="module")
def figures(seed):
    return {r.name: r.figures for r in seed[0].reports}


@pytest.fixture(scope="module")
def verdicts(seed):
    return {c.key: c.verdict for c in page.claims(seed[0])}


# What clear_caches() leaves behind is a resident-set residue that moves from run to run: on
# jax 0.10.2 it fell below the claim's line in one run and above it in the next. Its verdict
# is shown per release, not pinned.
UNSTEADY = {"clear-caches-leaves"}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, check_recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    check_recorded("recompilation", verdicts, UNSTEADY)


def test_whole_case_measured_within_a_minute(seed):
    result, seconds, cpu = seed
    assert len(result.reports) == len(CASE.variants)
    for r in result.reports:
        assert set(r.figures) == set(runs.FIGURES)
    # Four fresh processes each compile a loop's executables. The machine running this suite
    # is shared, so wall time says more about the neighbours than about the case: the bar
    # is checked on the processor time this process and its children used.
    assert cpu < 60, (seconds, cpu)


def test_compilations_follow_the_distinct_keys(figures):
    buckets = len({bucket(r) for r in row_counts(CALLS)})
    counts = {name: f["compile_count"] for name, f in figures.items()}
    assert counts == {"each-shape": CALLS, "bucketed": buckets, "each-static": CALLS,
                      "traced-static": 1}  # fmt: skip
    assert buckets < CALLS / 2


def test_growth_follows_the_compilations(seed):
    result = seed[0]
    points = page.checkpoints(result, "each-shape")
    assert points[0][0] == 1
    assert points[-1][0] == CALLS
    assert [c for _, c, _ in points] == [i for i, _, _ in points]  # one compile per step
    assert points[-1][2] > points[len(points) // 2][2] > 0
    flat = page.checkpoints(result, "traced-static")
    assert {c for _, c, _ in flat} == {1}


def test_recommended_fix_saves_by_the_key_figure_and_sits_near_its_floor(seed, figures):
    for repro, fix in page.PAIRS:
        assert figures[repro][KEY] / figures[fix][KEY] >= 1.5, (repro, fix, figures)
    floor = recompilation.floor_bytes(SEED, CALLS)
    for r in seed[0].reports:
        assert r.lower_bound == floor
        assert floor <= r.total <= 1.25 * floor, r.name


def test_compile_time_totals_are_close_while_the_runs_differ(seed, figures):
    result = seed[0]
    totals = result.one("each-shape").total / result.one(page.RECOMMENDED).total
    assert 0.8 <= totals <= 1.25
    assert figures["each-shape"][KEY] / figures[page.RECOMMENDED][KEY] >= 1.5 * totals


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_floor_holds_on_the_targets(target):
    result = runbook.measure_case("recompilation", "seed", target=target)
    assert len(result.reports) == len(CASE.variants)
    for r in result.reports:
        assert not r.figures  # a target has no run
        assert r.lower_bound <= r.total, (target, r.name)
    fix = result.one(page.RECOMMENDED)
    assert fix.total <= 1.25 * fix.lower_bound


def test_loops_give_the_same_losses():
    tiny = CASE.scales["tiny"]
    shapes = {v: runs.run_loop(v, tiny, 6) for v in ("each-shape", "bucketed")}
    np.testing.assert_allclose(shapes["bucketed"], shapes["each-shape"], rtol=1e-5)
    statics = {v: runs.run_loop(v, tiny, 4) for v in ("each-static", "traced-static")}
    np.testing.assert_allclose(statics["traced-static"], statics["each-static"], rtol=1e-5)
    assert len(set(statics["each-static"])) == 4  # the temperature changes the loss


def test_fix_gives_the_same_loss():
    checks = runbook.verify("recompilation", "tiny")
    assert [c["name"] for c in checks] == ["bucketed", "traced-static"]
    assert all(c["same"] for c in checks), checks


def test_same_result_check_catches_a_wrong_mask(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key
    wrong = dataclasses.replace(
        CASE.variant("bucketed"),
        name="wrong",
        program=lambda p: jax.jit(lambda w, x, n: recompilation.masked_loss(w, x, n - 1)),
    )
    monkeypatch.setattr(
        recompilation, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, wrong))
    )
    checks = runbook.verify("recompilation", "tiny")
    assert {c["name"]: c["same"] for c in checks} == {
        "bucketed": True, "traced-static": True, "wrong": False}  # fmt: skip


def test_buckets_and_padding():
    assert [bucket(r) for r in (1, 2, 3, 5, 8, 9, 24)] == [1, 2, 4, 8, 8, 16, 32]
    x = np.ones((5, 3), np.float32)
    padded = recompilation.pad_rows(x, 8)
    assert padded.shape == (8, 3)
    assert padded[5:].sum() == 0
    assert padded[:5].sum() == 15
    assert sorted(row_counts(7)) == list(range(1, 8))
    needed = runs.rows_needed("bucketed", CALLS, CALLS)
    assert needed == CALLS * (CALLS + 1) // 2
    assert runs.rows_computed("bucketed", CALLS, CALLS) > needed
    assert runs.rows_computed("each-shape", CALLS, CALLS) == needed


def test_watched_loop_marks_each_step_and_compiles_per_new_shape():
    runs.count_compiles()
    for variant, expected in (("each-shape", 4), ("traced-static", 0)):
        marks = []
        before = runs.compiles()
        page.watched_loop(variant, 5, lambda marks=marks: marks.append(runs.compiles()))
        assert len(marks) == 5
        assert marks[0] > before  # the first step compiled (putting the weights may, too)
        assert marks[-1] - marks[0] == expected, variant  # each later step: a new shape


def test_a_scale_past_the_memory_is_refused(monkeypatch):
    monkeypatch.setattr(runs, "_available", lambda: 2 * runs.EXECUTABLE_BOUND)
    with pytest.raises(runbook.WontFitError, match="smaller scale"):
        runs._guard(SEED)
    runs._guard({"calls": 1})


def test_static_objects_hashed_by_identity_compile_each_time():
    found = page.static_objects()
    assert found == {"steps": 3, "identity": 3, "value": 1}


def test_explain_misses_names_the_shapes_where_this_jax_has_it():
    misses = page.explain_misses()
    if not hasattr(jax.config, "jax_explain_cache_misses"):
        assert misses == {"each-shape": "", "each-static": ""}
        return
    lines = page.miss_lines(misses["each-shape"]).splitlines()
    assert len(lines) == 2  # three steps: the first is the function's first call
    width = CASE.scales["tiny"]["features"]
    assert all(f",{width}]" in line for line in lines)


def test_tables_and_chart_cover_every_variant_and_report(seed):
    result = seed[0]
    assert [row[0] for row in page.reports_table(result).rows] == list(page.REPORTS)
    assert len(page.figures_table(result).rows) == len(CASE.variants)
    assert len(page.cost_table(result).rows) == len(page.PAIRS)
    fig = page.growth_chart(result)
    left, right = fig.axes
    assert len(right.lines) == len(CASE.variants)
    assert len(left.lines) >= len(CASE.variants)  # and a mark per clear_caches()
    table = page.targets_table({"cpu": result})
    assert len(table.rows) == len(CASE.variants)


def test_claims_need_real_run_figures(seed):
    stripped = dataclasses.replace(
        seed[0], reports=tuple(dataclasses.replace(r, figures={}) for r in seed[0].reports)
    )
    with pytest.raises(runbook.RunbookError, match="real-run figures"):
        page.claims(stripped)


def test_claims_are_not_decided_for_a_target():
    with pytest.raises(runbook.RunbookError, match="h100"):
        page.claims(target="h100")


def test_claims_decided_by_the_runs(seed, verdicts):
    # The verdicts that follow from counts, not from noisy sizes: pinned on every release.
    assert verdicts["compiles-per-shape"] == "confirmed"
    assert verdicts["static-float"] == "confirmed"
    assert verdicts["traced-once"] == "confirmed"
    assert verdicts["buckets-bound"] == "confirmed"
    assert verdicts["padding-free"] == "refuted"
    assert verdicts["cache-grows"] == "confirmed"
    assert verdicts["analysis-shows"] == "refuted"
    assert verdicts["gpu-device-memory"] == "not reproducible here"
    assert verdicts["static-identity"] == "refuted"
    assert set(verdicts) >= {"delete-frees", "clear-caches", "explain-misses", "explain-static"}


def test_figures_round_trip_through_json(seed):
    data = seed[0].to_json()
    back = CaseResult.from_json(json.loads(json.dumps(data)))
    assert [r.figures for r in back.reports] == [r.figures for r in seed[0].reports]


def test_cli_json_prints_the_figures(seed, capsys):
    assert main(["run", "recompilation", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "recompilation"
    assert {v["role"] for v in data["variants"]} == {"reproduction", "fix"}
    got = {v["name"]: v["figures"] for v in data["variants"]}
    assert set(got) == {v.name for v in CASE.variants}
    for f in got.values():
        assert set(f) == set(runs.FIGURES)
        assert isinstance(f["compile_count"], int)
        assert isinstance(f["loop_seconds"], float)
    assert got["each-shape"][KEY] / got[page.RECOMMENDED][KEY] >= 1.5
