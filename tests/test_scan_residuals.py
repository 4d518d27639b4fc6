"""scan-residuals: every verdict, every fix's result, the issue's targets."""

from __future__ import annotations

import json
import math

import jax
import pytest

import runbook
import runbook.site
from runbook._cli import main
from runbook.cases import scan_residuals
from runbook.cases._setup import scan_residuals as scan_setup
from runbook.cases.scan_residuals import CASE
from runbook.site import scan_residuals as page


@pytest.fixture(scope="module")
def seed(timed):
    return timed("scan-residuals")


@pytest.fixture(scope="module")
def verdicts(seed):
    return {c.key: c.verdict for c in page.claims(seed[0])}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("scan-residuals")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants) * len(scan_residuals.STEPS)
    assert seconds < 60


def per_step(result, name, t):
    carry = scan_setup.carry_bytes(CASE.scales["seed"])
    return result.one(name, steps=t).temp / carry / t


def test_gradient_stores_what_jax_saves_per_step_and_body_remat_one(seed):
    # How many residuals JAX saves per step is the release's (see carries_by_release): the
    # compiled gradient holds one carry-sized row for each, and body remat holds one.
    result, t = seed[0], max(scan_residuals.STEPS)
    tiny = scan_setup._args(CASE.scales["tiny"], {"steps": 16}, False)
    saved = len(page.saved_residuals(scan_residuals.loss, *tiny))
    assert saved >= 2
    assert per_step(result, "grad", t) == pytest.approx(saved, abs=0.05)
    assert per_step(result, "remat-body", t) == pytest.approx(1, abs=0.05)
    assert per_step(result, "remat-policy", t) == pytest.approx(2, abs=0.05)


def test_carries_by_release_reads_every_committed_release():
    rows = page.carries_by_release().rows
    assert [r[0] for r in rows] == [r["jax"] for r in runbook.site.load_versions()]
    assert all(float(r[1]) >= 2 for r in rows if r[1] != "-")


def test_fori_loop_and_whole_remat_change_nothing(seed):
    result = seed[0]
    for t in scan_residuals.STEPS:
        grad = result.one("grad", steps=t).total
        assert result.one("grad-fori", steps=t).total == grad
        assert result.one("remat-whole", steps=t).total == pytest.approx(grad, rel=1e-3)


def test_recommended_fix_saves_and_sits_near_its_floor(seed):
    result = seed[0]
    repro = page.worst(result)
    assert repro.params["steps"] == max(scan_residuals.STEPS)
    fix = result.one(scan_residuals.RECOMMENDED, **repro.params)
    assert fix.total == min(r.total for r in result.select(role="fix", **repro.params))
    assert repro.total / fix.total >= 1.5
    assert fix.overhead <= 1.25


def test_floor_counts_the_carries_each_strategy_must_store():
    assert scan_setup.saved_carries("grad", 4096) == 4096
    assert scan_setup.saved_carries("remat-nested", 4096) == 2 * math.isqrt(4096)
    assert scan_setup.saved_carries("forward", 4096) == 0


def test_saved_residuals_name_the_stacked_arrays():
    scale = CASE.scales["tiny"]
    args = scan_setup._args(scale, {"steps": 16}, False)
    stacked = 16 * scan_setup.carry_bytes(scale)
    grad = page.saved_residuals(scan_residuals.loss, *args)
    body = page.saved_residuals(scan_residuals.loss_remat_body, *args)
    assert [size for _, size, _ in grad] == [stacked] * len(grad)
    assert len(grad) >= 2
    assert [size for _, size, _ in body] == [stacked]
    assert all("scan_residuals.py" in origin for _, _, origin in grad)
    table = page.residual_table(scan_residuals.loss, *args)
    assert table.rows[-1][:2] == ["total", runbook.fmt_bytes(len(grad) * stacked)]


def test_fixes_give_the_same_value_and_gradient():
    checks = runbook.verify("scan-residuals", "tiny")
    fixes = {v.name for v in CASE.variants if v.role == "fix"}
    assert {c["name"] for c in checks} == fixes
    assert all(c["same"] for c in checks), checks


def test_nested_segments_must_divide_the_steps():
    args = scan_setup._args(CASE.scales["tiny"], {"steps": 16}, True)
    with pytest.raises(ValueError, match="`segments`"):
        scan_residuals.loss_nested(*args, segments=3)
    value = scan_residuals.loss_nested(*args, segments=2)
    assert value == pytest.approx(float(scan_residuals.loss(*args)), rel=1e-5)


def test_layers_with_whole_remat_compute_the_same():
    w, h0, xs = scan_setup._args(CASE.scales["tiny"], {"steps": 16}, True)
    ws = jax.numpy.stack([w, -w])
    plain = jax.value_and_grad(page.loss_layers)(ws, h0, xs)
    wrapped = jax.value_and_grad(lambda *a: page.loss_layers(*a, whole=True))(ws, h0, xs)
    assert jax.numpy.allclose(plain[0], wrapped[0])
    assert jax.numpy.allclose(plain[1], wrapped[1], atol=1e-5)


def test_tables_cover_every_variant_and_report(seed):
    result = seed[0]
    assert [row[0] for row in page.fix_table(result).rows] == [v.name for v in CASE.variants]
    assert len(page.growth_table(result).rows) == len(CASE.variants)
    reports = page.reports_table(result, page.measure_layers(steps=64))
    assert [row[0] for row in reports.rows] == list(page.REPORTS)
    assert page.report_link("jax-ml/jax#3186") == ("https://github.com/jax-ml/jax/issues/3186")


def test_cli_json(capsys):
    assert main(["run", "scan-residuals", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "scan-residuals"
    assert {v["role"] for v in data["variants"]} == {"baseline", "reproduction", "fix"}
    for v in data["variants"]:
        b = v["bytes"]
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert v["lower_bound"] > 0
    biggest = max(v["bytes"]["total"] for v in data["variants"])
    assert biggest > 64 * 2**30  # the seed scale, never allocated


def test_offloading_the_carries_is_remat_body_on_cpu(seed):
    # XLA:CPU has one memory: the offload policy saves the carries where remat-body does.
    result = seed[0]
    for t in scan_residuals.STEPS:
        assert result.one("offload-carry", steps=t).total == result.one("remat-body", steps=t).total


def test_offloading_the_carries_moves_every_one_to_the_host_for_a_gpu():
    from runbook import _targets

    if why := _targets.unavailable("h100"):
        pytest.skip(why)
    t = max(scan_residuals.STEPS)
    result = runbook.measure_case(
        "scan-residuals", "seed", target="h100", variants=["offload-carry", "remat-nested"],
        at={"steps": t},
    )  # fmt: skip
    offload, nested = result.one("offload-carry", steps=t), result.one("remat-nested", steps=t)
    carry = scan_setup.carry_bytes(CASE.scales["seed"])
    assert offload.host_total == t * carry
    assert offload.total < nested.total
    assert offload.lower_bound <= offload.total <= 1.25 * offload.lower_bound
