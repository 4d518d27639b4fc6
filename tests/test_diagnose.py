"""`runbook.diagnose`: every case named on its reproduction, its fix left alone, each detector
on small programs that show its mechanism and on their obvious fixes, the renderings, the CLI.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import runbook
import runbook.site
from conftest import one_timing_at_a_time
from runbook._cli import main
from runbook._program import Program, cpu_accounting_options
from runbook._subprocess import child_env
from runbook._targets import unavailable
from runbook.cases import attention_scores as attn
from runbook.cases import host_offloading, resharding, tpu_padding
from runbook.cases._setup.attention_scores import attention_backward
from runbook.detectors import DETECTORS, vocab_logits
from runbook.detectors import scan_residuals as scan_residuals_detector
from runbook.detectors._common import at_peak, held_at_peak, off_peak
from runbook.site import scan_residuals
from runbook.site._accelerator import recommended, worst_point
from runbook.site._diagnose_cases import case_diagnosis_table, diagnose_case

S = jax.ShapeDtypeStruct
f32 = jnp.float32

SECONDS = 10  # the target for one diagnosis at seed scale, here
# Cases whose problem shows only in a real run (memory grows across a loop's steps or
# during compilation): no compiled program holds it, so diagnose has nothing to name.
RUNTIME_CASES = {n for n in runbook.case_names() if runbook.get_case(n).runtime}
COMPILED_CASES = [name for name in runbook.case_names() if name not in RUNTIME_CASES]


# Each case program's diagnosis at seed scale, made once per worker: the case table reads the
# same ones as the tests of each case before it.
_DIAGNOSED: dict[str, runbook.Diagnosis] = {}


def diagnosed(name, variant=None, *, at):
    """`diagnose_case` at seed scale, remembered (`variant`: default the reproduction)."""
    variant = variant or next(
        v.name for v in runbook.get_case(name).variants if v.role == "reproduction"
    )
    key = json.dumps([name, variant, dict(at)], sort_keys=True, default=str)
    if key not in _DIAGNOSED:
        with one_timing_at_a_time():  # its seconds are checked against SECONDS
            _DIAGNOSED[key] = diagnose_case(name, variant, at=at)
    return _DIAGNOSED[key]


def named(diagnosis, case):
    return [f for f in diagnosis.findings if f.case == case]


def patterns(diagnosis):
    return {f.case for f in diagnosis.findings}


# --- the runbook's own cases ---------------------------------------------------------------


@pytest.fixture(scope="module")
def seeds():
    return {name: runbook.measure_case(name, "seed") for name in COMPILED_CASES}


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_reproduction_is_diagnosed_as_its_case_within_the_time(seeds, name):
    at = worst_point(seeds[name])
    d = diagnosed(name, at=at)
    assert d.cases[:1] == [name], str(d)  # named, and the largest finding
    own = named(d, name)[0]
    assert own.bytes >= 0.10 * d.report.total
    assert own.evidence
    assert d.seconds < SECONDS


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_recommended_fix_draws_no_finding_of_its_case(seeds, name):
    result = seeds[name]
    at = worst_point(result)
    fix = recommended(result, at)
    assert fix is not None
    d = diagnosed(name, fix.name, at=at)
    too_big = [f for f in named(d, name) if f.bytes > 0.05 * d.report.total]
    assert not too_big, str(d)


def test_case_table_names_each_reproduction(monkeypatch):
    def remembered(name, variant=None, *, scale="seed", at=None, target=None):
        assert (scale, target) == ("seed", None)
        assert at is not None
        return diagnosed(name, variant, at=at)

    monkeypatch.setattr("runbook.site._diagnose_cases.diagnose_case", remembered)
    table = case_diagnosis_table()
    rows = {(r[0], r[1]): r for r in table.rows}
    for name in COMPILED_CASES:
        repro = [r for (case, _), r in rows.items() if case == name and r[3] != "none"]
        assert repro, table


@pytest.mark.parametrize("name", ["donation", "resharding"])  # here, and in a child
def test_a_case_diagnosis_is_cached_and_read_back_whole(monkeypatch, tmp_path, name):
    # The diagnose page's case table, and the pre-pass before it, make each diagnosis once.
    from runbook import _cache

    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path))
    monkeypatch.setenv(_cache.STORE_VAR, "")
    first = diagnose_case(name, scale="tiny")
    assert len(list(tmp_path.glob("*/*.json"))) >= 1

    def again(*args, **kwargs):
        raise AssertionError("diagnosed again")

    monkeypatch.setattr("runbook.site._diagnose_cases.diagnose", again)
    monkeypatch.setattr("runbook.site._diagnose_cases._subprocess.call", again)
    back = diagnose_case(name, scale="tiny")
    assert back.to_json() == first.to_json()
    assert back.seconds == first.seconds


def test_int16_index_copy_is_named_as_widened():
    d = diagnose_case("gather-grad", at={"index_dtype": "int16", "chunk": 2**22})
    (f,) = named(d, "gather-grad")
    assert "widened from s16 to s32" in f.detail
    assert f.evidence[0].shape.startswith("s32")


def test_pmap_loop_replication_is_information_without_a_device_limit(seeds):
    d = diagnosed("pmap-loop", at=worst_point(seeds["pmap-loop"]))
    replicated = [f for f in d.findings if f.pattern.startswith("inputs replicated")]
    assert len(replicated) == 1
    assert replicated[0].informational
    assert replicated[0].bytes == 128 * 2048 * 256 * 4  # the whole input, on each device


# --- no false alarm on a realistic training step ----------------------------------------------


def mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def mlp_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(mlp_loss)(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def mlp_inputs(widths=(784, 4096, 4096, 4096, 10), batch=1024):
    params = [(S((m, n), f32), S((n,), f32)) for m, n in itertools.pairwise(widths)]
    opt_state = jax.eval_shape(OPTIMIZER.init, params)
    return params, opt_state, S((batch, widths[0]), f32), S((batch,), jnp.int32)


def test_realistic_training_step_draws_no_false_alarm():
    step = jax.jit(train_step, donate_argnums=(0, 1))
    with one_timing_at_a_time():
        d = runbook.diagnose(step, *mlp_inputs())
    assert not d.findings, str(d)
    assert d.seconds < SECONDS


def test_gradient_of_a_layer_chain_is_not_an_unrolled_loop():
    # A Python loop over layers of one width: same-shape temporaries from one line, but each
    # computed from the last, and all needed by the backward pass.
    params, _, x, y = mlp_inputs()
    assert not runbook.diagnose(jax.grad(mlp_loss), params, x, y).findings


def test_undonated_training_step_is_named_donation_with_a_measured_saving():
    inputs = mlp_inputs()
    d = runbook.diagnose(train_step, *inputs, measure_fixes=True)
    assert [f.case for f in d.findings] == ["donation"], str(d)
    (f,) = d.findings
    state = sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(inputs[:2]))
    assert f.bytes >= 0.99 * state - 64  # every array of the state (not the step counts)
    donated = runbook.measure(jax.jit(train_step, donate_argnums=(0, 1)), *inputs)
    assert f.saving == d.report.total - donated.total > 0


# --- each detector on small programs that show its mechanism, and on their fixes -------------


def gather_loss(x, idx):
    return jnp.sum(x[idx[:, 0], idx[:, 1]] ** 2)


def gather_whole(x, idx):
    dims = lax.GatherDimensionNumbers((), (0, 1), (0, 1))
    return jnp.sum(lax.gather(x, idx, dims, (1, 1), mode="promise_in_bounds") ** 2)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int16])
def test_index_copy_of_a_tuple_index(dtype):
    x, idx = S((256, 256), f32), S((2**22, 2), dtype)
    d = runbook.diagnose(jax.grad(gather_loss), x, idx)
    (f,) = named(d, "gather-grad")
    assert f.bytes == 2**22 * 2 * 4  # the copy is int32 whatever the input's width
    assert ("widened from s16" in f.detail) == (dtype == jnp.int16)
    assert not named(runbook.diagnose(jax.grad(gather_whole), x, idx), "gather-grad")


def loop_of_products(xs):
    total = jnp.zeros((), xs.dtype)
    for i in range(xs.shape[0]):
        a = xs[i].reshape(-1, 128)
        total += jnp.sum(jnp.tanh(a @ a.T))
    return total


def rolled_products(xs):
    def body(i, total):
        a = xs[i].reshape(-1, 128)
        return total + jnp.sum(jnp.tanh(a @ a.T))

    return lax.fori_loop(0, xs.shape[0], body, jnp.zeros((), xs.dtype))


def test_unrolled_python_loop():
    xs = S((16, 1024 * 128), f32)
    d = runbook.diagnose(loop_of_products, xs)
    (f,) = named(d, "pmap-loop")
    product = 1024 * 1024 * 4
    assert f.bytes >= 16 * product  # every iteration's product at once
    assert {b.shape for b in f.evidence} >= {"f32[1024,1024]"}
    assert not runbook.diagnose(rolled_products, xs).findings


def products_per_output(xs):
    # The same loop's products, each returned on its own (as per-layer gradients are): a
    # rolled loop would return them all too, so this is not the unrolled-loop mechanism.
    return [jnp.tanh(a @ a.T) for a in (xs[i].reshape(-1, 128) for i in range(xs.shape[0]))]


def test_values_each_feeding_their_own_output_are_not_an_unrolled_loop():
    d = runbook.diagnose(products_per_output, S((16, 1024 * 128), f32))
    assert not named(d, "pmap-loop"), str(d)
    assert d.report.total >= 16 * 1024 * 1024 * 4  # the products are there, as outputs


REPLICATED = textwrap.dedent(
    """
    import json, jax, jax.numpy as jnp, runbook
    from runbook._targets import unavailable
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    def f(x, table):
        return x @ table
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    out = {}
    for spec in ("whole", "split"):
        t = NamedSharding(mesh, P() if spec == "whole" else P(None, "d"))
        table = jax.ShapeDtypeStruct((1024, 8192), jnp.float32, sharding=t)
        out[spec] = runbook.diagnose(f, x, table).to_json()
        if spec == "whole" and unavailable("h100") is None:
            out["h100"] = runbook.diagnose(f, x, table, target="h100").to_json()
            big = jax.ShapeDtypeStruct((2**22, 1024), jnp.float32, sharding=t)  # 16 GiB
            out["h100-large"] = runbook.diagnose(lambda t: t * 2, big, target="h100").to_json()
    print(json.dumps(out))
    """
)


def test_replicated_inputs_on_four_devices():
    proc = subprocess.run(
        [sys.executable, "-c", REPLICATED],
        env=child_env(4),
        capture_output=True,
        text=True,
        check=True,
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (f,) = [f for f in out["whole"]["findings"] if f["case"] == "pmap-loop"]
    assert f["bytes"] == 1024 * 8192 * 4
    assert f["informational"]  # CPU devices: no memory limit to compare with
    assert not [f for f in out["split"]["findings"] if f["case"] == "pmap-loop"]
    if "h100" in out:  # a quarter of a GiB against 60 GiB: still information
        (g,) = [f for f in out["h100"]["findings"] if f["case"] == "pmap-loop"]
        assert g["informational"]
        # 16 GiB on each device, against its 60 GiB: a finding, not information.
        (h,) = [f for f in out["h100-large"]["findings"] if f["case"] == "pmap-loop"]
        assert not h["informational"]
        assert h["bytes"] == 2**22 * 1024 * 4


def rnn_loss(w, h0, xs, remat=False):
    body = lambda h, x: (jnp.tanh(h @ w + x), None)
    if remat:
        body = jax.checkpoint(body)
    return jnp.sum(lax.scan(body, h0, xs)[0])


def rnn_nested(w, h0, xs, segments=16):
    body = jax.checkpoint(lambda h, x: (jnp.tanh(h @ w + x), None))
    segment = jax.checkpoint(lambda h, xs: (lax.scan(body, h, xs)[0], None))
    return jnp.sum(lax.scan(segment, h0, xs.reshape(segments, -1, *xs.shape[1:]))[0])


RNN = (S((256, 256), f32), S((64, 256), f32), S((256, 64, 256), f32))


def test_scan_residuals_with_and_without_checkpoint():
    step = 256 * 64 * 256 * 4  # one (steps, batch, hidden) array
    plain = runbook.diagnose(jax.grad(rnn_loss), *RNN)
    (f,) = named(plain, "scan-residuals")
    kinds = sorted(b.kind for b in f.evidence)
    # The step's input h and what JAX saves of the step besides, each one stack; how many
    # arrays JAX saves per step is the release's (scan_residuals.carries_by_release).
    saved = len(scan_residuals.saved_residuals(rnn_loss, *RNN))
    assert saved >= 2
    assert kinds == ["stacked carry"] + ["stacked intermediate"] * (saved - 1)
    assert f.bytes == saved * step
    assert "Checkpoint the loop's body" in f.fix

    remat = runbook.diagnose(jax.grad(lambda *a: rnn_loss(*a, remat=True)), *RNN)
    (g,) = named(remat, "scan-residuals")
    assert [b.kind for b in g.evidence] == ["stacked carry"]  # the intermediates are gone
    assert g.bytes == step
    assert g.fix.startswith("Nest checkpointed scans")

    assert not named(runbook.diagnose(jax.grad(rnn_nested), *RNN), "scan-residuals")
    assert not runbook.diagnose(rnn_loss, *RNN).findings  # no backward pass, nothing stored


def selective_loss(a, xs):
    """An elementwise recurrence, as a selective-scan SSM steps its state."""

    def body(h, x):
        u = jnp.sin(h * x)
        return a * h + u * u, None

    return jnp.sum(lax.scan(body, jnp.zeros(xs.shape[1:]), xs)[0])


def test_scan_residuals_of_a_loop_the_compiler_wraps_in_a_call():
    # XLA:CPU at jax 0.12 runs a loop like this one as a call of its own (a "small call"):
    # the stacks leave the loop through the call, and still reach the backward loop.
    args = (S((64, 128), f32), S((16, 64, 128), f32))
    (f,) = named(runbook.diagnose(jax.grad(selective_loss), *args), "scan-residuals")
    kinds = sorted(b.kind for b in f.evidence)
    assert kinds == ["stacked carry", "stacked intermediate", "stacked intermediate"]
    assert f.bytes == 3 * 16 * 64 * 128 * 4  # the step's input h and two intermediates, every step


def layers_loss(ws, x, remat=False):
    def layer(h, w):
        return jnp.tanh(jnp.tanh(h @ w) @ w)

    for i, w in enumerate(ws):
        with jax.named_scope(f"block_{i}"):
            h = jax.checkpoint(layer)(x, w) if remat else layer(x, w)
        x = h
    return jnp.sum(x)


LAYERS = ([S((512, 512), f32)] * 6, S((2048, 512), f32))
# Whether a checkpoint per layer lowers the CPU total, per release (the test says why).
LAYER_CHECKPOINT_PAYS_ON_CPU = {"0.10.2": False, "0.12.0.1": True}


def test_layers_written_out_keep_their_intermediates_named_without_a_loop():
    # Six layers in a Python loop, each keeping its first tanh (and what its gradient
    # reads) for the backward pass: the same mechanism as a scan's stacks, with no loop.
    plain = runbook.diagnose(jax.grad(layers_loss), *LAYERS)
    remat = runbook.diagnose(jax.grad(lambda *a: layers_loss(*a, remat=True)), *LAYERS)
    # A checkpoint on each layer keeps only the layers' outputs: nothing to name.
    assert not named(remat, "scan-residuals")
    assert not [m for m in remat.near_misses if m.case == "scan-residuals"]
    # Whether that lowers the total is the compiler's call: XLA's CPU compiler at jax
    # 0.10.2 merges the checkpoints' recomputation back into the forward pass (as in the
    # real corpus's rows for that release). The detector's probe says which, and names the
    # layers only where the checkpoint pays.
    saving = plain.report.total - remat.report.total
    pays = saving >= 2 * 2048 * 512 * 4
    if jax.__version__ in LAYER_CHECKPOINT_PAYS_ON_CPU:
        assert pays == LAYER_CHECKPOINT_PAYS_ON_CPU[jax.__version__], saving
    if not pays:
        assert not named(plain, "scan-residuals")
        (miss,) = [m for m in plain.near_misses if m.case == "scan-residuals"]
        assert miss.pattern == "each layer's intermediates kept for the backward pass"
        assert "merges a checkpoint's recomputation back" in miss.reason, miss.reason
        assert miss.bytes >= 4 * 2048 * 512 * 4
        return
    (f,) = named(plain, "scan-residuals")
    assert f.pattern == "each layer's intermediates kept for the backward pass"
    assert "block_0 to block_5" in f.detail
    activation = 2048 * 512 * 4
    assert 4 * activation <= f.bytes <= plain.report.total
    assert saving >= f.bytes // 2, saving
    assert f.copy.endswith("loss_remat_body")


@pytest.fixture
def checkpoint_kept(monkeypatch):
    """The layer sign's analysis on its own, whether or not this CPU compiler undoes a
    checkpoint (the test above ties the probe to a measured fix)."""
    monkeypatch.setattr(scan_residuals_detector, "checkpoint_undone", lambda program: None)


def wide_layers_loss(ws, x, remat=False):
    # Each layer widens 4x and narrows back: its largest value is the wide intermediate,
    # not its output, which is the next layer's input.
    def layer(x, up, down):
        return jnp.tanh(jnp.tanh(x @ up) @ down)

    for i, (up, down) in enumerate(ws):
        with jax.named_scope(f"block_{i}"):
            x = (jax.checkpoint(layer) if remat else layer)(x, up, down)
    return jnp.sum(x)


WIDE = ([(S((512, 2048), f32), S((2048, 512), f32))] * 6, S((2048, 512), f32))


def test_a_layers_output_is_what_the_next_layer_reads_not_its_largest_value(checkpoint_kept):
    d = runbook.diagnose(jax.grad(wide_layers_loss), *WIDE)
    (f,) = named(d, "scan-residuals")
    assert f.pattern == "each layer's intermediates kept for the backward pass"
    # Each layer's wide tanh is kept for the backward pass and freed by a checkpoint: all
    # but one layer's count. Taking each layer's largest value for its output left them out.
    wide = 2048 * 2048 * 4
    assert {b.shape for b in f.evidence} >= {"f32[2048,2048]"}, f.evidence
    assert 5 * wide <= f.bytes <= d.report.total


# Wide enough that a v5e's compiler makes each layer's wide tanh in on-chip memory and
# keeps a copy in HBM for the backward pass.
TPU_WIDE = ([(S((1024, 4096), f32), S((4096, 1024), f32))] * 6, S((4096, 1024), f32))


def test_layers_a_tpu_keeps_through_its_memory_spaces_are_named():
    # XLA's TPU compiler evicts each layer's wide intermediate to HBM (copy-start, copy-done)
    # and the backward pass reads it back in slices put together again: moves, through which
    # the backward pass reads the layer's value. Read as computations of the forward pass,
    # they hid four of the six layers (a near miss of 64 MiB).
    plain = runbook.diagnose(jax.grad(wide_layers_loss), *TPU_WIDE, target="v5e")
    remat = runbook.diagnose(
        jax.grad(lambda *a: wide_layers_loss(*a, remat=True)), *TPU_WIDE, target="v5e"
    )
    (f,) = named(plain, "scan-residuals")
    assert f.pattern == "each layer's intermediates kept for the backward pass"
    assert "block_0 to block_5" in f.detail
    saving = plain.report.total - remat.report.total
    assert saving >= 4 * 4096 * 4096 * 4  # the checkpoints pay on the v5e
    assert saving // 2 <= f.bytes <= plain.report.total
    assert not named(remat, "scan-residuals")


# A constant the compiler shares among both passes, fused into a forward fusion under the
# reverse-mode pass's op name (XLA's TPU compiler does this with a softmax's).
_SHARED_CONSTANT = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %c = f32[] constant(2), metadata={op_name="jit(f)/transpose(jvp(f))/mul"}
  %b = f32[4]{0} broadcast(%c), dimensions={}, metadata={op_name="jit(f)/jvp(f)/mul"}
  ROOT %m = f32[4]{0} multiply(%p, %b), metadata={op_name="jit(f)/jvp(f)/mul"}
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %f = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused
}
"""


