"""Children: a crash inside one (XLA's, here a real signal) is a result, never the caller's end;
forked from one server, each with its caller's devices and environment."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import runbook
from runbook import _forkserver, _subprocess
from runbook.cases import pmap_loop
from runbook.site import gather_grad


@pytest.mark.parametrize(("crash", "signal"), [("_sigsegv", "SIGSEGV"), ("_sigabrt", "SIGABRT")])
def test_a_child_that_really_crashes_raises_child_crashed(crash, signal):
    # faulthandler's own functions kill the interpreter with the signal, as XLA's SIGFPE does.
    with pytest.raises(_subprocess.ChildCrashed, match=f"crashed \\({signal}\\)") as e:
        _subprocess.call(f"faulthandler:{crash}")
    assert e.value.signal_name == signal
    assert _subprocess.failure(e.value).startswith(f"XLA crashed ({signal}), jaxlib ")


def test_an_error_in_a_child_is_not_a_crash():
    with pytest.raises(_subprocess.RunbookError) as e:
        _subprocess.call("runbook.no_such_module:f")
    assert not isinstance(e.value, _subprocess.ChildCrashed)


def test_flag_trials_record_a_crash_and_the_caller_goes_on(monkeypatch):
    real = _subprocess.call

    def crash_on_fusion(target, /, **kwargs):
        if kwargs.get("flags") == {"xla_disable_hlo_passes": "fusion"}:
            return real("faulthandler:_sigsegv")  # a real crash, in a real child
        return real(target, **kwargs)

    monkeypatch.setattr(_subprocess, "call", crash_on_fusion)
    gather_grad.flag_trials.cache_clear()  # trials another test made, without the crash
    try:
        rows = gather_grad.flag_table("tiny").rows
    finally:
        gather_grad.flag_trials.cache_clear()  # nor leave the crash to a later test
    assert rows[0][1].startswith("XLA crashed (SIGSEGV), jaxlib ")
    assert all(r[1].endswith("B") for r in rows[1:])  # the others measured: byte figures


def test_every_flag_trial_of_this_jaxlib_gives_a_figure_or_a_recorded_reason():
    for flags in gather_grad.FLAG_TRIALS:
        got = gather_grad.flag_trial(flags, "tiny")[1]
        assert isinstance(got, int) or got.startswith(("XLA crashed (", "rejected: ")), got


def test_children_that_start_themselves_stop_at_the_depth_limit(tmp_path, monkeypatch):
    (tmp_path / "self_starting.py").write_text(
        "from runbook import _subprocess\n\n"
        "def again():\n"
        "    return _subprocess.call('self_starting:again')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(_subprocess.RunbookError, match=f"at depth {_subprocess.MAX_DEPTH}"):
        _subprocess.call("self_starting:again")


def test_a_trial_of_options_on_a_multi_device_case_measures_in_one_child():
    # The child measures where it is; it used to call measure_case again, which started a
    # child for the same options, and so on without end.
    result = runbook.measure_case("pmap-loop", "tiny", compiler_options={}, at={"iterations": 1})
    assert {r.name for r in result.reports} == {v.name for v in pmap_loop.CASE.variants}
    assert result.provenance.devices == pmap_loop.DEVICES


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module the children import: where they run, and a child that takes its time."""
    (tmp_path / "forkserver_probe.py").write_text(
        "import os, time\n\n"
        "def where():\n"
        "    import jax\n"
        "    return [len(jax.devices()), os.getppid(), os.environ.get('PROBE_SAYS')]\n\n"
        "def sleep(seconds):\n"
        "    time.sleep(seconds)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "forkserver_probe"


@pytest.mark.skipif(not _forkserver.enabled(), reason="the fork server is Linux's")
def test_children_fork_from_one_server_each_with_the_callers_devices_and_environment(
    probe, monkeypatch
):
    monkeypatch.setenv("PROBE_SAYS", "a")
    seen = [_subprocess.call(f"{probe}:where", devices=n) for n in (4, 1, 2)]
    assert [(n, says) for n, _, says in seen] == [(4, "a"), (1, "a"), (2, "a")]
    parents = {parent for _, parent, _ in seen}
    assert len(parents) == 1  # one server
    assert os.getpid() not in parents  # not this process
    # Another environment (read at import, for all it knows): a server of its own.
    monkeypatch.setenv("PROBE_SAYS", "b")
    _, parent, says = _subprocess.call(f"{probe}:where")
    assert says == "b"
    assert parent not in parents | {os.getpid()}
    monkeypatch.setenv(_forkserver.SWITCH, "0")
    assert _subprocess.call(f"{probe}:where")[1] == os.getpid()  # off: a fresh Python


@pytest.mark.skipif(not _forkserver.enabled(), reason="the fork server is Linux's")
def test_a_forked_child_past_its_timeout_is_killed_and_the_server_serves_on(probe):
    with pytest.raises(subprocess.TimeoutExpired):
        _subprocess.call(f"{probe}:sleep", timeout=1, seconds=60)
    server = _forkserver._server
    assert _subprocess.call(f"{probe}:sleep", seconds=0) is None
    assert _forkserver._server is server
    assert server is not None
    assert server.alive()


@pytest.mark.skipif(not _forkserver.enabled(), reason="the fork server is Linux's")
def test_a_server_gone_before_the_order_arrives_is_replaced_by_a_new_one(probe, monkeypatch):
    _, first, _ = _subprocess.call(f"{probe}:where")
    gone = _forkserver._server
    assert gone is not None
    gone.proc.kill()  # as a server that has just left, idle: still taken for alive
    gone.proc.wait()
    monkeypatch.setattr(_forkserver.Server, "alive", lambda self: self is gone or True)
    _, second, _ = _subprocess.call(f"{probe}:where")
    assert second not in {first, os.getpid()}  # forked, from a new server


@pytest.mark.skipif(not _forkserver.enabled(), reason="the fork server is Linux's")
@pytest.mark.parametrize("when", ["before the child starts", "while the child runs"])
def test_the_server_keeps_out_of_its_callers_process_group_and_passes_an_interrupt_on(
    probe, monkeypatch, when
):
    # A Jupyter kernel, shut down, waits until no process of its group is left: a server there
    # held each page's kernel until Jupyter killed it. Out of the group, it no longer sees its
    # caller's interrupts, so the caller kills the child it waits on when interrupted, and
    # leaves the server, which would otherwise answer its next order with this one's reply.
    _subprocess.call(f"{probe}:sleep", seconds=0)
    server = _forkserver._server
    assert server is not None
    assert os.getpgid(server.proc.pid) != os.getpgrp()
    children = []
    readline = _forkserver._Lines.readline

    def interrupted(self, timeout=None):
        if timeout is None and when == "while the child runs":  # the child has started
            line = readline(self)
            children.append(json.loads(line)["pid"])
            return line
        raise KeyboardInterrupt  # as Ctrl-C

    monkeypatch.setattr(_forkserver._Lines, "readline", interrupted)
    # A child whose pid never came cannot be killed: it sleeps only a second.
    seconds = 60 if when == "while the child runs" else 1
    with pytest.raises(KeyboardInterrupt):
        _subprocess.call(f"{probe}:sleep", seconds=seconds)
    monkeypatch.setattr(_forkserver._Lines, "readline", readline)
    assert not server.alive()
    assert len(children) == (when == "while the child runs")
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed, and reaped by its server
    assert _subprocess.call(f"{probe}:where")[1] != server.proc.pid  # a new server's child
