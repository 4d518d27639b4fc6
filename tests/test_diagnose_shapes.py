"""`runbook.diagnose` on programs shaped like users' reports rather than like the cases' own
code, on both ends of the supported releases (issue 22): a gradient through checkpointed
blocks of a long scan, a backbone frozen by a zero learning rate or a mask, the
scan-residuals reproduction as each XLA compiles it, and what a diagnosis says about the
case that came closest when it names none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import lax

import runbook
from runbook._diagnose import Diagnosis
from runbook._targets import unavailable
from runbook.detectors import DETECTORS, NEAR_MISSES, scan_residuals
from runbook.site._diagnose_cases import diagnose_case

S = jax.ShapeDtypeStruct
f32 = jnp.float32
NO_GPU = unavailable("h100") is not None


def named(diagnosis, case):
    return [f for f in diagnosis.findings if f.case == case]


# --- a gradient through checkpointed blocks of a long scan (jax-ml/jax#27748's shape) -------


def block_step(carry, x):
    params, h = carry  # the parameters ride in the carry
    return (params, jnp.tanh(h @ params["w"] + x + params["b"])), None


def blocks_loss(params, h0, xs, checkpoint_body=False):
    """One `jax.remat`-wrapped scan per block of steps, chained by a Python loop."""
    body = jax.checkpoint(block_step) if checkpoint_body else block_step
    carry = (params, h0)
    for k in range(xs.shape[0]):
        carry = jax.remat(lambda c, block: lax.scan(body, c, block)[0])(carry, xs[k])
    return jnp.sum(carry[1] ** 2)


def blocks_args(blocks=4, steps=64, batch=2048, hidden=64):
    params = {"w": S((hidden, hidden), f32), "b": S((hidden,), f32)}
    return params, S((batch, hidden), f32), S((blocks, steps, hidden), f32)


def test_checkpointed_blocks_of_a_scan_are_scan_residuals_recomputed():
    args = blocks_args()
    d = runbook.diagnose(jax.grad(blocks_loss), *args)
    (f,) = named(d, "scan-residuals")
    assert d.cases[:1] == ["scan-residuals"], str(d)
    assert f.pattern == scan_residuals.PATTERN_RECOMPUTED
    stack = 64 * 2048 * 64 * 4  # one (steps, batch, hidden) stack of one block
    assert all(b.shape == "f32[64,2048,64]" and b.size == stack for b in f.evidence)
    kinds = {b.kind for b in f.evidence}
    assert kinds == {"stacked carry", "stacked intermediate"}
    assert len(f.evidence) % 4 == 0  # every block's loop stacks the same arrays
    assert f.bytes >= 0.5 * d.report.total
    assert "inside each block" in f.fix
    assert f.copy == "runbook.cases.scan_residuals.loss_nested"
    # The fix it names: the body checkpointed inside each block stores no intermediates.
    fixed = runbook.diagnose(jax.grad(lambda *a: blocks_loss(*a, checkpoint_body=True)), *args)
    stacked = [b for f in named(fixed, "scan-residuals") for b in f.evidence]
    assert not [b for b in stacked if b.kind == "stacked intermediate"], str(fixed)
    assert fixed.report.total < d.report.total / 1.5


def test_one_block_at_a_time_is_counted_once():
    """Blocks recomputed one after another share their memory where the schedule says so:
    the finding never exceeds what the program holds."""
    d = runbook.diagnose(jax.grad(blocks_loss), *blocks_args(blocks=8, steps=32))
    (f,) = named(d, "scan-residuals")
    assert f.bytes <= d.report.total


@pytest.mark.skipif(NO_GPU, reason="no GPU compiler installed")
def test_checkpointed_blocks_on_the_h100_compiler():
    d = runbook.diagnose(jax.grad(blocks_loss), *blocks_args(), target="h100")
    (f,) = named(d, "scan-residuals")
    assert f.pattern == scan_residuals.PATTERN_RECOMPUTED
    assert 0.5 * d.report.total <= f.bytes <= d.report.total


# --- the scan-residuals reproduction, however this XLA compiles it -------------------------


@pytest.mark.parametrize("variant", ["grad", "grad-fori", "remat-body", "remat-policy"])
def test_scan_residuals_reproductions_on_this_xla(variant):
    d = diagnose_case("scan-residuals", variant, scale="small", at={"steps": 1024})
    (f,) = named(d, "scan-residuals")
    assert f.pattern == scan_residuals.PATTERN
    assert f.bytes >= 0.25 * d.report.total


@pytest.mark.skipif(NO_GPU, reason="no GPU compiler installed")
@pytest.mark.parametrize("variant", ["grad", "remat-body", "remat-policy"])
def test_scan_residuals_reproductions_on_the_h100_compiler(variant):
    """The GPU compiler writes the stacks from async fusions: still found, every stack."""
    cpu = diagnose_case("scan-residuals", variant, scale="small", at={"steps": 1024})
    gpu = diagnose_case("scan-residuals", variant, scale="small", at={"steps": 1024}, target="h100")
    (f,) = named(gpu, "scan-residuals")
    (g,) = named(cpu, "scan-residuals")
    assert sorted(b.kind for b in f.evidence) == sorted(b.kind for b in g.evidence)
    assert f.bytes == g.bytes


# --- a backbone frozen by a zero learning rate, a mask or a product with zero --------------

LAYERS, WIDTH, BATCH, OUT = 4, 1024, 2048, 16


def backbone_loss(params, x, y):
    h = x
    for w in params["backbone"]:
        h = jnp.tanh(h @ w)
    return jnp.mean((h @ params["head"] - y) ** 2)


PARAMS = {"backbone": [S((WIDTH, WIDTH), f32)] * LAYERS, "head": S((WIDTH, OUT), f32)}
DATA = (S((BATCH, WIDTH), f32), S((BATCH, OUT), f32))


def labels(params):
    return {"backbone": ["frozen"] * len(params["backbone"]), "head": "train"}


def frozen_mask(params):
    return {"backbone": [True] * len(params["backbone"]), "head": False}


OPTIMIZERS = {
    "sgd(0) for the backbone": lambda: optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.sgd(0.0)}, labels
    ),
    "adam(0) for the backbone": lambda: optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.adam(0.0)}, labels
    ),
    "adam, then masked set_to_zero": lambda: optax.chain(
        optax.adam(1e-3), optax.masked(optax.set_to_zero(), frozen_mask)
    ),
}


def optax_step(opt):
    def step(params, state, x, y):
        grads = jax.grad(backbone_loss)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def times_zero_step(params, x, y):
    """A hand-written SGD step whose backbone update is multiplied by zero."""
    grads = jax.grad(backbone_loss)(params, x, y)
    scale = {"backbone": [0.0] * len(params["backbone"]), "head": 1.0}
    return jax.tree.map(lambda p, g, s: p - 1e-3 * s * g, params, grads, scale)


def head_only_step(params, x, y):
    """The fix: differentiate the head alone."""
    grad = jax.grad(lambda head: backbone_loss({**params, "head": head}, x, y))(params["head"])
    return {**params, "head": params["head"] - 1e-3 * grad}


@pytest.fixture(scope="module")
def head_only():
    return runbook.diagnose(head_only_step, PARAMS, *DATA)


def test_head_only_step_is_clean(head_only):
    assert not named(head_only, "frozen-params"), str(head_only)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_backbone_frozen_by_the_optimizer(name, head_only):
    opt = OPTIMIZERS[name]()
    state = jax.eval_shape(opt.init, PARAMS)
    d = runbook.diagnose(optax_step(opt), PARAMS, state, *DATA)
    (f,) = named(d, "frozen-params")
    assert f.bytes >= 0.05 * d.report.total
    # What it names is at most what differentiating the head alone would not hold.
    assert f.bytes <= d.report.total - head_only.report.total
    assert "zero learning rate" in f.fix
    assert f.copy == "runbook.cases.frozen_params.grad_trainable"


def test_backbone_update_multiplied_by_zero(head_only):
    d = runbook.diagnose(times_zero_step, PARAMS, *DATA)
    (f,) = named(d, "frozen-params")
    assert "multiply it by zero" in f.detail
    assert f.bytes >= 0.15 * d.report.total
    assert f.bytes <= d.report.total - head_only.report.total
    assert any("transpose(" in b.op for b in f.evidence)  # the backward pass, thrown away


def test_set_to_zero_leaves_nothing_to_name(head_only):
    """optax.set_to_zero replaces the backbone's gradient by zeros: XLA then drops its
    computation, so the step holds what the head-only step holds, and nothing is named."""
    opt = optax.multi_transform({"train": optax.sgd(1e-3), "frozen": optax.set_to_zero()}, labels)
    state = jax.eval_shape(opt.init, PARAMS)
    d = runbook.diagnose(optax_step(opt), PARAMS, state, *DATA)
    assert not named(d, "frozen-params"), str(d)
    assert d.report.temp <= head_only.report.temp * 1.01


def test_a_product_with_zero_in_the_forward_pass_is_not_frozen():
    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) * 0.0 + x @ w)

    d = runbook.diagnose(jax.grad(loss), S((1024, 1024), f32), S((1024, 1024), f32))
    assert not named(d, "frozen-params"), str(d)


# --- when nothing is named: the case that comes closest ------------------------------------


def test_every_near_miss_belongs_to_a_registered_detector():
    assert set(NEAR_MISSES) <= set(DETECTORS)
    assert len(NEAR_MISSES) >= 5


def test_closest_a_short_scan_beside_a_large_product():
    def loss(w, h0, xs, big):
        h = lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), h0, xs)[0]
        return jnp.sum(h) + jnp.sum(jnp.tanh(big @ big))

    args = (S((64, 64), f32), S((256, 64), f32), S((16, 64), f32), S((2048, 2048), f32))
    d = runbook.diagnose(jax.grad(loss, argnums=(0, 3)), *args)
    assert "scan-residuals" not in d.cases, str(d)
    misses = {m.case: m for m in d.near_misses}
    assert "named from 10%" in misses["scan-residuals"].reason
    stack = 16 * 256 * 64 * 4  # one (steps, batch, hidden) array; JAX saves a few per step
    assert misses["scan-residuals"].bytes > 0
    assert misses["scan-residuals"].bytes % stack == 0
    assert d.closest == max(d.near_misses, key=lambda m: m.bytes)
    again = Diagnosis.from_record(d.to_record())
    assert again.closest == d.closest


def test_closest_a_small_vmap():
    def per_example(row):
        a = row.reshape(-1, 64)
        return jnp.sum(jnp.tanh(a @ a.T))

    d = runbook.diagnose(
        lambda xs, w: jnp.sum(jax.vmap(per_example)(xs)) + jnp.sum(jnp.tanh(w @ w)),
        S((8, 64 * 64), f32),
        S((2048, 2048), f32),
    )
    assert not d.cases
    assert d.closest is not None
    assert d.closest.case == "vmap-materialize"
    assert "named from 25%" in d.closest.reason


def test_closest_a_small_frozen_matrix():
    def loss(params, x):
        h = jnp.tanh(x @ lax.stop_gradient(params["frozen"]))
        return jnp.mean((h @ params["big"]) ** 2)

    params = {"frozen": S((128, 128), f32), "big": S((128, 8192), f32)}
    d = runbook.diagnose(jax.grad(loss), params, S((4096, 128), f32))
    assert "frozen-params" not in d.cases
    misses = {m.case: m for m in d.near_misses}
    assert misses["frozen-params"].bytes == 128 * 128 * 4
    assert "named from 5%" in misses["frozen-params"].reason


def test_closest_two_independent_iterations():
    def two(x):
        return sum(jnp.sum(jnp.tanh(x * k) @ x) for k in range(2))

    d = runbook.diagnose(two, S((1024, 1024), f32))
    misses = {m.case: m for m in d.near_misses}
    assert "pmap-loop" not in d.cases
    if "pmap-loop" in misses:  # where XLA keeps the two iterations' temporaries apart
        assert "named from 4" in misses["pmap-loop"].reason


def test_no_near_miss_on_a_plain_product():
    d = runbook.diagnose(lambda a: a @ a, S((1024, 1024), f32))
    assert not d.findings
    assert d.closest is None


@pytest.mark.parametrize(
    ("text", "space"),
    [
        ("bf16[24,8]{1,0:S(5)}", 5),
        ("f32[8,128]{1,0:T(8,128)S(1)}", 1),
        ("f32[8]{0}", 0),
        ("f32[8]", 0),
        ("(f32[2]{0:S(5)}, f32[3]{0})", 0),  # a tuple is in no one memory
    ],
)
def test_a_shape_s_memory_space_is_read_from_its_layout(text, space):
    from runbook._hlo import Shape

    assert Shape(text).memory_space == space