def test_a_constant_named_for_the_backward_pass_leaves_its_fusion_in_the_forward_pass():
    import types

    from runbook._hlo import parse_module

    module = parse_module(_SHARED_CONSTANT)
    assert "transpose(" in module.get("c").op_name
    assert Program._backward.func(types.SimpleNamespace(module=module)) == frozenset()


# XLA's rematerialization pass clones a forward fusion for the backward pass that reads it
# (``.remat``), under the forward op's name: the value it recomputes from is still kept.
_REMAT_CLONE = """HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %k = f32[4]{0} exponential(%x), metadata={op_name="jit(f)/jvp(f)/exp"}
  %n.remat = f32[4]{0} negate(%k), metadata={op_name="jit(f)/jvp(f)/neg"}
  ROOT %g = f32[4]{0} multiply(%n.remat, %x), metadata={op_name="jit(f)/transpose(jvp(f))/mul"}
}
"""


def test_a_value_the_compiler_recomputes_from_for_the_backward_pass_is_kept_for_it():
    from runbook._hlo import Value, parse_module

    program = object.__new__(Program)  # the module alone: what these two methods read
    program.module = parse_module(_REMAT_CLONE)
    assert program.read_by_backward("k")
    # A value in a TPU's on-chip memory (XLA's colour 1) holds none of the device memory
    # the program's total counts.
    program.live = {("k", "{}"): (0, 2), ("n.remat", "{}"): (0, 2)}
    in_hbm = Value("k", "{}", 16, 0, 0, "temp", "f32[4]")
    on_chip = Value("n.remat", "{}", 16, 0, 1, "temp", "f32[4]", space=1)
    assert program.peak([in_hbm, on_chip]) == 16


