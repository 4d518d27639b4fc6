"""`runbook.watch`: each mechanism named on loops of our own, steady loops silent, the
thresholds, bad input, the CLI and the overhead."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runbook
from runbook._case import case_names
from runbook._watch import Watch, watch
from runbook._watch_rules import FIXES, Compile, Thresholds, constant_folding, folds
from runbook._watch_run import overhead


@pytest.fixture(autouse=True, scope="module")
def _warm() -> None:
    """The process's first compilation starts XLA's compiler (host memory, seconds): do it
    before any watch, as a reader's loop would have."""
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.ones(8)))


def _step_fn(state, x):
    state = state * 0.9 + x.mean()
    return state, {"loss": (state**2).sum(), "extra": jnp.tile(x, 1)}


_step = jax.jit(_step_fn)


def train(steps: int, leak: int, keep: str = "arrays") -> Watch:
    """A training loop whose metrics carry `leak` float32s per step; `keep` says what the
    history keeps: the device arrays (the leak) or Python floats (the fix)."""
    state, history = jnp.zeros(8), []
    with watch() as w:
        for i in range(steps):
            state, metrics = _step(state, np.full((leak,), float(i), np.float32))
            if keep == "arrays":
                history.append(metrics)
            else:
                history.append(float(metrics["loss"]))
            w.step()
    return w


def _check_link(f: runbook.Finding) -> None:
    assert f.case in FIXES
    if f.case in case_names():  # the case exists: the finding points at its fix
        assert f.link == f"cases/{f.case}.html#fix"
        assert f.copy in (FIXES[f.case], None)
    else:
        assert f.link is None
        assert f.copy is None


def test_live_references_named_with_what_holds_them():
    w = train(12, 64 * 1024)
    (f,) = w.findings
    assert f.case == "live-references"
    assert isinstance(f, runbook.Finding)
    _check_link(f)
    per_step = 64 * 1024 * 4
    assert f.bytes >= 10 * per_step  # ten steps after the two warm-up steps
    (g, *_) = w.growth
    assert g.shape == "float32[65536]"
    assert g.arrays == 10
    assert g.bytes == 10 * per_step
    assert "`history`" in g.holder
    assert "key 'extra'" in g.holder
    assert "history" in f.detail
    assert "float32[65536] x10" in f.detail
    assert w.cases == ["live-references"]


def test_the_fix_loop_is_silent():
    w = train(12, 64 * 1024, keep="floats")
    assert w.findings == ()
    assert w.growth == []
    assert "No finding" in str(w)


@pytest.mark.parametrize(("leak", "flagged"), [(26000, False), (26400, True)])
def test_growth_threshold_just_below_and_above(leak, flagged):
    # ten steps after the warm-up, 4 * leak bytes each: 1,040,000 B is below 1 MiB, 1,056,000 above
    w = train(12, leak)
    assert 10 * 4 * leak <= w.records[-1].total - w.records[2].total < 10 * 4 * leak + 4096
    assert bool(w.findings) is flagged


def test_growth_that_stops_is_not_flagged():
    """One large allocation after the warm-up, then a steady state: not steady growth."""
    state, cache = jnp.zeros(8), []
    with watch() as w:
        for i in range(12):
            state, _ = _step(state, np.ones((8,), np.float32))
            if i == 4:
                cache.append(jnp.ones(2**20))
            w.step()
    assert w.records[-1].total - w.records[2].total >= 4 * 2**20
    assert w.findings == ()
    assert w.findings_for(rising=0.1)[0].case == "live-references"  # the share decides


def _lengths_loop(lengths: list[int]) -> Watch:
    def batch_step(state, x):  # a new function: its compiles are this loop's alone
        return _step_fn(state, x)

    state, step = jnp.zeros(8), jax.jit(batch_step)
    with watch() as w:
        for n in lengths:
            state, _ = step(state, np.ones((n,), np.float32))
            w.step()
    return w


@pytest.mark.parametrize(("changes", "flagged"), [(2, False), (3, True)])
def test_recompilation_threshold(changes, flagged):
    """A new batch length in `changes` steps after the warm-up; 3 is the threshold (and
    each of the steps after the warm-up compiles: the share is tested below)."""
    lengths = [16, 16] + [17 + i for i in range(changes)]
    w = _lengths_loop(lengths)
    ours = [c for c in w.compiles if "batch_step" in c.function]
    assert len(ours) == 1 + changes
    assert bool(w.findings) is flagged
    if flagged:
        (f,) = w.findings
        assert f.case == "recompilation"
        assert "batch_step" in f.detail
        _check_link(f)
    # every compile after the first says what changed: JAX's explanation or the types
    assert all(c.change for c in ours[1:])
    assert not ours[0].change
    assert any(str(17 + changes - 1) in c.change for c in ours[1:])


