"""runbook.timeline: live bytes over program order, by hand, across the cases, per target."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import runbook
from runbook import _targets
from runbook._cli import main
from runbook._program import Program
from runbook._subprocess import child_env
from runbook._timeline import KINDS, of_program

SIDE = 256
S = SIDE * SIDE * 4  # bytes of one (256, 256) float32 matrix
MAT = jax.ShapeDtypeStruct((SIDE, SIDE), jnp.float32)


def chain(x, w):
    a = x @ w
    b = a @ w
    return b @ w


A_LINE = chain.__code__.co_firstlineno + 1  # the lines that make a and b
B_LINE = A_LINE + 1


def test_a_chain_of_products_is_counted_by_hand():
    t = runbook.timeline(chain, MAT, MAT)
    assert len(t.instructions) == len(t.positions) == len(t.bytes)
    assert all(len(t.live[k]) == len(t.instructions) for k in KINDS)
    # x and w live throughout; a while b is computed from it; b while c is; c to the end.
    assert t.live["argument"] == (2 * S,) * len(t.instructions)
    products = [i for i, name in enumerate(t.instructions) if name.startswith("dot")]
    assert len(products) == 3
    first, second, third = products
    assert [t.bytes[p] for p in products] == [3 * S, 4 * S, 4 * S]
    assert all(t.bytes[p] == 2 * S for p in range(first))
    assert t.peak == 4 * S
    assert t.position == second
    assert t.peak_instruction.startswith(t.instructions[second])
    # Every allocation holds a live value at the peak: the peak is the compiled total.
    assert t.idle == dict.fromkeys(KINDS, 0)
    assert t.peak == t.total == t.report.total
    assert third > second


def test_the_buffers_at_the_peak_name_their_op_and_line():
    t = runbook.timeline(chain, MAT, MAT)
    assert sum(b.size for b in t.at_peak) == t.peak
    assert [b.size for b in t.at_peak] == sorted((b.size for b in t.at_peak), reverse=True)
    made = {b.source for b in t.at_peak if b.kind != "argument"}
    here = pathlib.Path(__file__).name
    assert made == {
        f"tests/{here}:{A_LINE} (chain)",
        f"tests/{here}:{B_LINE} (chain)",
    }
    assert all(b.op.endswith("dot_general") for b in t.at_peak if b.kind != "argument")
    assert sorted(b.op for b in t.at_peak if b.kind == "argument") == ["w", "x"]
    assert all(b.shape == f"f32[{SIDE},{SIDE}]" for b in t.at_peak)
    text = str(t)
    assert "peak 1.00 MiB" in text
    assert f"{here}:{B_LINE}" in text
    table = t.table(3)
    assert len(table.rows) == 3
    assert "peak 1.00 MiB" in table.caption
    assert f"jax {jax.__version__}" in table.caption
    assert "<table" in t._repr_html_()
    assert "dot_general" in t._repr_html_()
    back = json.loads(json.dumps(t.to_json()))
    assert back["peak"] == t.peak == back["total"]
    assert back["live"]["argument"] == list(t.live["argument"])
    assert back["jax"] == jax.__version__
    assert back["target"] is None
    assert len(back["at_peak"]) == len(t.at_peak)


def loop(x):
    return lax.fori_loop(0, 4, lambda i, c: jnp.sin(c) @ c, x)


def test_what_a_loop_carries_is_live_in_its_body():
    # In the body: x (the argument), the carried matrix, sin of it and their product. The
    # carry is a value XLA marks as a phi; without it the body would show a matrix less.
    t = runbook.timeline(loop, MAT)
    assert 4 * S <= t.peak <= t.total
    assert sum(t.idle.values()) == t.total - t.peak
    assert t.idle["argument"] == 0
    assert any(b.instruction.startswith("dot") for b in t.at_peak)


@pytest.mark.parametrize("target", ["cpu", "h100", "v5e"])
def test_peak_and_total_within_alias_accounting_across_cases(target):
    # Every reproduction and fix of every case, tiny scale, in a child with enough host
    # devices for the multi-device cases (a target's own devices for a target). Beside each
    # timeline, the bytes occupied at each position, counted independently: the union of
    # the byte ranges of the values live there, allocation by allocation.
    if target != "cpu" and _targets.unavailable(target):
        pytest.skip(_targets.unavailable(target))
    proc = subprocess.run(
        [sys.executable, "-c", ACROSS, target],
        env=child_env(max(runbook.get_case(n).devices for n in runbook.case_names())),
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {r["case"] for r in rows} == set(runbook.case_names())
    for r in rows:
        where = f"{r['case']} {r['variant']} on {target}"
        assert r["bytes"] == r["occupied"], where  # no piece of memory counted twice
        assert r["unranged"] == 0, where
        assert min(r["idle"].values()) >= 0, where
        # The peak is what the allocations hold less what they leave idle at the peak...
        assert r["peak"] + sum(r["idle"].values()) == r["allocated"], where
        if target == "v5e":  # ... and a TPU compiler's total is its own figure
            assert r["unassigned"] == r["total"] - r["allocated"], where
        else:  # ... which add up to the total, a donated buffer once (the alias)
            assert r["allocated"] == r["total"], where
    if target == "cpu":
        assert [r for r in rows if r["alias"]]  # donation, frozen-params, inplace-copy, ...
        exact = {(r["case"], r["variant"]) for r in rows if r["peak"] == r["total"]}
        assert ("gather-grad", "grad") in exact


ACROSS = textwrap.dedent(
    """
    import json, sys, warnings
    from runbook import _targets
    from runbook._case import case_names, get_case
    from runbook._program import Program
    from runbook._timeline import KINDS, of_program

    def occupied(program, n):
        out = []
        values = [v for v in program.values + program.phis if v.space == 0 and v.kind in KINDS]
        for p in range(n):
            spans = {}
            for v in values:
                r = program.live.get((v.instruction, v.index))
                if r is not None and r[0] <= p <= r[1]:
                    spans.setdefault(v.allocation, []).append((v.offset, v.offset + v.size))
            total = 0
            for pieces in spans.values():
                end = -1
                for a, b in sorted(pieces):
                    total += max(0, b - max(a, end))
                    end = max(end, b)
            out.append(total)
        return out

    target = None if sys.argv[1] == "cpu" else _targets.require(sys.argv[1])
    platform = target.platform if target else "cpu"
    rows = []
    for name in case_names():
        case = get_case(name)
        size = case.scales["tiny"]
        params = case.grid(size)[-1]
        for v in case.variants:
            if v.role == "baseline" or not case.available(v):
                continue
            if v.unavailable is not None and v.unavailable(platform):
                continue
            # a fix that donates what no output can reuse warns; meshes on target devices
            with warnings.catch_warnings(), _targets.compiling_for(target):
                warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                program = Program.compile(
                    v.program(params), *case.inputs(v, size, params, False), target=target,
                    compiler_options=None if target else case.options(), name=v.name,
                    measure_fixes=False)
            t = of_program(program)
            rows.append({
                "case": name, "variant": v.name, "peak": t.peak, "total": t.total,
                "unassigned": t.unassigned,
                "alias": t.report.alias, "allocated": sum(t.allocated.values()),
                "idle": t.idle, "unranged": len(t.unranged), "bytes": list(t.bytes),
                "occupied": occupied(program, len(t.instructions)),
            })
    print(json.dumps(rows))
    """
)


@pytest.mark.parametrize("target", ["h100", "v5e"])
def test_a_target_compiler_gives_a_timeline(target):
    if _targets.unavailable(target):
        pytest.skip(_targets.unavailable(target))
    from runbook.cases.scan_residuals import CASE

    size = CASE.scales["tiny"]
    params = CASE.grid(size)[-1]
    variant = CASE.variant("grad")
    t = runbook.timeline(
        variant.program(params), *CASE.inputs(variant, size, params, False), target=target
    )
    assert t.provenance.target == target
    assert min(t.idle.values()) >= 0
    assert t.peak + sum(t.idle.values()) == sum(t.allocated.values())
    if target == "h100":  # the GPU compiler's allocations add up to its total
        assert t.unassigned == 0
        assert t.peak + sum(t.idle.values()) == t.total
    else:  # the TPU compiler's total is its own figure; the timeline, its allocations'
        assert t.unassigned == t.total - sum(t.allocated.values())
    assert t.at_peak
    assert all(b.op for b in t.at_peak if b.size >= 4096)


def test_a_program_the_target_refuses_is_drawn_from_what_its_compiler_wrote():
    """An out-of-memory compile explained: XLA's TPU compiler refuses an RNN whose saved
    steps exceed the chip, after writing its buffer assignment and live ranges. The timeline
    draws that program: its peak is past the chip's memory, held by the loop's stacks."""
    if _targets.unavailable("v5e"):
        pytest.skip(_targets.unavailable("v5e"))

    def loss(w, h0, xs):
        def step(h, x):
            h = jnp.tanh(h @ w + x)
            return h, h

        return jnp.sum(lax.scan(step, h0, xs)[1] ** 2)

    f32 = jnp.float32
    args = (
        jax.ShapeDtypeStruct((1024, 1024), f32),
        jax.ShapeDtypeStruct((256, 1024), f32),
        jax.ShapeDtypeStruct((8192, 256, 1024), f32),  # 8 GiB of inputs, as much per stack
    )
    with pytest.raises(runbook.DoesNotFitError):
        runbook.measure(jax.grad(loss), *args, target="v5e")
    t = runbook.timeline(jax.grad(loss), *args, target="v5e")
    assert t.provenance.target == "v5e"
    assert t.peak > runbook.get_target("v5e").usable()
    assert "refused" in str(t)
    assert t.at_peak[0].size >= 8192 * 256 * 1024 * 4  # a stack of every step's state


def test_plot_marks_the_peak_and_names_the_compiler():
    import matplotlib

    matplotlib.use("Agg")
    t = runbook.timeline(chain, MAT, MAT)
    ax = t.plot()
    title = ax.get_title()
    assert f"jax {jax.__version__}" in title
    assert "CPU" in title
    assert len(ax.collections) == len(KINDS)  # one band per kind, stacked
    top = max(ax.collections[-1].get_paths()[0].vertices[:, 1])
    assert top == pytest.approx(t.peak / 2**20)  # drawn in MiB
    assert any(list(line.get_xdata()) == [t.position] * 2 for line in ax.lines)
    if _targets.unavailable("h100") is None:
        assert "H100" in runbook.timeline(chain, MAT, MAT, target="h100").plot().get_title()


def test_no_live_ranges_is_one_line():
    program = Program.compile(chain, MAT, MAT)
    program.schedule = []
    with pytest.raises(runbook.RunbookError, match=r"wrote no live ranges for `chain`"):
        of_program(program)


USER = textwrap.dedent(
    """
    import jax, jax.numpy as jnp

    def chain(x, w):
        a = x @ w
        b = a @ w
        return b @ w

    def make_args():
        return (jax.ShapeDtypeStruct((256, 256), jnp.float32),) * 2
    """
)


def test_cli_prints_the_peak_and_writes_a_png(tmp_path, capsys):
    user = tmp_path / "user.py"
    user.write_text(USER)
    png = tmp_path / "timeline.png"
    argv = ["timeline", f"{user}:chain", "--args", f"{user}:make_args", "--png", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Timeline of chain: peak 1.00 MiB" in out
    assert "user.py:5 (chain)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["timeline", f"{user}:chain", "--args", f"{user}:make_args", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak"] == 4 * S


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    user = tmp_path / "user.py"
    user.write_text(USER)
    assert main(["timeline", f"{user}:nope"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"runbook: error: `{user}:nope`: {str(user)!r} has no function named 'nope'"
    )
    assert main(["timeline", f"{user}:chain", "--target", "h99"]) == 2
    assert "unknown target 'h99'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("case", "variant"),
    [("gather-grad", "grad"), ("prng-temporaries", "threefry"), ("donation", "donated")],
)
def test_the_peak_agrees_with_a_real_run_on_cpu(case, variant):
    from runbook.site.producers import timeline_check

    found = timeline_check.check(case, variant)
    assert found["peak"] <= found["total"]
    assert found["agrees"], found
    # which number to trust: the sum of the program measure compiles agrees with its run
    assert timeline_check.agrees(found["real"], found["sum"]), found


def test_the_committed_real_run_check_covers_every_single_program_variant():
    from runbook.site.producers import timeline_check

    data = timeline_check.load()
    rows = {(r["case"], r["variant"]) for r in data["rows"]}
    if data["provenance"]["jax"] == jax.__version__:  # which variants exist is per release
        assert rows == set(timeline_check.variants())
    else:
        assert rows <= {
            (c, v.name) for c in runbook.case_names() for v in runbook.get_case(c).variants
        }
    assert data["provenance"]["backend"] == "cpu"
    assert data["provenance"]["jax"]
    assert all(r["peak"] <= r["total"] for r in data["rows"])
    assert "agree" in timeline_check.table(data).caption


def test_the_committed_check_says_which_number_to_trust():
    from runbook.site.producers import timeline_check

    data = timeline_check.load()
    numbers = timeline_check.numbers_summary(data)
    assert numbers["variants"] == len(data["rows"])  # every row has the three numbers
    for key in ("sum", "xla_peak", "ynn_off"):
        n = numbers[key]
        assert n["of"] == numbers["variants"]
        assert 0 <= n["agree"] <= n["of"]
        assert n["low"] <= n["median"] <= n["high"]
    # recomputed from the rows, not taken from the summary
    agreeing = sum(timeline_check.agrees(r["real"], r["sum"]) for r in data["rows"])
    assert numbers["sum"]["agree"] == agreeing
    assert len(timeline_check.numbers_table(data).rows) == numbers["variants"]


def test_the_committed_check_holds_each_number_on_the_targets_too():
    from runbook.site.producers import timeline_check

    data = timeline_check.load()
    found = timeline_check.target_summary(data)
    assert set(found) == set(data["target_provenance"]) == set(timeline_check.TARGETS)
    for target, n in found.items():
        rows = [r["targets"][target] for r in data["rows"] if "sum" in r["targets"][target]]
        assert n["of"] == len(rows) > 0
        # recomputed from the rows
        assert n["equal"] == sum(abs(r["xla_peak"] - r["sum"]) <= 0.01 * r["sum"] for r in rows)
        assert n["above"] == sum(r["xla_peak"] > 1.01 * r["sum"] + 2**20 for r in rows)
        assert n["low"] <= n["high"]
    # A target's figures are compile-time predictions, labelled as such.
    assert all("without the device" in n["label"] for n in found.values())


def test_a_target_number_is_the_program_measure_compiles_for_it():
    from runbook._targets import unavailable
    from runbook.site.producers import timeline_check

    if unavailable("h100"):
        pytest.skip(unavailable("h100"))
    row = {"case": "gather-grad", "variant": "grad", "scale": "small", "params": {}}
    case = runbook.get_case("gather-grad")
    row["params"] = dict(case.grid(case.scale("small"))[0])
    got = timeline_check.target_numbers(row, "h100")
    report = runbook.measure_case("gather-grad", "small", target="h100", variants=["grad"])
    want = report.one("grad", **row["params"])
    assert got["sum"] == want.total
    assert got["temp"] == want.temp


def test_a_measured_report_draws_its_own_timeline():
    def f(x):
        return jnp.cos(jnp.sin(x)) @ x

    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    report = runbook.measure(f, x)
    t = runbook.timeline(report)
    assert t.total == report.total
    assert t.peak == runbook.timeline(f, x).peak
    assert report == runbook.MemoryReport.from_record(report.to_record())
    with pytest.raises(runbook.RunbookError, match=r"runbook\.timeline\(fn"):
        runbook.timeline(runbook.MemoryReport.from_record(report.to_record()))
