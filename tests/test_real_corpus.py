"""The real-program corpus: public models' steps rewritten at their authors' scale.

At a tiny scale each program runs, and each of its fixes computes the same result, in a child
process (with forced host devices for the multi-device ones). The committed measurements
(`nox -s real-corpus`, docs/_data/corpus/real.json) cover every program on the CPU at
each release (elsewhere the page lists what a target and release still lack), and their
verdicts follow from their own figures.
"""

from __future__ import annotations

import textwrap
import types

import pytest

import runbook
from runbook import _targets
from runbook._hlo import Value
from runbook._targets import unavailable
from runbook.detectors import resharding
from runbook.site.corpus import real
from runbook.site.producers import real_corpus

# flax's lm1b models call nn.SelfAttention, which flax marks as deprecated: their code, as
# their authors wrote it.
pytestmark = pytest.mark.filterwarnings(
    "ignore:SelfAttention will be deprecated:DeprecationWarning"
)

# The children compile at XLA's backend optimization level 0 (LLVM's optimizations off):
# these whole models compile several times faster, and a fix and the program it is
# compared with are compiled alike.
FAST_COMPILE = "--xla_backend_optimization_level=0"
PROGRAMS = real.programs()
SEVERAL = [p.name for p in PROGRAMS if p.devices > 1]


def test_the_corpus_covers_what_users_run():
    assert len(PROGRAMS) >= 12
    libraries = {lib for p in PROGRAMS for lib in p.libraries}
    assert {"flax.linen", "flax.nnx", "equinox", "optax"} <= libraries
    assert SEVERAL  # a pmap step and an FSDP step
    for p in PROGRAMS:
        assert p.source.startswith("https://github.com/"), p.name
        assert "/blob/" in p.source, p.name  # at a commit
        assert p.fixes, p.name
        assert set(p.compared) <= set(p.fixes), p.name


@pytest.mark.parametrize("name", [p.name for p in PROGRAMS])
def test_each_fix_computes_the_same_result(name, child_json):
    program = real.get(name)
    script = textwrap.dedent(
        f"""
        import json
        from runbook.site.corpus.real import same_results
        print(json.dumps(same_results({name!r})))
        """
    )
    found = child_json(script, program.devices, timeout=600, xla_flags=FAST_COMPILE)
    assert set(found) == set(program.fixes)
    for case, difference in found.items():
        assert difference <= program.tolerance, (name, case, difference)


def test_the_committed_measurements_say_what_they_cover_and_follow_from_their_figures():
    data = real_corpus.load()
    rows = {(r["program"], r["target"], real_corpus.release(r)): r for r in data["rows"]}
    measured = {(target, release) for _, target, release in rows}
    assert {target for target, _ in measured} == set(real_corpus.TARGETS)
    for release in {release for _, release in measured}:  # the CPU's, every program
        assert all((p.name, "cpu", release) in rows for p in PROGRAMS), release
    # Elsewhere a target and release may lack programs (rows that compile for a target may
    # come a few at a time): the page lists those, per cell.
    assert {name for name, _, _ in rows} == {p.name for p in PROGRAMS}
    for r in data["rows"]:
        if "error" in r:
            continue
        expected = sorted(
            c for c, f in r["fixes"].items() if f.get("saving", 0) >= data["threshold"] * r["total"]
        )
        assert r["expected"] == expected
        for case, fix in r["fixes"].items():  # a fix too large is read as the program is
            assert "does not fit" not in fix.get("error", ""), (r["program"], r["target"], case)
        assert r["missed"] == sorted(set(expected) - set(r["named"]))
        assert r["false_alarms"] == sorted(set(r["named"]) - set(expected))
    assert set(data["releases"]) == {release for _, release in measured}
    said = real_corpus.fix_by_release(data, "scan-residuals")
    assert all(f"at jax {release}" in said for _, release in measured)
    assert all(p["jax"] == release for release, p in data["releases"].items())
    assert data["programs"] == real_corpus.described()  # what the page lists, as it is now
    assert "authors' scale" in real_corpus.table(data).caption