def test_compiles_that_die_out_are_not_recompiling():
    """Three new lengths, then a steady run: under half the steps after the warm-up
    compiled (shape buckets filling up), so no finding unless the share is lowered."""
    lengths = [16, 16, 17, 18, 19] + [19] * 6
    w = _lengths_loop(lengths)
    assert len([c for c in w.compiles if "batch_step" in c.function]) == 4
    assert w.findings == ()
    assert w.findings_for(recompile_share=0.25)[0].case == "recompilation"


def test_recompilation_on_a_static_argument_is_named():
    fn = jax.jit(lambda x, k: x * k, static_argnums=1)
    with watch() as w:
        for i in range(8):
            fn(jnp.ones(4), i)
            w.step()
    (f,) = w.findings
    assert f.case == "recompilation"
    ours = [c for c in w.compiles if "lambda" in c.function]
    assert len(ours) == 8
    # JAX names the static value (0.10) or cannot explain the miss (0.12): either way the
    # change says a static argument
    assert all("static argument" in c.change for c in ours[1:])
    # same argument types: JAX explains the static value, or we say what else changed
    assert all(c.types == ours[0].types for c in ours)


def test_steady_training_loop_is_silent():
    """An MLP trained with SGD, same shapes every step, losses kept as floats."""
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.standard_normal((32, 32)), jnp.float32) for _ in range(3)]

    @jax.jit
    def sgd(params, x, y):
        def loss(ps):
            h = x
            for p in ps:
                h = jnp.tanh(h @ p)
            return jnp.mean((h - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return [p - 0.01 * g for p, g in zip(params, grads, strict=True)], value

    losses = []
    with watch() as w:
        for _ in range(15):
            x = rng.standard_normal((16, 32)).astype(np.float32)
            params, value = sgd(params, x, x)
            losses.append(float(value))
            w.step()
    assert w.findings == ()
    assert sum(c.step > 2 for c in w.compiles) == 0
    assert len(w.records) == 16
    assert w.steps == 15


def _fold_loop(n: int, **overrides) -> Watch:
    table = np.linspace(0, 1, n, dtype=np.float32)

    @jax.jit
    def lookup(ids):
        return (jnp.cos(jnp.asarray(table)) * 2 + 1)[ids]  # folded by XLA at compile time

    with watch(**overrides) as w:
        for i in range(3):
            lookup(np.arange(8) + i)
            w.step()
    return w


def test_constant_folding_named_and_its_threshold():
    # The rise of the host's peak is exact where the compile sets the process's peak, and a
    # lower bound late in a long test run, whose peak was set before: the threshold is put
    # at what this run measured. tests/test_watch_cases.py names the case in a fresh process.
    w = _fold_loop(2**20, compile_host=2**40, slow_compile=600.0)
    (c,) = [c for c in w.compiles if "lookup" in c.function]
    assert c.host_rise is not None
    assert c.constants is not None
    assert c.constants >= 4 * 2**20  # the folded table
    worst = max(x.host_rise or 0 for x in w.compiles if folds(x, w.thresholds))
    (f,) = w.findings_for(compile_host=worst, slow_compile=600.0)
    assert f.case == "constant-folding"
    assert f.bytes == worst
    _check_link(f)
    assert w.findings_for(compile_host=worst + 1, slow_compile=600.0) == ()  # just above: silent
    # and the seconds: the compile's own time decides
    assert w.findings_for(compile_host=2**40, slow_compile=c.seconds * 1.01 + 1e-6) == ()
    assert w.findings_for(compile_host=2**40, slow_compile=c.seconds * 0.99)


def test_constant_folding_fix_is_silent_under_the_same_thresholds():
    table = jnp.linspace(0, 1, 2**20, dtype=jnp.float32)

    @jax.jit
    def lookup(table, ids):
        return (jnp.cos(table) * 2 + 1)[ids]

    with watch(compile_host=16 * 2**20, slow_compile=600.0) as w:
        for i in range(3):
            lookup(table, np.arange(8) + i)
            w.step()
    assert w.findings == ()


def _sgd_mlp(width: int, rng: np.random.Generator):
    """An MLP's parameters and a jitted SGD-with-momentum step: the state a real loop
    replaces every step (parameters, momentum, loss)."""
    params = [
        jnp.asarray(rng.standard_normal((width, 2 * width)) / width, jnp.float32),
        jnp.asarray(rng.standard_normal((2 * width, width)) / width, jnp.float32),
    ]

    @jax.jit
    def sgd(params, momentum, x):
        def loss(ps):
            return jnp.mean((jnp.tanh(x @ ps[0]) @ ps[1] - x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        momentum = [0.9 * m + g for m, g in zip(momentum, grads, strict=True)]
        return [p - 1e-3 * m for p, m in zip(params, momentum, strict=True)], momentum, value

    return params, [jnp.zeros_like(p) for p in params], sgd


def test_a_slow_compile_without_folding_is_silent():
    """Seconds (or host memory) alone are no evidence of constant folding: with thresholds
    every compile crosses, a steady loop's compiles (the first included) draw no finding,
    while a table built inside jit from no argument (the case's reproduction) still does."""
    everything = {"slow_compile": 0.0, "compile_host": 0}
    rng = np.random.default_rng(0)
    params, momentum, sgd = _sgd_mlp(64, rng)
    losses = []
    with watch(**everything) as w:
        for _ in range(8):
            x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
            params, momentum, value = sgd(params, momentum, x)
            losses.append(float(value))
            w.step()
    assert any("sgd" in c.function for c in w.compiles)
    # the watch read every program: what it compiled holds no large constant
    assert all(c.constants is not None and c.constants < 2**20 for c in w.compiles)
    assert w.findings == ()

    from runbook.cases.constant_folding import table_from_argument, table_inside_jit

    x = jnp.ones((256, 1024), jnp.float32)  # a 1 MiB table from a 4 MiB base
    folded, fixed = jax.jit(table_inside_jit), jax.jit(table_from_argument)
    with watch(**everything) as w:
        for _ in range(3):
            jax.block_until_ready(folded(x))
            w.step()
    (f,) = w.findings
    assert f.case == "constant-folding"
    assert "table_inside_jit" in f.detail
    assert "1.00 MiB of constants" in f.detail
    _check_link(f)
    with watch(**everything) as w:
        for _ in range(3):
            jax.block_until_ready(fixed(x, jnp.float32(1.0)))
            w.step()
    assert w.findings == ()


def test_xla_slow_folding_alarm_is_evidence_too():
    """XLA's own alarm names a slow compilation as folding, whatever its constants; seconds
    alone, or constants below `fold_constant`, do not."""
    t = Thresholds()
    slow = Compile("jit(f)", 1, 5.0, ("float32[8]",), constants=0, fold_warnings=0)
    assert constant_folding([slow], t) == []
    alarmed = dataclasses.replace(slow, fold_warnings=1)
    (f,) = constant_folding([alarmed], t)
    assert f.case == "constant-folding"
    assert "slow-folding alarm 1 time" in f.detail
    assert constant_folding([dataclasses.replace(slow, constants=2**20 - 1)], t) == []
    assert constant_folding([dataclasses.replace(slow, constants=2**20)], t)
    quick = dataclasses.replace(alarmed, seconds=0.5, host_rise=0)
    assert constant_folding([quick], t) == []  # evidence alone: not slow, not a finding


def test_xla_log_is_read_and_passed_on(capfd):
    """While XLA compiles, descriptor 2 goes through the watch's pipe: every line still
    reaches stderr, and the slow-folding alarms (the prefixed line, once each) are counted."""
    from runbook._watch import _XlaLog

    log = _XlaLog()
    assert log.start()
    os.write(2, b"E0101 00:00:00.0 1 slow_operation_alarm.cc:74] Constant folding an ")
    os.write(2, b"instruction is taking > 1s:\n\n  %reduce = f32[8]{0} reduce(...)\n")
    os.write(2, b"Constant folding an instruction is taking > 1s:\nother line\n")
    log.stop()
    assert log.alarms == 1
    err = capfd.readouterr().err
    assert err.count("Constant folding an instruction is taking > 1s") == 2
    assert "other line" in err
    os.write(2, b"after\n")  # descriptor 2 is back
    assert capfd.readouterr().err == "after\n"


def _loss_loop(watched: bool) -> tuple[int, int, int, list[str]]:
    """A loop that keeps only its loss (a scalar a step), in a function of its own: the
    live arrays before it, after the `with` block and once the loop's variables are
    deleted; and the shapes the watch says grew."""
    rng = np.random.default_rng(1)
    params, momentum, sgd = _sgd_mlp(64, rng)
    jax.block_until_ready(sgd(params, momentum, jnp.ones((32, 64), jnp.float32)))
    before = len(jax.live_arrays())
    losses = []
    w = watch() if watched else None
    with w if w is not None else contextlib.nullcontext():
        for _ in range(12):
            x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
            params, momentum, value = sgd(params, momentum, x)
            losses.append(value)
            if w is not None:
                w.step()
    after = len(jax.live_arrays())
    del params, momentum, value, x, losses, sgd
    deleted = len(jax.live_arrays())
    return before, after, deleted, [g.shape for g in w.growth] if w is not None else []


def test_the_watch_keeps_no_array_alive():
    """The holder scan reads the loop's variables: once it returns it holds nothing (no
    frame, no snapshot of the frame's variables, no referrer list), so the loop's arrays
    die with the loop's variables, as in an unwatched run, and only the losses grow."""
    b0, a0, d0, _ = _loss_loop(watched=False)
    b1, a1, d1, grew = _loss_loop(watched=True)
    assert a0 - b0 == 12 + 1  # the losses and the last batch (new parameters for old)
    assert a1 - b1 == a0 - b0
    assert d0 == b0 - 4  # the parameters and momentum made before the loop are gone too
    assert d1 - b1 == d0 - b0
    assert grew == ["float32[]"]


def test_growth_rate_matches_the_live_arrays():
    """A loop that keeps each batch: the watch's growth per step is what the kept list
    gains per step, read from `jax.live_arrays()`, within 10%."""
    rng = np.random.default_rng(2)
    params, momentum, sgd = _sgd_mlp(128, rng)
    kept: list[jax.Array] = []
    live = []  # the live arrays' bytes that the kept list holds, after each step
    with watch() as w:
        for _ in range(20):
            x = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
            params, momentum, _ = sgd(params, momentum, x)
            kept.append(x)
            ids = {id(k) for k in kept}
            live.append(sum(a.nbytes for a in jax.live_arrays() if id(a) in ids))
            w.step()
    warmup = w.thresholds.warmup
    truth = (live[-1] - live[warmup - 1]) / (20 - warmup)
    assert truth == pytest.approx(256 * 128 * 4, rel=0.01)  # one batch a step
    (f,) = w.findings
    assert f.case == "live-references"
    reported = f.bytes / (w.steps - warmup)
    assert reported == pytest.approx(truth, rel=0.1), f.detail
    assert f"({runbook.fmt_bytes(reported)} per step" in f.detail
    (g, *_) = w.growth
    assert g.bytes / g.arrays == pytest.approx(truth, rel=0.1)


def test_nothing_happened_is_one_line():
    with pytest.raises(runbook.RunbookError, match="nothing happened"), runbook.watch():
        pass


def test_step_never_called_is_one_line():
    w = runbook.watch()
    with pytest.raises(runbook.RunbookError, match=r"w\.step\(\) was never called"), w:
        jnp.arange(5) * 3


def test_the_block_raised_keeps_the_record():
    def loop(w: Watch) -> None:
        with w:
            for i in range(3):
                jnp.ones(4) * i
                w.step()
            raise ValueError("bad batch")

    w = runbook.watch()
    with pytest.raises(ValueError, match="bad batch"):
        loop(w)
    assert w.steps == 3
    assert w.error == "ValueError: bad batch"
    assert "raised: ValueError: bad batch" in str(w)
    assert "3 steps" in str(w)


def test_misuse_is_one_line():
    w = runbook.watch()
    with pytest.raises(runbook.RunbookError, match="outside its watch"):
        w.step()
    with watch() as outer:
        with pytest.raises(runbook.RunbookError, match="do not nest"), watch():
            pass
        outer.step()
    with pytest.raises(runbook.RunbookError, match="already used"), outer:
        pass
    with pytest.raises(runbook.RunbookError, match="rising"):
        watch(rising=2.0)
    with pytest.raises(runbook.RunbookError, match="unexpected keyword"):
        watch(nonsense=1)


def test_flags_and_logging_are_restored(caplog):
    before = (jax.config.jax_log_compiles, jax.config.jax_explain_cache_misses)
    with watch() as w:
        jax.jit(lambda x: x - 1)(jnp.ones(3))
        w.step()
    assert (jax.config.jax_log_compiles, jax.config.jax_explain_cache_misses) == before
    assert not [r for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert w.compiles  # seen, though not shown on the console


def test_report_renders():
    w = train(8, 64 * 1024)
    text, page = str(w), w._repr_html_()
    assert "[live-references]" in text
    assert "fix:" in text
    assert "live-references" in page
    assert "<table" in page
    assert str(w.table()).count("\n") >= 9
    assert "function" in str(w.compile_table())
    data = json.loads(json.dumps(w.to_json()))
    assert data["cases"] == ["live-references"]
    assert len(data["records"]) == 9
    assert data["thresholds"]["warmup"] == Thresholds().warmup


def test_overhead_is_measured():
    o = overhead(steps=20, arrays=200, repeats=2)
    assert o["seconds_with"] > 0
    assert o["seconds_without"] > 0
    assert o["live_arrays"] >= 200
    assert o["overhead_seconds"] < 0.05  # reading 200 arrays per step costs milliseconds


LOOP = """
import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def train_step(state, x):
    state = state * 0.5 + x.mean()
    return state, x * 2


def main(mark_step):
    state, history = jnp.zeros(8), []
    for i in range(10):
        state, out = train_step(state, np.full((2**16,), float(i), np.float32))
        history.append(out)
        mark_step()


def main_no_param():
    state = jnp.zeros(8)
    for i in range(10):
        state, out = train_step(state, np.full((2**16,), float(i), np.float32))


def main_raises(mark_step):
    for _ in range(4):
        mark_step()
    raise ValueError("bad batch")


def main_no_step(mark_step):
    jnp.ones(3) + 1
"""


@pytest.fixture
def loop_file(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(LOOP))
    return path


def test_cli_callback_names_the_leak(loop_file, capsys):
    from runbook._cli import main

    assert main(["watch", f"{loop_file}:main", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["steps"] == 10
    assert data["cases"] == ["live-references"]


def test_cli_step_on_and_steps(loop_file, capsys):
    from runbook._cli import main

    assert (
        main(["watch", f"{loop_file}:main_no_param", "--step-on", "train_step", "--steps", "6"])
        == 0
    )
    out = capsys.readouterr().out
    assert "6 steps" in out
    assert "No finding" in out
    module = sys.modules[
        next(
            n
            for n in sys.modules
            if n.startswith("_runbook_user_")
            and getattr(sys.modules[n], "__file__", "") == str(loop_file)
        )
    ]
    assert type(module.train_step).__name__ != "function"  # the jitted function is back


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["main_no_param"], "takes no parameter to receive mark_step"),
        (["main_no_param", "--step-on", "nope"], "has no function 'nope'"),
        (["main_no_step"], "w.step() was never called"),
        (["main_raises"], "raised ValueError: bad batch"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(loop_file, argv, expected):
    name, *rest = argv
    proc = subprocess.run(
        [sys.executable, "-m", "runbook", "watch", f"{loop_file}:{name}", *rest],
        capture_output=True,
        text=True,
        env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert proc.returncode == 2
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("runbook:")]
    assert expected in line
    if name == "main_raises":  # the record is printed all the same
        assert "4 steps" in proc.stdout


def test_public_api():
    assert runbook.watch is watch
    assert runbook.Watch is Watch
    assert "watch" in runbook.__all__
    assert "Watch" in runbook.__all__
    assert watch.__doc__
    assert Watch.__doc__
    assert Watch.step.__doc__
    assert functools.reduce(lambda a, f: a and bool(f.__doc__), [Thresholds, overhead], True)


def test_a_users_own_compile_log_still_reaches_them(caplog):
    jax.config.update("jax_log_compiles", True)
    try:
        with watch() as w:
            jax.jit(lambda x: x * 7)(jnp.ones(3))
            w.step()
        assert jax.config.jax_log_compiles
    finally:
        jax.config.update("jax_log_compiles", False)
    assert [r for r in caplog.records if r.getMessage().startswith("Compiling")]
    assert not [r for r in caplog.records if "TRACING CACHE MISS" in r.getMessage()]
    assert w.compiles