def attention_layers_loss(ws, x):
    for i, w in enumerate(ws):
        with jax.named_scope(f"block_{i}"):
            q, k = x @ w, x @ w.T
            scores = jax.nn.softmax(q @ k.T / 8.0, axis=-1)
            x = jnp.tanh(scores @ x)
    return jnp.sum(x)


ATTENTION_LAYERS = ([S((64, 64), f32)] * 4, S((2048, 64), f32))


def test_layers_whose_intermediates_are_attention_scores_name_both_and_count_each_once(
    checkpoint_kept,
):
    # Each layer keeps its 2048 x 2048 scores for the backward pass: attention scores, and
    # what a checkpoint on each layer would free. Both are named; the bytes count once.
    d = runbook.diagnose(jax.grad(attention_layers_loss), *ATTENTION_LAYERS)
    (scores,) = named(d, "attention-scores")
    (layers,) = named(d, "scan-residuals")
    assert layers.pattern == "each layer's intermediates kept for the backward pass"
    assert scores.bytes + layers.bytes <= d.report.total
    assert layers.bytes < 0.10 * d.report.total < scores.bytes
    assert "counted once, there" in layers.detail, layers.detail
    assert sum(f.bytes for f in d.findings if not f.informational) <= d.report.total


def per_example(row):
    a = row.reshape(-1, 256)
    return jnp.sum(jnp.tanh(a @ a.T))


