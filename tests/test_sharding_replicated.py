"""sharding-replicated: every verdict, the bars and the floor on every target shown, the
same-result check (and that it can fail), the detector on programs written differently."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import pytest

import runbook
from runbook import _targets
from runbook.cases import sharding_replicated as sr
from runbook.cases._setup import sharding_replicated as sr_setup
from runbook.cases.sharding_replicated import CASE
from runbook.site import sharding_replicated as page

TARGETS = [None, "h100", "v5e"]  # the ones the page shows


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: t or "cpu")
def seed(request, measured_here):
    if request.param and _targets.unavailable(request.param):
        pytest.skip(_targets.unavailable(request.param))
    return measured_here("sharding-replicated", request.param)


def test_verdicts_are_the_ones_this_release_recorded(recorded):
    assert {c.key: c.verdict for c in page.claims()} == recorded("sharding-replicated")


def test_measured_within_a_minute_per_target(seed):
    result, seconds = seed
    measured = {r.name for r in result.reports} | {s["name"] for s in result.skipped}
    assert measured == {v.name for v in CASE.variants}
    assert seconds < 60


def test_every_variant_holds_its_floor_and_the_fix_is_near_it_on_every_target_shown(seed):
    result = seed[0]
    for r in result.reports:
        assert r.total >= r.lower_bound, r.name
    fix = result.one(CASE.recommended)
    assert fix.lower_bound == sr.floor_bytes(CASE.recommended, CASE.scales["seed"])
    assert fix.total <= 1.25 * fix.lower_bound


def test_the_fix_needs_far_less_per_device_at_the_worst_point(seed):
    result = seed[0]
    fix = result.one(CASE.recommended)
    found = result.select("replicated")
    if found:
        needed = found[0].total
    else:  # a TPU refuses the replicated step: what its compiler said it needs
        (entry,) = [s for s in result.skipped if s["name"] == "replicated"]
        assert entry["status"] == "does not fit"
        needed = entry["needed"]
    assert needed >= 1.5 * fix.total


def test_replication_does_not_fit_one_chip_and_the_fix_does(seed):
    result = seed[0]
    target = result.target
    if target is None:
        pytest.skip("a CPU has no device memory to compare with")
    found = result.select("replicated")
    assert not found or found[0].total > target.usable()
    assert result.one(CASE.recommended).total <= target.usable()


def test_sharding_divides_the_state_by_the_mesh_size():
    result = runbook.measure_case("sharding-replicated", "seed")
    rep, fs = result.one("replicated"), result.one("fsdp")
    state = sr.state_bytes(CASE.scales["seed"])
    assert rep.argument >= state
    seed = CASE.scales["seed"]
    batch = 2 * seed["batch"] * seed["width"] * 4 // sr.DEVICES  # x and y, split
    assert fs.argument < state // sr.DEVICES + batch + 1024


def test_the_same_result_check_passes_and_can_fail():
    checks = runbook.verify("sharding-replicated")
    assert {c["name"] for c in checks} == {"fsdp", "fsdp-scan"}
    assert all(c["same"] for c in checks), checks
    # Another learning rate gives other parameters, told apart at the case's tolerance.
    size = CASE.scales[CASE.runnable_scale]
    layers, opt = sr.init(jax.random.key(0), size["layers"], size["width"])
    x, y = sr_setup.batch(size, True)
    new, _, _ = sr.train_step(layers, opt, x, y)
    far = [w - 10 * sr.LEARNING_RATE * (n - w) for w, n in zip(layers, new, strict=True)]
    a, b = sr_setup.as_stacked((new, None, 0.0))[0], sr_setup.as_stacked((far, None, 0.0))[0]
    assert float(abs(a - b).max() / (abs(b).max() + 1)) > CASE.tolerance


def test_check_divides_names_the_array():
    eight = type("Mesh8", (), {"shape": {"fsdp": 8}})()  # only its axis sizes are read
    sr.check_divides({"w": jax.ShapeDtypeStruct((16, 8), jnp.float32)}, eight)
    with pytest.raises(ValueError, match=r"\['w'\]: 9 rows do not divide"):
        sr.check_divides({"w": jax.ShapeDtypeStruct((9, 8), jnp.float32)}, eight)


def test_an_indivisible_axis_is_measured_not_assumed():
    odd, even = page.indivisible()
    assert odd["rows"] % sr.DEVICES
    assert not even["rows"] % sr.DEVICES
    assert even["output"] == even["whole"] // sr.DEVICES
    assert not even["replicated"]
    assert even["device_put"] == "accepted"
    # Whatever this JAX does with the odd one (replicate, pad, refuse), the claim follows it.
    claim = next(c for c in page.claims() if c.key == "indivisible-replicated")
    replicated = odd["replicated"] and odd["output"] >= odd["whole"]
    assert claim.verdict == ("confirmed" if replicated else "refuted")


def test_creating_the_state_sharded_never_holds_it_whole():
    found = page.init_placement()
    state = sr.state_bytes(CASE.scales["issue"])
    assert found["one"]["output"] >= state
    assert found["sharded"]["output"] < state // sr.DEVICES + 2**20


# --- the detector, on programs written unlike the case ---------------------------------------

OTHERS = textwrap.dedent(
    """
    import json, jax, jax.numpy as jnp, numpy as np, optax, runbook
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    S = jax.ShapeDtypeStruct
    def mine(d):
        return [[f.pattern, f.bytes] for f in d.findings if f.case == "sharding-replicated"]

    def mlp(params, x):  # a dict pytree with biases
        for k in sorted(params):
            x = jax.nn.relu(x @ params[k]["w"] + params[k]["b"])
        return jnp.mean(x ** 2)

    def sgd_step(params, mom, x):  # SGD with momentum, by hand
        g = jax.grad(mlp)(params, x)
        mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, g)
        return jax.tree.map(lambda p, m: p - 0.01 * m, params, mom), mom

    def shapes(layers, width):
        return {f"l{i}": {"w": (width, width), "b": (width,)} for i in range(layers)}

    def place(tree, mesh, spec):
        return jax.tree.map(lambda s: S(s, jnp.float32, sharding=NamedSharding(
            mesh, spec if len(s) == 2 else P())), tree, is_leaf=lambda s: isinstance(s, tuple))

    out = {}
    devices = np.array(jax.devices()[:8])
    meshes = {"1d": (Mesh(devices, ("shard",)), P("shard", None), P("shard")),
              "2d": (Mesh(devices.reshape(2, 4), ("data", "model")),
                     P(("data", "model"), None), P("data"))}
    for name, (mesh, split, batch) in meshes.items():
        x = S((256, 2048), jnp.float32, sharding=NamedSharding(mesh, batch))
        tree = shapes(8, 2048)
        step = jax.jit(sgd_step, donate_argnums=(0, 1))
        for how, spec in (("replicated", P()), ("split", split)):
            params, mom = place(tree, mesh, spec), place(tree, mesh, spec)
            out[f"sgd-{name}-{how}"] = mine(runbook.diagnose(step, params, mom, x))
    # Adam from optax, a dict of layers, axis "dp", replicated: the state finding.
    mesh = Mesh(devices, ("dp",))
    opt = optax.adamw(1e-3)
    def adam_step(params, state, x):
        g = jax.grad(mlp)(params, x)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state
    params = place(shapes(6, 2048), mesh, P())
    state = jax.eval_shape(opt.init, params)
    state = jax.tree.map(lambda s: S(s.shape, s.dtype, sharding=NamedSharding(mesh, P())), state)
    x = S((256, 2048), jnp.float32, sharding=NamedSharding(mesh, P("dp")))
    out["adam-dp-replicated"] = mine(runbook.diagnose(jax.jit(adam_step, donate_argnums=(0, 1)),
                                                      params, state, x))
    # Clean: inference on replicated weights (no backward pass), and one-layer training.
    out["inference"] = mine(runbook.diagnose(jax.jit(mlp), params, x))
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def others(child_json):
    return child_json(OTHERS, 8)


