"""`runbook.watch`: each mechanism named on loops of our own, steady loops silent, the
thresholds, bad input, the CLI and the overhead."""

from __future__ import annotations

import functools
import json
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
from runbook._watch_rules import FIXES, Thresholds
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
    worst = max(x.host_rise or 0 for x in w.compiles)
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