def test_vmap_whole_batch_temporaries():
    xs = S((32, 512 * 256), f32)
    d = runbook.diagnose(lambda xs: jnp.sum(jax.vmap(per_example)(xs)), xs)
    (f,) = named(d, "vmap-materialize")
    assert f.bytes == 32 * 512 * 512 * 4  # every example's product at once
    chunked = runbook.diagnose(lambda xs: jnp.sum(lax.map(per_example, xs, batch_size=2)), xs)
    assert not chunked.findings


def adam_like(params, m, v, grads):
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
    params = jax.tree.map(lambda p, m, v: p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), params, m, v)
    return params, m, v


def test_donation_of_an_adam_like_update():
    tree = {"w": S((2048, 2048), f32), "b": S((2048,), f32)}
    state = 3 * (2048 * 2048 + 2048) * 4
    d = runbook.diagnose(adam_like, tree, tree, tree, tree, measure_fixes=True)
    (f,) = named(d, "donation")
    assert f.bytes == state
    assert "donate_argnums=(0, 1, 2)" in f.fix
    fixed = runbook.diagnose(jax.jit(adam_like, donate_argnums=(0, 1, 2)), tree, tree, tree, tree)
    assert not fixed.findings
    assert f.saving == d.report.total - fixed.report.total > 0
    # By default the step is compiled once: the same finding, its saving not measured.
    (unmeasured,) = named(runbook.diagnose(adam_like, tree, tree, tree, tree), "donation")
    assert (unmeasured.bytes, unmeasured.saving) == (state, None)
    assert "measure_fixes=True" in unmeasured.detail


TABLE = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)


def test_closure_constant():
    x = S((64, 1024), f32)
    d = runbook.diagnose(lambda x: jnp.tanh(x @ jnp.asarray(TABLE)), x)
    (f,) = named(d, "closure-constant")
    assert f.bytes == TABLE.nbytes
    assert f.evidence[0].kind == "constant"
    assert f.evidence[0].source  # where the constant is used
    passed = runbook.diagnose(lambda x, t: jnp.tanh(x @ t), x, S(TABLE.shape, f32))
    assert not passed.findings


def lora_loss(params, x):
    frozen = lax.stop_gradient(params["frozen"])
    h = jnp.tanh(x @ frozen)
    return jnp.mean((h @ params["a"] @ params["b"]) ** 2)


LORA = {"frozen": S((2048, 2048), f32), "a": S((2048, 8), f32), "b": S((8, 2048), f32)}
TOKENS = S((64, 2048), f32)


def lora_trainable(params, x):
    trainable = {"a": params["a"], "b": params["b"]}
    return jax.grad(lambda t: lora_loss({"frozen": params["frozen"], **t}, x))(trainable)


def test_frozen_parameters_zero_gradient():
    d = runbook.diagnose(jax.grad(lora_loss), LORA, TOKENS)
    (f,) = named(d, "frozen-params")
    assert f.bytes == 2048 * 2048 * 4  # the zero gradient of the frozen matrix
    assert not runbook.diagnose(lora_trainable, LORA, TOKENS).findings


ADAM = optax.adam(1e-3)


def lora_step_all(params, opt_state, x):
    grads = jax.grad(lora_loss)(params, x)
    updates, opt_state = ADAM.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def lora_step_trainable(params, opt_state, x):
    grads = lora_trainable(params, x)
    trainable = {"a": params["a"], "b": params["b"]}
    updates, opt_state = ADAM.update(grads, opt_state, trainable)
    return {"frozen": params["frozen"], **optax.apply_updates(trainable, updates)}, opt_state


def test_frozen_parameters_in_a_training_step():
    state = jax.eval_shape(ADAM.init, LORA)
    step = jax.jit(lora_step_all, donate_argnums=(0, 1))
    d = runbook.diagnose(step, LORA, state, TOKENS)
    (f,) = named(d, "frozen-params")
    # The frozen matrix and its two moments, updated with no gradient at all.
    assert f.bytes == 3 * 2048 * 2048 * 4
    assert "with no gradient" in f.detail
    trainable_state = jax.eval_shape(ADAM.init, {"a": LORA["a"], "b": LORA["b"]})
    fixed = jax.jit(lora_step_trainable, donate_argnums=(0, 1))
    assert not runbook.diagnose(fixed, LORA, trainable_state, TOKENS).findings


