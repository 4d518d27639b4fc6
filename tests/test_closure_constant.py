"""closure-constant: every verdict, the host figures, the fix's result, the issue's targets."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import runbook
import runbook.site
from runbook._case import CaseResult
from runbook._cli import main
from runbook.cases import closure_constant
from runbook.cases.closure_constant import CASE
from runbook.runs import closure_constant as runs
from runbook.site import closure_constant as page

PEAK = page.KEY_FIGURE


@pytest.fixture(scope="module")
def seed(timed):
    return timed("closure-constant")


@pytest.fixture(scope="module")
def verdicts(seed):
    return {c.key: c.verdict for c in page.claims(seed[0])}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("closure-constant")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants)
    assert seconds < 60
    for r in result.reports:
        assert set(r.figures) == set(runs.FIGURES)


def test_memory_analysis_leaves_the_constant_out(seed):
    result = seed[0]
    table = closure_constant.sizes(CASE.scales["seed"])["table"]
    captured, passed = result.one("captured-random"), result.one("embed")
    assert captured.total < table < passed.total
    assert passed.argument - captured.argument == table
    report = runbook.measure(
        CASE.variant("captured-random").program(CASE.grid(CASE.scales["tiny"])[0]),
        *closure_constant._ids_only(CASE.scales["tiny"], {}, False),
        buffers=True,
    )
    assert page.constant_bytes(report) == 64 * 16 * 4


def test_lowered_text_holds_the_random_table_not_the_zeros(seed):
    f = {r.name: r.figures for r in seed[0].reports}
    table = closure_constant.sizes(CASE.scales["seed"])["table"]
    assert f["captured-random"]["lowered_text_bytes"] >= 2 * table  # hexadecimal
    assert f["captured-zeros"]["lowered_text_bytes"] < 2**20
    assert f["embed"]["lowered_text_bytes"] < 2**20


def test_recommended_fix_saves_and_sits_near_its_floor(seed):
    f = {r.name: r.figures for r in seed[0].reports}
    floor = closure_constant.floor_bytes(CASE.scales["seed"])
    fix = f[page.RECOMMENDED][PEAK]
    assert f["captured-random"][PEAK] / fix >= 1.5
    assert fix / floor <= 1.25
    assert seed[0].one(page.RECOMMENDED).overhead == pytest.approx(1.0)


def test_fix_gives_the_same_lookup():
    checks = runbook.verify("closure-constant", "tiny")
    assert [c["name"] for c in checks] == ["embed"]
    assert all(c["same"] for c in checks), checks


def test_same_result_check_catches_a_wrong_lookup(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key
    wrong = dataclasses.replace(
        CASE.variant("embed"),
        name="wrong",
        program=lambda p: jax.jit(lambda t, i: closure_constant.lookup(t, (i + 1) % t.shape[0])),
    )
    monkeypatch.setattr(
        closure_constant, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, wrong))
    )
    checks = runbook.verify("closure-constant", "tiny")
    assert {c["name"]: c["same"] for c in checks} == {"embed": True, "wrong": False}


def test_host_figures_see_a_captured_table_at_a_small_scale():
    small = CASE.scales["small"]
    params = CASE.grid(small)[0]
    table = closure_constant.sizes(small)["table"]
    captured = runs.host_figures(CASE.variant("captured-random"), small, params)
    passed = runs.host_figures(CASE.variant("embed"), small, params)
    assert captured["lowered_text_bytes"] >= 2 * table
    assert captured["rss_cached"] - captured["rss_inputs"] > table
    assert passed["rss_cached"] - passed["rss_inputs"] < table / 2


def test_control_flow_keeps_the_constant():
    rows = page.control_flow("tiny")
    table = rows[0]["table"]
    assert [r["constants"] >= table for r in rows] == [True, True, True]
    assert all(r["total"] < table + 2**20 for r in rows)


def test_lowered_constants_names_the_splat():
    zeros = closure_constant.make_lookup_captured(jnp.zeros((64, 16)))
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    rows = page.lowered_constants(zeros, ids).rows
    assert any("dense<0.000000e+00> : tensor<64x16xf32>" in r[1] for r in rows)


def test_tables_and_chart_cover_every_variant_and_report(seed):
    result = seed[0]
    assert len(page.host_table(result).rows) == len(CASE.variants)
    flow = [{"label": "x", "table": 1, "constants": 1, "lowered": 1, "total": 1}]
    reports = page.reports_table(result, flow)
    assert [row[0] for row in reports.rows] == list(page.REPORTS)
    assert len(page.predict(result).rows) == 2
    by = page.constants_by_compiler({"cpu": result})
    assert by.rows[0][0] == "cpu"
    fig = page.host_chart(result)
    assert len(fig.axes[0].patches) == 4 * len(CASE.variants)


def test_claims_need_host_figures(seed):
    stripped = dataclasses.replace(
        seed[0], reports=tuple(dataclasses.replace(r, figures={}) for r in seed[0].reports)
    )
    with pytest.raises(runbook.RunbookError, match="no real-run figures"):
        page.claims(stripped)


def test_claims_are_not_decided_for_a_target():
    with pytest.raises(runbook.RunbookError, match="h100"):
        page.claims(target="h100")


def test_figures_round_trip_through_json(seed):
    data = seed[0].to_json()
    back = CaseResult.from_json(json.loads(json.dumps(data)))
    assert [r.figures for r in back.reports] == [r.figures for r in seed[0].reports]
    record = seed[0].reports[0].to_record()
    assert runbook.MemoryReport.from_record(record).figures == seed[0].reports[0].figures


def test_cli_json(capsys):
    assert main(["run", "closure-constant", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "closure-constant"
    assert {v["role"] for v in data["variants"]} == {"baseline", "reproduction", "fix"}
    for v in data["variants"]:
        b = v["bytes"]
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert set(v["figures"]) == set(runs.FIGURES)


def test_cli_text_prints_the_figures(capsys):
    assert main(["run", "closure-constant", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "Measured beyond the compiler's analysis" in out
    assert PEAK in out


def test_landing_table_shows_the_real_run_here_and_says_what_targets_leave_out(monkeypatch):
    # The ratio of the real run the table made itself: two real runs differ by a little, and
    # a ratio near a rounding edge (3.35 on jax 0.12) would print differently from another.
    from runbook.site import _accelerator

    seen = []
    measure = _accelerator.on_targets

    def recorded(*args, **kwargs):
        seen.append(measure(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(_accelerator, "on_targets", recorded)
    html = str(runbook.site.case_table(["closure-constant"], compare=["h100"]))
    f = {r.name: r.figures[PEAK] for r in seen[0][_accelerator.CPU].reports}
    assert f"{f['captured-random'] / f['embed']:.1f}x less" in html
    assert f"({PEAK}, a real run)" in html
    assert "compile-time totals, which leave out" in html


def test_compilers_note_counts_where_the_total_misses_the_table(seed):
    result = seed[0]
    with_buffers = runbook.measure_case("closure-constant", "seed", buffers=True)
    note = page.compilers_note({"cpu": with_buffers})
    assert "on 1 of 1 compilers (cpu)" in note
    assert "every compiler folds them away" in note
    assert "on 0 of 1" in page.compilers_note({"cpu": result})  # no buffers read
