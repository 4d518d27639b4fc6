"""resharding: the verdicts, the fix against the reproduction and the floor, the same-result
check (and that it can fail), jax-ml/jax#21562's reshard, and the detector on the case and
on a program written differently."""

from __future__ import annotations

import textwrap

import jax
import numpy as np
import pytest

import runbook
from runbook import _targets
from runbook.cases import resharding as rs
from runbook.cases.resharding import CASE
from runbook.site import resharding as page
from runbook.site._diagnose_cases import diagnose_case

PATTERN = "values computed whole on every device"


@pytest.fixture(scope="module", params=[None, "h100", "v5e"], ids=lambda t: t or "cpu")
def seed(request):
    if request.param and _targets.unavailable(request.param):
        pytest.skip(_targets.unavailable(request.param))
    return runbook.measure_case("resharding", "seed", target=request.param)


def test_verdicts_are_the_ones_this_release_recorded(recorded):
    assert {c.key: c.verdict for c in page.claims()} == recorded("resharding")


def test_the_fix_divides_the_reproduction_and_stays_above_the_floor(seed):
    worst, fix = seed.one("unconstrained"), seed.one(CASE.recommended)
    pinned = seed.one("constrain-every")
    # Whole on every device: the reproduction needs several times the pinned step.
    assert worst.total >= page.WHOLE_FACTOR * pinned.total
    assert worst.total >= 1.5 * fix.total
    for report in seed.reports:
        assert report.total >= report.lower_bound, report.name
    # Arguments: each device's share of the parameters and the tokens, in every variant.
    assert len({r.argument for r in seed.reports}) == 1


def test_the_floor_counts_each_device_s_share():
    scale = CASE.scales["seed"]
    one, eight = (rs._setup.floor_bytes(scale, n) for n in (1, rs.DEVICES))
    assert one == rs.DEVICES * eight


def test_the_same_result_check_passes_for_the_fixes_and_can_fail():
    checks = runbook.verify("resharding", scale="tiny")
    assert checks
    assert all(c["same"] for c in checks), checks
    # A step with another learning rate is told apart by the same comparison.
    params, tokens, labels = (
        jax.tree.map(np.asarray, a) for a in CASE.args(CASE.scales["tiny"], {}, True)
    )
    grads = jax.grad(rs.loss)(params, tokens, labels)
    step = {k: params[k] - rs.LEARNING_RATE * grads[k] for k in params}
    other = {k: params[k] - 2 * rs.LEARNING_RATE * grads[k] for k in params}
    assert not np.allclose(step["embed"], other["embed"], rtol=CASE.tolerance)


def _mine(diagnosis):
    return [f for f in diagnosis.findings if f.case == "resharding"]


def test_the_detector_names_the_reproduction_and_not_the_fix():
    found = _mine(diagnose_case("resharding", "unconstrained"))
    assert [f.pattern for f in found] == [PATTERN]
    worst = runbook.measure_case("resharding", "seed").one("unconstrained")
    fixed = runbook.measure_case("resharding", "seed").one("constrain-every")
    # What it names is there to save: split over the devices, those values would hold an
    # eighth of their bytes, and pinning the activations saves at least the rest.
    assert 0.25 * worst.total <= found[0].bytes <= worst.total
    assert found[0].bytes * (1 - 1 / rs.DEVICES) <= worst.total - fixed.total
    assert _mine(diagnose_case("resharding", "constrain-every")) == []
    assert found[0].copy == "runbook.cases.resharding.activations_on"


def test_the_detector_names_it_for_a_gpu():
    if _targets.unavailable("h100"):
        pytest.skip(_targets.unavailable("h100"))
    assert [f.pattern for f in _mine(diagnose_case("resharding", target="h100"))] == [PATTERN]


def test_the_reshard_of_21562_warns_and_builds_the_whole_array():
    found = page.reshard()
    assert found["warned"]
    assert found["temp"] >= found["whole"]
    assert page.reshard_claim(found).verdict == "confirmed"
    quiet = dict(found, warned=False)
    assert page.reshard_claim(quiet).verdict == "refuted"


# --- the detector, on programs written unlike the case ---------------------------------------

OTHERS = textwrap.dedent(
    """
    import json, jax, jax.numpy as jnp, numpy as np, runbook
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    S = jax.ShapeDtypeStruct
    def mine(d):
        return [[f.pattern, f.bytes] for f in d.findings if f.case == "resharding"]

    out = {}
    devices = np.array(jax.devices()[:8])
    # A tanh layer, the tokens arriving whole and constrained to the batch axis inside the
    # loss, the embedding split on its model dimension (nanodo's shape).
    mesh = Mesh(devices, ("data",))
    def lm_step(pin):
        def loss(p, tok):
            tok = jax.lax.with_sharding_constraint(tok, NamedSharding(mesh, P("data")))
            h = pin(p["emb"][tok])
            h = pin(jnp.tanh(h @ p["w"]))
            return -jnp.mean(jax.nn.log_softmax(pin(h @ p["emb"].T))[..., 0])
        return lambda p, tok: jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, tok))
    p = {"emb": S((8192, 512), jnp.float32, sharding=NamedSharding(mesh, P(None, "data"))),
         "w": S((512, 512), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))}
    tok = S((64, 256), jnp.int32, sharding=NamedSharding(mesh, P()))
    batch = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
    for how, pin in (("loose", lambda x: x), ("pinned", batch)):
        d = runbook.diagnose(jax.jit(lm_step(pin), donate_argnums=0), p, tok)
        out[f"lm-{how}"] = [mine(d), d.report.total]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def others(child_json):
    return child_json(OTHERS, 8)


def test_the_detector_names_activations_computed_whole_and_not_once_pinned(others):
    (found, total), (pinned, pinned_total) = others["lm-loose"], others["lm-pinned"]
    assert [p for p, _ in found] == [PATTERN]
    assert 0.25 * total <= found[0][1] <= total - pinned_total
    assert pinned == []