def lm_loss(w, h, labels):
    return optax.softmax_cross_entropy_with_integer_labels(h @ w, labels).mean()


def lm_loss_chunked(w, h, labels, chunks=16):
    @jax.checkpoint
    def chunk(total, xs):
        h, labels = xs
        return total + optax.softmax_cross_entropy_with_integer_labels(h @ w, labels).sum(), None

    pieces = (h.reshape(chunks, -1, h.shape[-1]), labels.reshape(chunks, -1))
    return lax.scan(chunk, jnp.zeros((), f32), pieces)[0] / labels.size


LM = (S((512, 32000), f32), S((4096, 512), f32), S((4096,), jnp.int32))


def test_vocab_logits():
    d = runbook.diagnose(jax.value_and_grad(lm_loss), *LM)
    (f,) = named(d, "vocab-logits")
    logits = 4096 * 32000 * 4
    assert f.bytes >= 2 * logits  # the logits and their exponential at least
    assert all(b.shape == "f32[4096,32000]" for b in f.evidence)
    assert not runbook.diagnose(jax.value_and_grad(lm_loss_chunked), *LM).findings


def lm_loss_then_a_larger_product(w, h, labels, a):
    # The product waits for the loss: by the time it is made, no logits are live.
    loss = lm_loss(w, h, labels)
    return jnp.sum(jnp.exp((loss * a) @ a.T))


def test_logits_not_live_at_the_peak_are_not_named():
    # gpt2-pmap on a v5e: its logits are a tenth of the total at their own time, none of it
    # at the program's peak, and the chunked loss saves nothing there. Chunking the logits
    # lowers a point of the schedule that is not the top: not named.
    args = (*LM, S((32768, 64), f32))  # a 4 GiB product after the loss
    program = Program.compile(
        lm_loss_then_a_larger_product, *args, compiler_options=cpu_accounting_options()
    )
    ((_, _, chosen, _),) = vocab_logits._claimed(program)
    values = [v for v, _ in chosen]
    assert program.peak(values) >= vocab_logits.MIN_SHARE * program.total  # seen, held
    assert at_peak(program, values) == 0
    assert not vocab_logits.detect(program)
    share = vocab_logits.MIN_SHARE
    assert held_at_peak(program, values, share) is None
    # What another detector names and the same fix frees counts towards the peak, never
    # towards the bytes (logits computed whole on every device, resharding's).
    top = [v for v in program.values if at_peak(program, [v])]  # the later product's
    assert held_at_peak(program, values, share, also=top) == program.peak(values)
    assert off_peak(program, "vocab-logits", "", "", values, share, also=top) is None
    d = runbook.diagnose(lm_loss_then_a_larger_product, *args)
    assert "vocab-logits" not in d.cases
    assert d.closest is not None  # seen, and why not named
    assert d.closest.case == "vocab-logits"
    assert "0 B at the program's peak" in d.closest.reason


def lm_loss_and_accuracy(w, h, labels):
    logits = h @ w
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


@pytest.mark.parametrize("target", [None, "v5e", "h100"])
def test_vocab_logits_with_the_models_accuracy(target):
    # flax's lm1b reports its accuracy: XLA merges the softmax's maximum into the argmax's
    # reduce (a value and its index), which takes no plain maximum.
    if target is not None and unavailable(target) is not None:
        pytest.skip(unavailable(target))
    step = jax.value_and_grad(lm_loss_and_accuracy, has_aux=True)
    d = runbook.diagnose(step, *LM, target=target, measure_fixes=False)
    (f,) = named(d, "vocab-logits")
    assert f.bytes >= 0.5 * d.report.total