def test_nanodos_fsdp_step_is_named_whole_on_every_device_and_counted_once(child_json):
    # The FSDP step computes its activations and logits for the whole batch on each device
    # (its fix, one constraint on them, saves most of its memory at the authors' scale):
    # named there, not once the fix is applied, and no buffer counted by two findings.
    child = textwrap.dedent(
        """
        import json, runbook
        from runbook.site.corpus.real import get
        program = get("nanodo-fsdp")
        out = {}
        fixed = program.fixes["resharding"]
        for label, build in (("step", program.build), ("fixed", fixed)):
            fn, args = build("tiny", False)
            d = runbook.diagnose(fn, *args)
            out[label] = {
                "total": d.report.total,
                "findings": [[f.case, f.pattern, f.bytes, [b.instruction for b in f.evidence]]
                             for f in d.findings if not f.informational],
            }
        print(json.dumps(out))
        """
    )
    found = child_json(child, real.get("nanodo-fsdp").devices, timeout=600)
    step, fixed = found["step"], found["fixed"]
    assert ["resharding", "values computed whole on every device"] in [
        f[:2] for f in step["findings"]
    ]
    assert "values computed whole on every device" not in [f[1] for f in fixed["findings"]]
    for d in (step, fixed):
        assert sum(f[2] for f in d["findings"]) <= d["total"]
        shown = [name for f in d["findings"] for name in f[3]]
        assert len(shown) == len(set(shown)), shown  # each buffer in one finding


# The step donates its batch of token ids, which no output can reuse: as its authors wrote it.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_nanodos_fsdp_step_for_a_v5e_counts_each_buffer_once():
    # At the authors' scale XLA's TPU compiler (jax 0.10.2) gathers the logits' gradient
    # whole in an async collective that carries no JAX op: judged by what it gathers, it is
    # computed whole on every device (resharding's), not logits besides.
    if unavailable("v5e") is not None:
        pytest.skip(unavailable("v5e"))
    t = _targets.require("v5e")
    with _targets.compiling_for(t):
        fn, args = real.get("nanodo-fsdp").build("authors", False)
        d = runbook.diagnose(fn, *args, target=t)
    findings = [f for f in d.findings if not f.informational]
    assert {"resharding", "vocab-logits"} <= {f.case for f in findings}
    assert sum(f.bytes for f in findings) <= d.report.total
    shown = [(b.instruction, b.shape) for f in findings for b in f.evidence]
    assert len(shown) == len(set(shown)), shown


def test_an_instruction_with_no_op_is_judged_whole_by_what_it_moves():
    whole = {"fusion.1"}  # the op that computes its value whole on every device
    module = {
        "async-collective-start.9": types.SimpleNamespace(operands=("fusion.1",)),
        "copy.2": types.SimpleNamespace(operands=("fusion.3",)),
        "fusion.4": types.SimpleNamespace(operands=("fusion.1",)),
    }
    program = types.SimpleNamespace(
        module=types.SimpleNamespace(get=module.get),
        describe=lambda inst: ("" if inst is not module["fusion.4"] else "jit(f)/dot", ""),
        whole_on_each_device=lambda v: v.instruction in whole,
    )

    def value(name: str) -> Value:
        return Value(name, "{}", 8, 0, 0, "temp", "f32[2]")

    assert resharding._whole_on_each_device(program, value("async-collective-start.9"))
    assert not resharding._whole_on_each_device(program, value("copy.2"))  # what it moves is not
    assert not resharding._whole_on_each_device(program, value("fusion.4"))  # an op of its own


def test_the_mambas_scan_outputs_are_named_by_their_loop_not_by_the_jit():
    # equinox's filter_jit traces the step inside a second jit: the zeros each scan's stacked
    # outputs start from, and XLA's copies of them, carry that call's name and line alone.
    from runbook._hlo import names_a_call
    from runbook._program import Program
    from runbook._timeline import of_program

    fn, args = real.get("eqx-mamba").build("tiny", False)
    program = Program.compile(fn, *args)
    at_peak = of_program(program).at_peak
    called = [
        b for b in at_peak
        if names_a_call(program.describe(program.module.get(b.instruction.split()[0].split("{")[0]))[0])
    ]  # fmt: skip
    assert called  # what the detectors read: the call, for these buffers
    assert not [b for b in at_peak if names_a_call(b.op)]
    assert {b.op.rsplit("/", 1)[-1] for b in called} == {"while"}
    assert all("eqx_mamba.py" in b.source for b in called)


