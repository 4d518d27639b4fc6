"""host-offloading: device and host bytes on each compiler, the floor, the same-result check,
the claims and the detector on programs written differently."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import runbook
from runbook import _targets
from runbook.cases import host_offloading as ho
from runbook.cases.host_offloading import CASE
from runbook.site import host_offloading as page

SEED = CASE.scales["seed"]
AT = {"layers": max(SEED["layers"])}


def _need(target):
    if target and _targets.unavailable(target):
        pytest.skip(_targets.unavailable(target))


@pytest.fixture(scope="module")
def h100():
    _need("h100")
    return runbook.measure_case("host-offloading", "seed", target="h100")


def test_verdicts_are_the_ones_this_release_recorded(recorded):
    assert {c.key: c.verdict for c in page.claims()} == recorded("host-offloading")


def test_on_cpu_nothing_is_kept_apart_in_host_memory():
    result = runbook.measure_case("host-offloading", "seed")
    assert all(not r.host for r in result.reports)
    # Offloading the inputs builds what plain remat builds: one memory holds both.
    assert result.one("offload-input", **AT).total == result.one("remat", **AT).total


def test_for_a_gpu_the_wrong_name_moves_nothing_and_the_right_one_moves_the_inputs(h100):
    trap, remat = h100.one("offload-output", **AT), h100.one("remat", **AT)
    fix = h100.one(CASE.recommended, **AT)
    assert not trap.host
    assert trap.total == remat.total
    # Each layer's input but the first (the argument itself) goes to host memory.
    b, t, d = SEED["batch"], SEED["tokens"], SEED["hidden"]
    assert fix.host_total >= (AT["layers"] - 1) * b * t * d * 2
    assert trap.total >= 1.5 * fix.total
    assert fix.total <= 1.25 * fix.lower_bound


def test_every_variant_is_at_or_above_its_floor_for_a_gpu(h100):
    for report in h100.reports:
        assert report.total >= report.lower_bound, report.name


def test_the_same_result_check_passes_for_the_fixes_and_can_fail():
    checks = runbook.verify("host-offloading", scale="tiny")
    assert checks
    assert all(c["same"] for c in checks), checks
    # The gradient of a stack one layer shorter is told apart.
    weights, x = CASE.args(CASE.scales["tiny"], {"layers": 2}, True)
    want = jax.value_and_grad(ho.loss)(weights, x)
    short = jax.tree.map(lambda w: w[:1], weights)
    got = jax.value_and_grad(ho.loss)(short, x)
    assert not np.allclose(np.asarray(want[0]), np.asarray(got[0]), rtol=CASE.tolerance)


def test_the_claims_for_a_gpu():
    _need("h100")
    found = {c.key: c.verdict for c in page.claims(target="h100")}
    assert found == {
        "offload-moves": "confirmed",
        "wrong-name-23869": "confirmed",
        "offload-dots": "confirmed",
    }


def _cases(diagnosis):
    return [f.case for f in diagnosis.findings]


def test_the_detector_names_the_trap_for_a_gpu_only():
    _need("h100")
    params = {"layers": min(SEED["layers"])}
    args = CASE.inputs(CASE.variant("offload-output"), SEED, params, False)
    trap = jax.jit(CASE.variant("offload-output").program(params))
    fix = jax.jit(CASE.variant(CASE.recommended).program(params))
    assert "host-offloading" in _cases(runbook.diagnose(trap, *args, target="h100"))
    assert "host-offloading" not in _cases(runbook.diagnose(fix, *args, target="h100"))
    assert "host-offloading" not in _cases(runbook.diagnose(trap, *args))
    # Plain remat asks for no offloading.
    remat = jax.jit(CASE.variant("remat").program(params))
    assert "host-offloading" not in _cases(runbook.diagnose(remat, *args, target="h100"))


def test_a_tpu_keeps_the_offloaded_values_in_host_memory_too():
    _need("v5e")
    result = runbook.measure_case("host-offloading", "seed", target="v5e", at=AT)
    assert result.one(CASE.recommended, **AT).host_total > 0
    assert not result.one("offload-output", **AT).host


def test_scan_residuals_counts_no_device_bytes_for_a_stack_offloaded_to_the_host():
    # The offloaded stack is written by an async dynamic-update-slice into host memory
    # (`S(5)` in its layout): none of it is the device's.
    from runbook._program import Program
    from runbook.detectors import scan_residuals

    _need("h100")
    t = _targets.require("h100")
    params = {"layers": min(SEED["layers"])}
    held = {}
    for name in ("remat", CASE.recommended):
        v = CASE.variant(name)
        with _targets.compiling_for(t):
            program = Program.compile(
                v.program(params), *CASE.inputs(v, SEED, params, False), target=t, name=name
            )
        stacks = scan_residuals.stacks(program)
        assert stacks
        held[name] = scan_residuals.held(program, stacks)
        assert held[name] <= program.report.temp
    assert held["remat"] > 0
    assert held[CASE.recommended] == 0
