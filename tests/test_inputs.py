"""The inputs users have: modules as functions, filter_jit functions, non-array leaves."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runbook
from runbook import _targets
from runbook._inputs import as_jax

D = 256
X = jax.ShapeDtypeStruct((64, D), jnp.float32)
WEIGHT_BYTES = D * D * 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Dense:
    """A module as libraries write them: weights (leaves) and an activation (static)."""

    w: jax.Array
    act: object = dataclasses.field(metadata={"static": True}, default=jax.nn.relu)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.act(x @ self.w)  # type: ignore[operator]


def _dense() -> Dense:
    return Dense(jnp.ones((D, D), jnp.float32))


def test_a_module_called_as_the_function_takes_its_weights_as_inputs_not_constants():
    report = runbook.measure(_dense(), X)
    assert report.argument == WEIGHT_BYTES + 64 * D * 4
    text = runbook.compile_fn(_dense(), X).as_text()
    assert f"f32[{D},{D}]" in text.split("ENTRY")[1].splitlines()[0]  # a parameter


def test_arguments_with_functions_and_strings_as_leaves_compile_with_them_static():
    def step(params, x):
        h = params["act"](x @ params["w"])
        return h if params["mode"] == "train" else -h

    params = {"w": jax.ShapeDtypeStruct((D, D), jnp.float32), "act": jnp.tanh, "mode": "train"}
    report = runbook.measure(step, params, X)
    plain = runbook.measure(lambda w, x: jnp.tanh(x @ w), params["w"], X)
    assert (report.argument, report.output, report.temp) == (
        plain.argument,
        plain.output,
        plain.temp,
    )


def test_plain_functions_and_jax_jit_objects_pass_through_unchanged():
    def f(x, n):
        return x * n

    assert as_jax(f, (X, 2)) == (f, (X, 2))
    jitted = jax.jit(f, static_argnums=1)
    assert as_jax(jitted, (X, "static")) == (jitted, (X, "static"))
    with pytest.raises(runbook.RunbookError, match="must be a callable"):
        as_jax(np.ones(3), (X,))


def test_a_module_diagnosed_names_its_step_s_missing_donation():
    def step(model, x):
        grads = jax.grad(lambda m: jnp.sum(m(x)))(model)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, model, grads)

    found = runbook.diagnose(step, _dense(), X, measure_fixes=False)
    assert "donation" in found.cases


def test_a_jit_built_on_this_process_s_devices_is_told_to_use_the_target_s():
    if _targets.unavailable("v5e"):
        pytest.skip(_targets.unavailable("v5e"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))

    def f(x):
        return jax.lax.with_sharding_constraint(x * 2, sharded)

    with pytest.raises(runbook.RunbookError, match=r"runbook\.target_devices\('v5e', n\)"):
        runbook.measure(f, X, target="v5e")


def test_equinox_modules_and_filter_jit_functions_as_they_are():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(D, D, D, 2, key=jax.random.key(0))  # its activation is a leaf
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(mlp) if eqx.is_array(x))
    assert runbook.measure(mlp, jax.ShapeDtypeStruct((D,), jnp.float32)).argument == weights + D * 4

    def step(model, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(model)
        return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads))

    # A filter_jit function of arrays alone: equinox's own `lower` gives no memory figures.
    doubled = runbook.measure(eqx.filter_jit(lambda x: x * 2), X)
    assert doubled.argument == doubled.output == 64 * D * 4

    kept = runbook.diagnose(eqx.filter_jit(step), mlp, X, measure_fixes=False)
    donated = runbook.diagnose(eqx.filter_jit(step, donate="all"), mlp, X, measure_fixes=False)
    assert "donation" in kept.cases
    assert "donation" not in donated.cases
    assert donated.report.alias >= weights


def test_flax_nnx_modules_as_they_are():
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.Linear(D, D, rngs=nnx.Rngs(0))
    weights = (D * D + D) * 4
    assert runbook.measure(layer, X).argument == weights + 64 * D * 4