def heads_first(q, k, v):
    """softmax(q k^T / sqrt(d)) v written out, (batch, heads, tokens, dim), no mask."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def multi_query(q, k, v):
    """Every head of q against one shared k and v, (batch, tokens, dim)."""
    s = jnp.einsum("bqhd,bkd->bhqk", q, k)
    return jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, axis=-1), v)


def attention_block(params, x):
    """A small attention layer, its weights a pytree: projections, jax.nn attention, output."""
    b, t, c = x.shape
    q, k, v = ((x @ params[n]).reshape(b, t, 4, c // 4) for n in ("wq", "wk", "wv"))
    out = jax.nn.dot_product_attention(q, k, v)
    return jnp.sum((out.reshape(b, t, c) @ params["wo"]) ** 2)


ATTENTION_BLOCK = (
    {n: S((256, 256), f32) for n in ("wq", "wk", "wv", "wo")},
    S((2, 2048, 256), f32),
)


def test_a_state_space_step_size_projection_is_not_attention():
    # A selective state space's discretisation (eqx-mamba's): step sizes from a low-rank
    # projection, tokens x rank @ rank x channels, the channels four times the tokens, then
    # exp(delta x A) with the state axis as long as the sequence. The product has T and a
    # multiple of T, and its exponential two T axes, but one factor is a weight.
    def ssm(h, w_in, w, a_log):
        delta = jax.nn.softplus(jnp.tanh(h @ w_in) @ w)  # (T, D), from tokens x rank
        return jnp.exp(delta[:, None, :] * -jnp.exp(a_log)[None]).sum()  # (T, N = T, D)

    args = (S((128, 64), f32), S((64, 4), f32), S((4, 512), f32), S((128, 512), f32))
    d = runbook.diagnose(jax.grad(ssm, argnums=(0, 1, 2, 3)), *args, measure_fixes=False)
    assert not named(d, "attention-scores"), str(d)


def test_attention_scores():
    def grad_of(attend):
        return jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=(0, 1, 2))

    heads = (S((2, 4, 2048, 64), f32),) * 3
    mqa = (S((1, 2048, 8, 64), f32), S((1, 2048, 64), f32), S((1, 2048, 64), f32))
    for fn, args in [
        (grad_of(heads_first), heads),
        (heads_first, tuple(S(a.shape, jnp.bfloat16) for a in heads)),  # the forward alone
        (grad_of(multi_query), mqa),
        (jax.grad(attention_block), ATTENTION_BLOCK),
    ]:
        d = runbook.diagnose(fn, *args, measure_fixes=False)
        (f,) = named(d, "attention-scores")
        assert f.bytes >= 0.25 * d.report.total, str(d)
        assert f.bytes >= 2048 * 2048 * 4  # one float32 score matrix at least
        assert all(b.shape.count("2048") >= 2 for b in f.evidence), str(d)  # T x T
        assert f.copy == "runbook.cases.attention_scores.attention_blockwise"
    # Clean programs: a large square product, an MLP's gradient, a softmax of a square
    # product no larger than its inputs, and the case's fixes at the seed scale.
    square = (S((4096, 4096), f32),) * 2
    seed = (S((1, 8192, 8, 64), jnp.bfloat16),) * 4
    for fn, args in [
        (lambda a, b: a @ b, square),
        (jax.grad(mlp_loss), (mlp_inputs()[0], *mlp_inputs()[2:])),
        (lambda a, b: jax.nn.softmax(a @ b), square),
        (attention_backward(attn.attention_blockwise), seed),
        (attention_backward(attn.attention_chunked), seed),
    ]:
        d = runbook.diagnose(fn, *args, measure_fixes=False)
        assert not named(d, "attention-scores"), str(d)


CONV_FEW_CHANNELS = (
    tpu_padding.conv_few_channels,
    (S((1, 8, 512, 256, 2), f32), S((3, 3, 1, 2, 1), f32)),
)

OFFLOAD = (
    jax.value_and_grad(
        lambda w, x: host_offloading.loss(w, x, host_offloading.offload_names("block_output"))
    ),
    ({"up": S((4, 256, 512), jnp.bfloat16), "down": S((4, 512, 256), jnp.bfloat16)},
     S((2, 512, 256), jnp.bfloat16)),
)  # fmt: skip


def test_every_finding_names_a_registered_case_with_its_link_and_code():
    programs = [
        (jax.grad(gather_loss), (S((256, 256), f32), S((2**22, 2), jnp.int16))),
        (loop_of_products, (S((16, 1024 * 128), f32),)),
        (jax.grad(rnn_loss), RNN),
        (lambda xs: jnp.sum(jax.vmap(per_example)(xs)), (S((32, 512 * 256), f32),)),
        (adam_like, ({"w": S((2048, 2048), f32)},) * 4),
        (lambda x: x @ jnp.asarray(TABLE), (S((64, 1024), f32),)),
        (jax.grad(lora_loss), (LORA, TOKENS)),
        (jax.value_and_grad(lm_loss), LM),
        (lambda k: jax.random.uniform(k, (4096, 4096)), (jax.eval_shape(jax.random.key, 0),)),
        (jax.jit(lambda b: (b.at[0].set(1.0), b.sum()), donate_argnums=0), (S((4096, 4096), f32),)),
        (jax.grad(attention_block), ATTENTION_BLOCK),
        # a training step whose batch's activations outweigh its weights
        (jax.jit(train_step, donate_argnums=(0, 1)), mlp_inputs((784, 1024, 1024, 10), 16384)),
    ]
    # A TPU's padding shows only in a TPU's program, offloading only where there is a host
    # memory apart from the device's: each compiled for its target, without the device.
    by_target = {"tpu-padding": (CONV_FEW_CHANNELS, "v5e"), "host-offloading": (OFFLOAD, "h100")}
    targeted = {case: p for case, p in by_target.items() if not unavailable(p[1])}
    seen = set()
    for fn, args, target in [(fn, args, None) for fn, args in programs] + [
        (fn, args, t) for (fn, args), t in targeted.values()
    ]:
        for f in runbook.diagnose(fn, *args, measure_fixes=False, target=target).findings:
            seen.add(f.case)
            assert f.case in runbook.case_names(), f.case
            assert f.link == f"cases/{f.case}.html#fix"
            assert f.link in f.fix
            assert f.copy is None or f.copy in f.fix
    # sharding-replicated and resharding need several devices: their tests name them on
    # programs of their own in a child process with 8 forced host devices.
    untested = {"sharding-replicated", "resharding"} | (set(by_target) - set(targeted))
    assert seen == set(runbook.case_names()) - untested - RUNTIME_CASES


def test_detector_table_states_each_rule():
    table = runbook.site.detector_table()
    assert len(table.rows) == len(DETECTORS)
    modules = [sys.modules[d.__module__] for d in DETECTORS]
    for row, module in zip(table.rows, modules, strict=True):
        assert row[0] == module.PATTERN
        assert row[1].split(" ")[0] == module.CASE
        assert f"{module.MIN_SHARE:.0%}" in row[2]  # the threshold, from the module itself


def test_findings_do_not_depend_on_the_function_name():
    x, idx = S((256, 256), f32), S((2**22, 2), jnp.int32)
    renamed = jax.grad(lambda a, b: gather_loss(a, b))
    first = runbook.diagnose(jax.grad(gather_loss), x, idx)
    second = runbook.diagnose(renamed, x, idx, name="something_else")
    assert [(f.case, f.bytes) for f in first.findings] == [
        (f.case, f.bytes) for f in second.findings
    ]


# --- compiled for a TPU, without the device -----------------------------------------------------

# XLA's TPU compiler writes batched matrix products as convolutions, splits an input into
# asynchronous slices that it bitcasts back together, and records no loop's trip count: the
# same mechanisms, other instructions.
TPU = "v5e"


@pytest.mark.skipif(unavailable(TPU) is not None, reason=f"no compiler for a {TPU} here")
@pytest.mark.parametrize("case", ["attention-scores", "vocab-logits", "donation", "scan-residuals"])
def test_named_in_a_tpu_program(case):
    inputs = mlp_inputs()
    state = sum(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(inputs[:2]))
    fn, args, least = {
        "attention-scores": (jax.grad(attention_block), ATTENTION_BLOCK, 0.5),
        "vocab-logits": (jax.value_and_grad(lm_loss), LM, 0.5),
        "donation": (train_step, inputs, None),
        # stacks larger than the chip's own memory (the compiler keeps smaller ones there)
        "scan-residuals": (
            jax.grad(rnn_loss),
            (RNN[0], S((256, 256), f32), S((1024, 256, 256), f32)),
            0.5,
        ),
    }[case]
    d = runbook.diagnose(fn, *args, target=TPU, measure_fixes=False)
    assert d.cases[:1] == [case], str(d)
    (f,) = named(d, case)
    if least is not None:
        assert f.bytes >= least * d.report.total
    else:  # every array of the state, the parameters the compiler reassembles included
        assert f.bytes >= 0.99 * state - 64


# --- renderings and the fit against a target ------------------------------------------------


@pytest.fixture(scope="module")
def gather_diagnosis():
    return runbook.diagnose(jax.grad(gather_loss), S((256, 256), f32), S((2**22, 2), jnp.int16))


def test_terminal_rendering(gather_diagnosis):
    text = str(gather_diagnosis)
    assert "index copy for a gather/scatter [gather-grad]" in text
    assert "cases/gather-grad.html#fix" in text
    assert "runbook.cases.gather_grad.loss_chunked" in text
    assert gather_diagnosis.report.provenance.label() in text


def test_html_rendering(gather_diagnosis):
    page = gather_diagnosis._repr_html_()
    findings, peak = page.split("<details><summary>Live at the peak")  # then the peak's table
    assert findings.count("<tr>") == 1 + len(gather_diagnosis.findings)
    assert peak.count("<tr>") == 1 + min(10, len(gather_diagnosis.at_peak))
    assert '<a href="cases/gather-grad.html#fix">' in page


def test_json(gather_diagnosis):
    data = json.loads(json.dumps(gather_diagnosis.to_json()))
    assert data["cases"] == ["gather-grad"]
    assert data["bytes"]["total"] == gather_diagnosis.report.total
    (f,) = data["findings"]
    assert set(f) >= {"pattern", "case", "bytes", "evidence", "fix"}
    assert {"size", "shape", "kind", "instruction", "op", "source"} <= set(f["evidence"][0])
    assert data["target"] is None


def test_record_round_trip(gather_diagnosis):
    again = runbook.Diagnosis.from_record(json.loads(json.dumps(gather_diagnosis.to_record())))
    assert again.findings == gather_diagnosis.findings
    assert again.report.total == gather_diagnosis.report.total


@pytest.mark.skipif(unavailable("h100") is not None, reason="no GPU compiler installed")
def test_fit_against_a_target():
    small = runbook.diagnose(adam_like, *({"w": S((1024, 1024), f32)},) * 4, target="h100")
    usable = runbook.get_target("h100").usable()
    assert small.fits
    assert small.margin == usable - small.report.total
    assert "Fits one NVIDIA H100" in str(small)
    big = runbook.diagnose(lambda a: a * 2, S((2**34,), f32), target="h100")  # 64 GiB in, 64 out
    assert big.fits is False
    assert big.margin == usable - big.report.total < 0
    assert "Does not fit" in str(big)
    assert big.to_json()["target"]["fits"] is False


@pytest.mark.skipif(unavailable(TPU) is not None, reason=f"no compiler for a {TPU} here")
def test_a_program_the_target_refuses_is_diagnosed_on_the_target():
    """An FSDP step over a v5e-8 whose logits each chip computes for the whole batch, more
    than the chip holds. XLA's TPU compiler refuses it, after writing its buffer assignment:
    the diagnosis reads that program (the mesh is on the target's devices, which this
    machine's CPU cannot compile for) and names the unsharded values, with the refusal."""
    mesh = runbook.slice_mesh("v5e-8", resharding.AXIS)
    shardings, batch = resharding.fsdp(mesh), NamedSharding(mesh, P(resharding.AXIS))
    vocab, width, hidden, layers = 32768, 512, 2048, 2
    shapes = {
        "embed": (vocab, width),
        "up": (layers, width, hidden),
        "down": (layers, hidden, width),
    }
    params = {k: S(v, f32, sharding=shardings[k]) for k, v in shapes.items()}
    tokens = S((256, 512), jnp.int32, sharding=batch)
    d = runbook.diagnose(resharding.train_step(mesh), params, tokens, tokens, target="v5e-8")
    assert d.fits is False
    assert d.refused is not None
    assert d.margin < 0
    assert d.report.provenance.target == "v5e-8"
    assert d.report.provenance.devices == 8
    assert d.report.temp > runbook.get_target("v5e").usable()  # the refused program's bytes
    assert "resharding" in d.cases, str(d)
    assert "refused" in d.report.caveats[0]
    assert "this machine's" not in d.fit_line()


# --- the command line -------------------------------------------------------------------------

USER_FILE = """
import jax, jax.numpy as jnp

def step(state, grad):
    return state - 0.1 * grad

def make_args():
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    return x, x

def branchy(x):
    if x.sum() > 0:
        return x
    return -x

def one_vector():
    return jax.ShapeDtypeStruct((4,), jnp.float32)
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(USER_FILE)
    return path


@pytest.mark.parametrize("measured", [False, True])
def test_cli_json(user_file, capsys, measured):
    argv = ["diagnose", f"{user_file}:step", "--args", f"{user_file}:make_args", "--json"]
    assert main(argv + ["--measure-fixes"] * measured) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cases"] == ["donation"]
    assert data["findings"][0]["bytes"] == 1024 * 1024 * 4
    if measured:
        assert data["findings"][0]["saving"] == 1024 * 1024 * 4
    else:
        assert data["findings"][0]["saving"] is None


def test_cli_text(user_file, capsys):
    assert main(["diagnose", f"{user_file}:step", "--args", f"{user_file}:make_args"]) == 0
    out = capsys.readouterr().out
    assert "state outputs not donated [donation]" in out
    assert "donate_argnums=(0,)" in out


@pytest.mark.parametrize(
    ("which", "expected"),
    [
        ("missing-file", "no such file"),
        ("missing-function", "has no function named 'nope'"),
        ("untraceable", "could not trace `branchy`"),
        ("no-colon", "expected path/to/file.py:function"),
        ("bad-target", "unknown target 'nope'"),
    ],
)
def test_cli_bad_locator_is_one_line_and_exit_2(user_file, which, expected):
    argv = {
        "missing-file": [f"{user_file.parent / 'nope.py'}:step"],
        "missing-function": [f"{user_file}:nope", "--args", f"{user_file}:make_args"],
        "untraceable": [f"{user_file}:branchy", "--args", f"{user_file}:one_vector"],
        "no-colon": [str(user_file)],
        "bad-target": [f"{user_file}:step", "--args", f"{user_file}:make_args", "--target", "nope"],
    }[which]
    proc = subprocess.run(
        [sys.executable, "-m", "runbook", "diagnose", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("runbook: error:")
    assert expected in lines[0]


# One loop's result read two ways: as XLA printed it up to jaxlib 0.10 (get-tuple-element
# instructions) and as newer XLA prints it (the tuple element named in the operand).
_GTE = """HloModule m, entry_computation_layout={()->f32[4]{0}}

ENTRY %main () -> f32[4] {
  %t = (s32[], f32[4]{0}) tuple()
  %w = (s32[], /*index=1*/f32[4]{0}) while(%t), condition=%c, body=%b
  %g = f32[4]{0} get-tuple-element(%w), index=1
  ROOT %r = f32[4]{0} negate(%g)
}
"""
_INLINE = """HloModule m, entry_computation_layout={()->f32[4]{0}}

ENTRY %main () -> f32[4] {
  %t = (s32[], f32[4]{0}) tuple()
  %w = (s32[], /*index=1*/f32[4]{0}) while(%t), condition=%c, body=%b
  ROOT %r = f32[4]{0} negate(%w#1)
}
"""


@pytest.mark.parametrize("text", [_GTE, _INLINE], ids=["get-tuple-element", "inline"])
def test_hlo_reader_sees_a_tuple_element_the_same_whichever_way_xla_printed_it(text):
    from runbook._hlo import parse_module

    module = parse_module(text)
    (element,) = [u for u in module.users["w"] if u.opcode == "get-tuple-element"]
    assert element.tuple_index == 1
    assert element.shape.dims == (4,)
    assert [u.opcode for u in module.users[element.name]] == ["negate"]


def _caveats(fn, dtype):
    x = jax.ShapeDtypeStruct((512, 1024), dtype)
    w = jax.ShapeDtypeStruct((1024, 2048), dtype)
    return [c for c in runbook.diagnose(fn, x, w).report.caveats if "bfloat16" in c]


def test_cpu_widening_of_bfloat16_products_is_a_caveat_with_its_bytes():
    if jax.default_backend() != "cpu":
        pytest.skip("XLA:CPU's widening")
    (caveat,) = _caveats(lambda x, w: jnp.tanh(x @ w), jnp.bfloat16)
    assert "1 bfloat16 product(s) and 2 bfloat16 operand(s)" in caveat
    # At most at once: the float32 product, and at most both float32 operand copies beside it.
    mib = float(re.search(r"([\d.]+) MiB at most at once", caveat)[1])
    assert 512 * 2048 * 4 <= mib * 2**20 <= (512 * 2048 + 512 * 1024 + 1024 * 2048) * 4
    assert _caveats(lambda x, w: jnp.tanh(x @ w), jnp.float32) == []
    # A float32 result asked for is the program's own, not a widening.
    assert (
        _caveats(
            lambda x, w: jnp.tanh(jnp.matmul(x, w, preferred_element_type=jnp.float32)),
            jnp.bfloat16,
        )
        == []
    )


def test_diagnosis_lists_the_memory_live_at_the_schedules_peak():
    """jax-ml/jax#9530: the buffers live at the peak, with what made them, in the output."""

    def step(w, x):
        h = jnp.tanh(x @ w)  # [512, 256]: live beside its product at the peak
        return (h @ w.T).sum()

    args = (
        jax.ShapeDtypeStruct((256, 256), jnp.float32),
        jax.ShapeDtypeStruct((512, 256), jnp.float32),
    )
    found = runbook.diagnose(step, *args)
    line = runbook.timeline(step, *args)
    assert found.peak == line.peak
    assert found.at_peak == line.at_peak
    assert sum(b.size for b in found.at_peak) == found.peak
    assert any(b.source and "test_diagnose.py" in b.source for b in found.at_peak)
    assert "Live at the peak" in str(found)
    assert "Live at the peak" in found._repr_html_()
    assert runbook.Diagnosis.from_record(found.to_record()).at_peak == found.at_peak
    assert json.loads(json.dumps(found.to_json()))["peak"]["bytes"] == found.peak


# A GPU program's convolution is a cuDNN library call: scores (a dot) go through one, and the
# broadcast it adds (a time embedding) is written out whole for it.
_CUDNN_CONV = """HloModule m, entry_computation_layout={(f32[64,64]{1,0}, f32[64,64]{1,0}, f32[64]{0})->f32[64,64]{1,0}}

%wrapped (p: f32[64]) -> f32[64,64] {
  %p = f32[64]{0} parameter(0)
  ROOT %b = f32[64,64]{1,0} broadcast(%p), dimensions={0}
}

ENTRY %main (q: f32[64,64], k: f32[64,64], t: f32[64]) -> f32[64,64] {
  %q = f32[64,64]{1,0} parameter(0)
  %k = f32[64,64]{1,0} parameter(1)
  %t = f32[64]{0} parameter(2)
  %s = f32[64,64]{1,0} dot(%q, %k), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %side = f32[64,64]{1,0} fusion(%t), kind=kLoop, calls=%wrapped
  %conv = (f32[64,64]{1,0}, u8[0]{0}) custom-call(%s, %side), custom_call_target="__cudnn$convBiasActivationForward"
  %h = f32[64,64]{1,0} get-tuple-element(%conv), index=0
  ROOT %e = f32[64,64]{1,0} exponential(%h)
}
"""


@pytest.mark.parametrize(("target", "multiplies"), [("__cudnn$convBiasActivationForward", True),
                                                    ("SomeLibraryCall", False)])  # fmt: skip
def test_a_cudnn_convolution_multiplies_and_its_broadcast_addend_is_the_compilers(
    target, multiplies
):
    from runbook._hlo import parse_module
    from runbook.detectors._common import is_product, made_from
    from runbook.detectors.pmap_loop import _library_addend

    program = object.__new__(Program)  # the module alone: what these questions read
    program.module = parse_module(_CUDNN_CONV.replace("__cudnn$convBiasActivationForward", target))
    program._shared = {}
    conv, exp = program.module.get("conv"), program.module.get("e")
    assert is_product(conv) is multiplies
    # An exponential of a convolution of the scores is no softmax of them: the walk back
    # from it stops at the convolution, as at XLA's own; through any other call it goes on.
    assert made_from(program, exp, {"s"}) is not multiplies
    assert _library_addend(program, program.module.get("side"))
    assert not _library_addend(program, program.module.get("s"))


# A scan's stacked outputs start as zeros that JAX's lowering makes, and XLA copies, at the
# top of the program: they carry the jit's name and call line alone, which name no operation.
_CALL_ONLY = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[4,8]{1,0}}

%body (c: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  ROOT %c = (s32[], f32[4,8]{1,0}) parameter(0)
}

%cond (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %t = pred[] constant(false)
}

ENTRY %main (x: f32[8]) -> f32[4,8] {
  %x = f32[8]{0} parameter(0)
  %zero = f32[] constant(0), metadata={op_name="jit(step)/jit(step)" source_file="eqx/_jit.py" source_line=263}
  %zeros = f32[4,8]{1,0} broadcast(%zero), dimensions={}, metadata={op_name="jit(step)/jit(step)" source_file="eqx/_jit.py" source_line=263}
  %copy = f32[4,8]{1,0} copy(%zeros)
  %i = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%i, %copy)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, metadata={op_name="jit(step)/jit(step)/while" source_file="model.py" source_line=88}
  %alone = f32[4,8]{1,0} broadcast(%zero), dimensions={}, metadata={op_name="jit(step)/jit(step)" source_file="eqx/_jit.py" source_line=263}
  %sum = f32[4,8]{1,0} add(%alone, %alone), metadata={op_name="pmap(step)/shard_map" source_file="eqx/_jit.py" source_line=263}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_buffer_named_by_its_call_alone_is_named_by_the_operation_that_uses_it():
    from runbook._hlo import names_a_call, parse_module

    module = parse_module(_CALL_ONLY)
    loop = ("jit(step)/jit(step)/while", "model.py:88")
    call = ("jit(step)/jit(step)", "eqx/_jit.py:263")
    assert all(map(names_a_call, ["jit(step)/jit(step)", "jit(_fun)/shard_map", "pmap(f)"]))
    assert not any(map(names_a_call, ["jit(step)/while", "jit(step)/jvp(f)/jit(relu)", ""]))
    for name in ("copy", "zeros"):  # the copy made from the zeros; the zeros themselves
        assert module.describe(module.get(name), past_calls=True) == loop
        assert module.describe(module.get(name)) == call  # what the detectors read
    # Nothing that uses it names an operation: the call, as before.
    assert module.describe(module.get("alone"), past_calls=True) == call
    # An input has no name of its own: it is not named after what reads it.
    assert module.describe(module.get("x"), past_calls=True) == ("", "")