@pytest.mark.parametrize("name", ["sgd-1d-replicated", "sgd-2d-replicated", "adam-dp-replicated"])
def test_the_detector_finds_replicated_state_written_otherwise(others, name):
    assert [p for p, _ in others[name]] == ["training state replicated on every device"], others[
        name
    ]


@pytest.mark.parametrize("name", ["sgd-1d-split", "sgd-2d-split"])
def test_the_detector_finds_no_replicated_state_once_split(others, name):
    assert "training state replicated on every device" not in [p for p, _ in others[name]]


def test_the_detector_is_silent_without_a_backward_pass(others):
    assert others["inference"] == []


def test_the_detector_names_every_layer_gathered_and_not_the_scanned_fix():
    from runbook.site._diagnose_cases import diagnose_case

    at = {"layers": 16, "width": 8192, "batch": 256}
    split = diagnose_case("sharding-replicated", "fsdp", scale="issue", at=at)
    (f,) = [f for f in split.findings if f.case == "sharding-replicated"]
    assert f.pattern == "every layer's gathered weights alive at once"
    assert f.bytes >= 0.25 * split.report.total
    fixed = diagnose_case("sharding-replicated", "fsdp-scan", scale="issue", at=at)
    mine = [f for f in fixed.findings if f.case == "sharding-replicated"]
    assert sum(f.bytes for f in mine) <= 0.05 * fixed.report.total