def test_a_fix_the_target_refuses_is_read_from_its_buffer_assignment(monkeypatch):
    # A program a v5e refuses is diagnosed from the assignment its compiler wrote; its fixes,
    # refused too, are compared with it the same way, not dropped.
    import jax
    import jax.numpy as jnp

    from runbook import _errors, _measure

    def refuse(*args, **kwargs):
        raise _errors.DoesNotFitError("no", needed=2, limit=1, what="HLO temporaries")

    monkeypatch.setattr(_measure, "measure", refuse)
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    fix = real_corpus._fix((jax.jit(lambda x: jnp.sin(x) @ x), (x,)), 10**9, None, {})
    assert 0 < fix["total"] < 10**9
    assert fix["saving"] == 10**9 - fix["total"]


def test_a_row_measured_again_keeps_one_half_and_refuses_a_changed_program():
    # After a detector changes, `--diagnose-only` times and diagnoses a row again and keeps
    # what its fixes measured: valid only while the program compiles to the same total.
    name = "kv-cache-decode"  # one device, seconds at its authors' scale
    row = real_corpus.evaluate(name, "cpu")
    kept = {case: {"total": 1, "saving": row["total"] - 1} for case in row["fixes"]}
    again = real_corpus.evaluate(name, "cpu", {**row, "fixes": kept, "date": "2026-01-02"})
    assert again["fixes"] == kept
    assert again["fixes_date"] == "2026-01-02"
    assert again["total"] == row["total"]
    assert again["named"] == row["named"]
    assert again["expected"] == sorted(kept)  # the verdicts follow the kept figures
    with pytest.raises(RuntimeError, match="its fixes must be measured again"):
        real_corpus.evaluate(name, "cpu", {**row, "total": row["total"] + 1})

    # After a fix is added or changed, `--fixes` measures it and keeps the diagnosis: the
    # verdicts follow the new figure; a program that compiles to another total is refused.
    stale = {**again, "named": ["donation"], "date": "2026-01-02"}
    refixed = real_corpus.refix(name, "cpu", stale, ["donation", "no-such-case"])
    assert set(refixed["fixes"]) == set(kept)
    assert refixed["fixes"]["donation"]["saving"] == row["fixes"]["donation"]["saving"]
    assert refixed["fixes"]["donation"]["date"] != "2026-01-02"
    assert (refixed["named"], refixed["date"]) == (["donation"], "2026-01-02")
    assert refixed["false_alarms"] == ["donation"]  # it saves under the threshold
    with pytest.raises(RuntimeError, match="without --fixes"):
        real_corpus.refix(name, "cpu", {**row, "total": row["total"] + 1}, ["donation"])


def test_a_false_alarm_with_no_fix_tried_says_so():
    # A mechanism named in a program that carries no fix for it counts as a false alarm,
    # and the table and summary say that no fix was tried: unmeasured, not refuted.
    data = real_corpus.load()
    row = next(r for r in data["rows"] if "error" not in r)
    mine = {
        **row,
        "target": "cpu",
        "fixes": {"donation": {"total": 1, "saving": 0}},
        "named": ["donation", "pmap-loop"],
        "shares": {"donation": 0.5, "pmap-loop": 0.5},
        "expected": [],
        "missed": [],
        "false_alarms": ["donation", "pmap-loop"],
    }
    one = {**data, "rows": [mine]}
    assert real_corpus.untried(mine) == ["pmap-loop"]
    shown = [r[5] for r in real_corpus.table(one).rows]
    assert shown == ["donation (false alarm), pmap-loop (false alarm: no fix tried)"]
    said = real_corpus.summary(one)
    assert "2 false alarms (1 where the program carries no fix to try)" in said
