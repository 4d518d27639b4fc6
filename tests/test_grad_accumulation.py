"""grad-accumulation: what each way of accumulating holds on each compiler, the floor, the
same-result check, the claims and the detector on programs written differently."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import runbook
from runbook import _targets
from runbook.cases import grad_accumulation as ga
from runbook.cases.grad_accumulation import CASE
from runbook.site import grad_accumulation as page
from runbook.site._accelerator import worst_point

SEED = CASE.scales["seed"]
S = jax.ShapeDtypeStruct


def _need(target):
    if target and _targets.unavailable(target):
        pytest.skip(_targets.unavailable(target))


@pytest.fixture(scope="module")
def cpu():
    return runbook.measure_case("grad-accumulation", "seed")


def test_verdicts_are_the_ones_this_release_recorded(recorded, cpu):
    assert {c.key: c.verdict for c in page.claims(cpu)} == recorded("grad-accumulation")


@pytest.mark.parametrize("target", [None, "h100", "v5e"])
def test_at_the_worst_point_the_recommended_fix_is_far_below_and_near_its_floor(cpu, target):
    _need(target)
    result = (
        cpu
        if target is None
        else runbook.measure_case(
            "grad-accumulation", "seed", target=target, at={"batch": max(SEED["batch"])}
        )
    )
    at = worst_point(result)
    assert at["batch"] == max(SEED["batch"])  # the whole batch's activations grow with it
    repro, fix = result.one("full-batch", **at), result.one(CASE.recommended, **at)
    assert repro.total >= 1.5 * fix.total
    assert fix.total <= 1.25 * fix.lower_bound
    for report in result.reports:
        assert report.total >= report.lower_bound, report.name


def test_multisteps_carries_an_accumulator_the_size_of_the_parameters(cpu):
    at = worst_point(cpu)
    plain, multi = cpu.one("micro-batch", **at), cpu.one("multisteps", **at)
    extra = multi.argument - plain.argument
    assert page.parameter_bytes() <= extra <= page.parameter_bytes() + 64
    # The scan holds the same sum as a temporary; in bfloat16, half of it.
    f32, b16 = cpu.one("scan-f32", **at), cpu.one("scan-bf16", **at)
    assert f32.total - b16.total == page.parameter_bytes() // 2


def test_the_same_result_check_passes_for_the_fixes_and_can_fail(monkeypatch):
    checks = runbook.verify("grad-accumulation", scale="tiny")
    assert {c["name"] for c in checks} == {"multisteps", "scan-f32", "scan-bf16"}
    assert all(c["same"] for c in checks), checks
    # bfloat16 rounds each micro-batch's gradient: its error shows, within the tolerance.
    errors = {c["name"]: c["max_rel_error"] for c in checks}
    assert errors["scan-f32"] < 1e-6 < errors["scan-bf16"]
    # A sum of the micro-batches' gradients that is never divided by their number is told
    # apart: Adam's first update hides the scale, its moments do not.
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)
    monkeypatch.setattr(ga, "accumulated_step", _summed)
    wrong = {c["name"]: c for c in runbook.verify("grad-accumulation", scale="tiny")}
    assert not wrong["scan-f32"]["same"], wrong["scan-f32"]


def _summed(params, opt_state, x, micro_batches, dtype=jnp.float32):
    """`accumulated_step` with the mean's division left out: the gradient times k."""
    parts = x.reshape(micro_batches, -1, *x.shape[1:])
    grads = [jax.grad(ga.loss)(params, part) for part in parts]
    summed = jax.tree.map(lambda *g: sum(g), *grads)
    updates, opt_state = ga.OPTIMIZER.update(summed, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ga.loss(params, x)


def test_the_claims_for_a_gpu_and_a_tpu():
    _need("h100")
    _need("v5e")
    expected = {
        "accumulator-528": "confirmed",
        "every-1-472": "confirmed",
        "batch-320": "refuted",
        "loop-122": "refuted",
        "bf16-half": "confirmed",
    }
    for target in ("h100", "v5e"):
        assert {c.key: c.verdict for c in page.claims(target=target)} == expected, target


def _cases(diagnosis):
    return [f.case for f in diagnosis.findings]


def test_the_detector_names_a_whole_batch_step_and_leaves_its_accumulations_alone():
    at = {"batch": max(SEED["batch"]), "micro_batches": SEED["micro_batches"]}
    for name, named in (
        ("full-batch", True),
        ("multisteps-every-1", True),  # MultiSteps given the whole batch
        ("multisteps", False),
        ("scan-f32", False),
        ("scan-bf16", False),
    ):
        v = CASE.variant(name)
        d = runbook.diagnose(v.program(at), *CASE.inputs(v, SEED, at, False))
        assert ("grad-accumulation" in _cases(d)) is named, (name, str(d))


def test_a_gradient_without_an_update_is_not_named():
    # Nothing is accumulated into: the same activations, and no state that the step updates.
    params, _, x = CASE.args(SEED, {"batch": 16384, "micro_batches": 8}, False)
    d = runbook.diagnose(jax.jit(jax.grad(ga.loss)), params, x)
    assert "grad-accumulation" not in _cases(d)
    near = [m for m in d.near_misses if m.case == "grad-accumulation"]
    assert not near  # not even seen: a gradient alone is no training step


def test_a_small_batch_is_a_near_miss_with_its_share():
    v = CASE.variant("micro-batch")
    at = {"batch": max(SEED["batch"]), "micro_batches": SEED["micro_batches"]}
    d = runbook.diagnose(v.program(at), *CASE.inputs(v, SEED, at, False))
    assert "grad-accumulation" not in _cases(d)
    near = [m for m in d.near_misses if m.case == "grad-accumulation"]
    assert near
    assert near[0].bytes > 0
    assert "named from 40%" in near[0].reason


def _step_with_statistics(update_statistics):
    """Three tanh layers and SGD; with `update_statistics`, also a running mean of the first
    layer's activations over the batch (batch norm's), which the forward pass alone makes."""

    def step(w, stats, x):
        def loss(w):
            h = jnp.tanh(x @ w)
            return jnp.mean(jnp.tanh(jnp.tanh(h @ w) @ w) ** 2), jnp.mean(h, axis=0)

        (value, mean), g = jax.value_and_grad(loss, has_aux=True)(w)
        stats = 0.9 * stats + 0.1 * mean if update_statistics else stats * 0.9
        return w - 0.1 * g, stats, value

    return jax.jit(step), (S((1024, 1024), jnp.float32), S((1024,), jnp.float32),
                           S((16384, 1024), jnp.float32))  # fmt: skip


@pytest.mark.parametrize("target", [None, "v5e"])
def test_a_step_that_updates_batch_statistics_is_a_near_miss_that_says_why(target):
    # Micro-batches would each normalise over their own rows: accumulating computes another
    # result. The same step whose other state is not computed from the batch is named. XLA's
    # TPU compiler reads the state through asynchronous copies (copy-start, copy-done), which
    # the state's pairing with its update follows.
    _need(target)
    fn, args = _step_with_statistics(update_statistics=False)
    assert "grad-accumulation" in _cases(runbook.diagnose(fn, *args, target=target))
    fn, args = _step_with_statistics(update_statistics=True)
    d = runbook.diagnose(fn, *args, target=target)
    assert "grad-accumulation" not in _cases(d)
    near = [m for m in d.near_misses if m.case == "grad-accumulation"]
    assert near, d.near_misses
    assert "statistics of the batch" in near[0].reason
