"""frozen-params: every verdict, every fix's result, the issue's targets."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

import runbook
from runbook._cli import main
from runbook.cases import frozen_params
from runbook.cases._setup import frozen_params as setup
from runbook.cases.frozen_params import CASE
from runbook.site import frozen_params as page


@pytest.fixture(scope="module")
def seed(timed):
    return timed("frozen-params")


@pytest.fixture(scope="module")
def costs():
    return page.zero_costs()


@pytest.fixture(scope="module")
def verdicts(seed, costs):
    stored = page.stored_for_backward()
    return {c.key: c.verdict for c in page.claims(seed[0], costs, stored)}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("frozen-params")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants) * len(frozen_params.PROGRAMS)
    assert seconds < 60


def test_returned_gradient_holds_zeros_the_size_of_the_frozen_weights(seed):
    result = seed[0]
    frozen = setup.sizes(CASE.scales["seed"])["frozen"]
    repro = result.one("stop-gradient", program="gradient")
    fix = result.one("trainable-only", program="gradient")
    assert repro.output - fix.output == pytest.approx(frozen, rel=0.01)
    assert repro.temp == fix.temp


def test_zeros_leave_only_through_the_output(costs):
    kept = [c["label"] for c in costs if c["zeros"]]
    assert kept == ["returned from jit"]
    assert costs[0]["frozen_sized"][0].kind == "output"
    assert all(c["extra"] == 0 for c in costs[1:-1])
    assert costs[-1]["extra"] > 2 * setup.sizes(CASE.scales["seed"])["frozen"]


def test_recommended_fix_saves_and_sits_near_its_floor(seed):
    result = seed[0]
    repro = max(result.select(role="reproduction"), key=lambda r: r.total)
    fix = result.one(page.RECOMMENDED, **repro.params)
    assert fix.total == min(r.total for r in result.select(role="fix", **repro.params))
    assert repro.total / fix.total >= 1.5
    assert fix.overhead <= 1.25
    gradient = result.one(page.RECOMMENDED, program="gradient")
    assert gradient.overhead <= 1.25


def test_masked_train_step_costs_what_adapters_only_costs(seed):
    result = seed[0]
    masked = result.one("masked", program="train step")
    assert masked.total == result.one("trainable-only", program="train step").total


def test_fixes_give_the_same_value_gradient_and_update():
    checks = runbook.verify("frozen-params", "tiny")
    fixes = {v.name for v in CASE.variants if v.role == "fix"}
    assert {c["name"] for c in checks} == fixes
    assert len(checks) == len(fixes) * len(frozen_params.PROGRAMS)
    assert all(c["same"] for c in checks), checks


def test_same_result_check_catches_a_wrong_update(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key

    def wrong_step(params, opt_state, x, y):
        new, state, value = frozen_params.step_trainable(params, opt_state, x, y)
        return jax.tree.map(lambda p: 1.01 * p, new), state, value

    wrong = dataclasses.replace(
        CASE.variant("trainable-only"),
        name="wrong",
        program=frozen_params._program(frozen_params.grad_trainable, wrong_step),
    )
    monkeypatch.setattr(
        frozen_params, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, wrong))
    )
    checks = runbook.verify("frozen-params", "tiny")
    assert [c["same"] for c in checks if c["name"] == "wrong"] == [True, False]


def test_comparable_keeps_the_adapters_part():
    value, grads = 1.0, {"frozen": {"w": 0}, "lora": {"a": 2, "b": 3}}
    assert setup.comparable((value, grads)) == (1.0, {"a": 2, "b": 3})
    assert setup.comparable((value, {"a": 2, "b": 3})) == (1.0, {"a": 2, "b": 3})
    assert setup.comparable(("params", "state", 1.0)) == ("params", 1.0)


def test_tables_cover_every_variant_and_report(seed, costs):
    result = seed[0]
    table = page.fix_table(result)
    assert len(table.rows) == len(CASE.variants) * len(frozen_params.PROGRAMS)
    assert len(page.zeros_table(costs).rows) == len(costs)
    stored = {"stopped branch": 1, "stopped weights": 1, "stopped weights, weights": 0}
    reports = page.reports_table(result, costs, stored)
    assert [row[0] for row in reports.rows] == list(page.REPORTS)


def test_cli_json(capsys):
    assert main(["run", "frozen-params", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "frozen-params"
    assert {v["role"] for v in data["variants"]} == {"baseline", "reproduction", "fix"}
    assert {v["params"]["program"] for v in data["variants"]} == set(frozen_params.PROGRAMS)
    for v in data["variants"]:
        b = v["bytes"]
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert v["lower_bound"] > 0


def test_offloading_the_activations_is_trainable_remat_on_cpu(seed):
    # XLA:CPU has one memory: the offload policy stores the layers' inputs where remat does.
    result = seed[0]
    for program in frozen_params.PROGRAMS:
        offload = result.one(page.OFFLOADED, program=program)
        assert offload.total == result.one("trainable-remat", program=program).total
        assert offload.host_total == 0


def test_offloading_moves_every_layer_input_to_the_host_for_a_gpu():
    from runbook import _targets

    if why := _targets.unavailable("h100"):
        pytest.skip(why)
    result = runbook.measure_case(
        "frozen-params", "seed", target="h100", variants=[page.OFFLOADED, page.RECOMMENDED]
    )
    sizes = setup.sizes(CASE.scales["seed"])
    for program in frozen_params.PROGRAMS:
        offload = result.one(page.OFFLOADED, program=program)
        kept = result.one(page.RECOMMENDED, program=program)
        assert offload.host_total == sizes["layers"] * sizes["carry"]
        assert kept.total - offload.total >= 0.9 * offload.host_total
        assert offload.lower_bound <= offload.total <= 1.25 * offload.lower_bound
        # the device floor leaves out exactly what the host holds
        assert kept.lower_bound - offload.lower_bound == offload.host_total
    table = page.offload_table(["h100"])
    assert len(table.rows) == len(frozen_params.PROGRAMS)
