"""`runbook.explain`: XLA's out-of-memory messages read as stated, their buffers, the cases.

The expected figures below were read off each message by hand (a size "15.48G" is written
``int(15.48 * GiB)``: XLA prints binary units rounded to two decimals), not produced by the
parser. The messages are in docs/_data/oom/, each behind a comment line saying where it is
from; `nox -s oom` (runbook.site.producers.oom) makes the ones the runbook itself produces.
"""

from __future__ import annotations

import io
import pathlib
import subprocess
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

import runbook
from runbook._cli import main
from runbook._explain import NotAnOomMessageError
from runbook._targets import unavailable

DATA = pathlib.Path(__file__).parents[1] / "docs" / "_data" / "oom"
KiB, MiB, GiB = 2**10, 2**20, 2**30
NO_TPU = unavailable("v5e")


def _generate():
    from runbook.site.producers import oom

    return oom


# Per file: the platform it shows ("" where the text does not say), the bytes it says were
# needed and there were, by how much it says it exceeds, the listed buffers' sizes largest
# first, and the cases their roles show.
EXPECTED = {
    "tpu_jax7502.txt": (
        "TPU", int(64.00 * GiB), int(15.48 * GiB), int(48.52 * GiB), [16 * GiB], []
    ),
    "tpu_easydel166.txt": (
        "TPU", int(63.80 * GiB), int(30.75 * GiB), int(33.05 * GiB), [2 * GiB],
        ["attention-scores"],
    ),
    "tpu_v5e_vocab_logits.txt": (
        "TPU", int(20.57 * GiB), int(15.75 * GiB), int(4.82 * GiB),
        [int(15.66 * GiB), int(1.96 * GiB), int(1.96 * GiB), 512 * MiB, 512 * MiB, 128 * KiB]
        + [512] * 8,
        ["vocab-logits"],
    ),
    "tpu_v5e_gather_grad.txt": (
        "TPU", int(264.01 * GiB), int(15.75 * GiB), int(264.01 * GiB) - int(15.75 * GiB), [], []
    ),
    "gpu_jax13428.txt": ("GPU", 6291456, None, None, [6 * MiB, 384 * KiB], []),
    "gpu_nemos345.txt": ("GPU", 3199993600, None, None, [], []),
    "bfc_flowdec32.txt": ("", None, 10562958132, None, [], []),
    "cpu_jax2023.txt": ("", 337385120, None, None, [], []),
    "cpu_ones.txt": ("CPU", 2**46 * 4, None, None, [], []),
}  # fmt: skip


def test_every_message_file_has_its_expectation_and_says_where_it_is_from():
    files = sorted(p.name for p in DATA.glob("*.txt"))
    assert files == sorted(EXPECTED)
    assert len([f for f in files if not f.startswith("tpu_v5e") and f != "cpu_ones.txt"]) >= 4
    for name in files:
        first = (DATA / name).read_text().splitlines()[0]
        if name.startswith("tpu_v5e") or name == "cpu_ones.txt":
            assert first.startswith("# made by nox -s oom")
            assert "jax " in first
            assert "jaxlib " in first
            assert name == "cpu_ones.txt" or "libtpu " in first
        else:
            assert first.startswith("# source: https://github.com/")
            assert "/issues/" in first


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_figures_and_buffers_are_what_the_message_says(name):
    platform, needed, limit, over, sizes, cases = EXPECTED[name]
    e = runbook.explain(DATA / name)
    assert e.platform == platform
    assert e.needed == needed
    assert e.limit == limit
    if over is not None:
        assert e.over == over
    assert [b.size for b in e.buffers] == sizes
    assert e.cases == cases
    text = str(e)
    if needed is not None and limit is not None:
        assert f"It needs {runbook.fmt_bytes(needed)}" in text
        assert f"there is {runbook.fmt_bytes(limit)}" in text
    if not sizes:
        assert "lists no buffers" in text


def test_a_tpu_report_names_each_buffer_op_source_and_padding():
    e = runbook.explain(DATA / "tpu_jax7502.txt")
    (b,) = e.buffers
    assert (b.shape, b.kind) == ("s32[2048,1,128,128,4]", "temp")
    assert b.op == "jit(t)/jit(_take_along_axis)/concatenate"
    assert b.source == "t.py:6"
    assert e.padding == int(15.50 * GiB)
    assert e.totals["reserved"] == int(530.00 * MiB)
    assert e.totals["HLO temp"] == int(64.00 * GiB)
    # No case: what dominates is said instead, with its share of the listed bytes.
    text = str(e)
    assert "No runbook case" in text
    assert "100% (s32[2048,1,128,128,4] temp)  jit(t)/jit(_take_along_axis)/concatenate" in text
    assert "97%) is padding" in text


def test_a_logged_report_reads_past_its_log_prefix_and_names_arguments_and_outputs():
    e = runbook.explain(DATA / "tpu_v5e_vocab_logits.txt")
    assert Counter(b.kind for b in e.buffers) == {"temp": 8, "argument": 3, "output": 3}
    top = e.buffers[0]
    assert (top.shape, top.op) == ("f32[32768,128256]", "jit(loss_one_hot)/jvp()/dot_general")
    assert e.totals["arguments"] == int(2.46 * GiB)
    (match,) = e.matches
    assert match.buffers == (top,)
    assert "log_softmax" in match.evidence


def test_attention_scores_are_named_from_the_product_of_queries_and_keys():
    e = runbook.explain(DATA / "tpu_easydel166.txt")
    (b,) = e.buffers
    assert b.source == "modules/attention_module.py:1059"
    assert b.op.endswith("/self_attention/...qhd,...khd->...hqk/dot_general")
    assert "4096 x 4096" in e.matches[0].evidence
    assert "python -m runbook run attention-scores" in str(e)


def test_a_gpu_buffer_assignment_lists_its_peak_buffers_and_stats():
    e = runbook.explain(DATA / "gpu_jax13428.txt")
    first, second = e.buffers
    assert (first.shape, first.op, first.source, first.instruction) == (
        "f32[4096,128,3]",
        "jit(concatenate)/jit(main)/concatenate",
        "internal/models.py:689",
        "concatenate",
    )
    assert (second.shape, second.kind) == ("f32[256,128,3]", "argument")
    assert e.totals["total allocation"] == 12 * MiB
    assert e.totals["maybe_live_out allocation"] == 6 * MiB
    assert "less than 6.00 MiB was free in one piece" in str(e)
    assert "384.00 KiB 6% (f32[256,128,3] argument)  (an argument)" in str(e)


def test_a_message_logged_line_by_line_reads_the_same():
    # google-deepmind/alphafold#392 shows the buffer assignment relayed by a logger, every
    # line behind its prefix.
    prefix = "I0309 12:51:51.372677 140505975940928 run_docker.py:247] "
    text = (DATA / "gpu_jax13428.txt").read_text()
    logged = "\n".join(prefix + line for line in text.splitlines())
    assert runbook.explain(logged).buffers == runbook.explain(text).buffers


def test_the_bfc_allocator_dump_gives_limit_use_and_chunks():
    e = runbook.explain(DATA / "bfc_flowdec32.txt")
    assert e.totals["in use"] == 4467985408
    assert e.totals["in-use chunks"] == int(4.16 * GiB)
    assert e.totals["available"] == 1971974964
    assert e.chunks[0] == (2, 2233958400)
    assert len(e.chunks) == 5
    nemos = runbook.explain(DATA / "gpu_nemos345.txt")
    assert nemos.totals["largest request the allocator refused"] == int(4.49 * GiB)


@pytest.mark.parametrize(
    ("text", "platform", "needed", "limit"),
    [
        # jax-ml/jax#788: the message wrapped by the terminal mid-sentence.
        (
            (
                "[1] 2019-06-13 01:17:08.886805: E external/org_tensorflow/tensorflow/compiler/"
                "xla/python/local_client.cc:672] Execution of replica 0 failed: Resource "
                "exhausted: Out \nof memory while trying to allocate 5520758552 bytes."
            ),
            "",
            5520758552,
            None,
        ),
        # AI-Hypercomputer/tpu-recipes#151: the TPU runtime loading a program.
        (
            (
                "RESOURCE_EXHAUSTED: Error loading program 'jit__multi_slice': Attempting to "
                "reserve 6.14G at the bottom of memory. That was not possible."
            ),
            "TPU",
            int(6.14 * GiB),
            None,
        ),
        # The GPU allocator's limit (the format string of jax-cuda12-plugin's allocator).
        (
            "RESOURCE_EXHAUSTED: Allocating 4294967296 bytes exceeds the memory limit of 2147483648 bytes.",
            "GPU",
            4294967296,
            2147483648,
        ),
        # libtpu's early abort (its format string, with figures).
        (
            (
                "Compilation failure: Aborting compilation early because it's unlikely to have "
                "enough device memory. Requires 20.00G, has 15.75G available."
            ),
            "TPU",
            20 * GiB,
            int(15.75 * GiB),
        ),
    ],
)
def test_other_forms_are_read(text, platform, needed, limit):
    e = runbook.explain(text)
    assert (e.platform, e.needed, e.limit) == (platform, needed, limit)


@pytest.mark.parametrize("text", ["", "hello", "Traceback: ValueError: shapes do not match"])
def test_text_without_an_oom_message_is_one_line_saying_what_was_expected(text):
    with pytest.raises(NotAnOomMessageError, match="expected XLA's RESOURCE_EXHAUSTED") as info:
        runbook.explain(text)
    assert isinstance(info.value, runbook.RunbookError)
    assert "\n" not in str(info.value)


def test_an_exception_is_read_through_its_cause():
    with pytest.raises(NotAnOomMessageError, match=r"`message` \(ValueError\) holds no"):
        runbook.explain(ValueError("shapes do not match"))
    xla = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1024 bytes.")
    wrapped = runbook.DoesNotFitError("`f` does not fit", needed=7, limit=5, what="one buffer")
    wrapped.__cause__ = xla
    assert runbook.explain(wrapped).needed == 1024  # XLA's own text, not the wrapper's
    bare = runbook.explain(runbook.DoesNotFitError("x", needed=7, limit=5, what="one buffer"))
    assert (bare.needed, bare.limit, bare.over) == (7, 5, 2)


def test_the_notebook_rendering_is_a_table_with_the_case():
    shown = runbook.explain(DATA / "tpu_easydel166.txt")._repr_html_()
    assert '<table class="runbook-table">' in shown
    assert "attention-scores" in shown
    assert "...qhd,...khd-&gt;...hqk/dot_general" in shown  # escaped


# --- the cases, from the op names XLA records for their reproductions ----------------------


def _as_tpu_report(buffers):
    """`buffers` as the entries of a TPU memory report (the form the TPU compiler prints)."""
    lines = [
        (
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 2.00G of 1.00G hbm. Exceeded hbm capacity by 1.00G."
        ),
        "",
        "  Largest program allocations in hbm:",
        "",
    ]
    for n, b in enumerate(buffers, 1):
        lines += [f"  {n}. Size: {b.size}B"]
        lines += [f'     Operator: op_name="{b.op}"'] if b.op else []
        lines += [f"     Shape: {b.shape}", "     Allocation type: HLO temp", "     " + "=" * 26]
    return "\n".join(lines)


def _buffers_of(case_name, scale, variant=None):
    case = runbook.get_case(case_name)
    v = next(
        v for v in case.variants if v.name == variant or (not variant and v.role == "reproduction")
    )
    params = case.grid(case.scales[scale])[0]
    args = case.inputs(v, case.scales[scale], params, False)
    return runbook.largest_buffers(runbook.measure(v.program(params), *args, buffers=True))[:8]


@pytest.mark.parametrize(
    ("case", "scale"),
    [
        ("vocab-logits", "small"),  # a 16032-token vocabulary
        ("prng-temporaries", "tiny"),
        ("gather-grad", "tiny"),
        ("scan-residuals", "tiny"),
        ("vmap-materialize", "tiny"),
    ],
)
def test_a_report_of_a_reproductions_buffers_names_its_case(case, scale):
    e = runbook.explain(_as_tpu_report(_buffers_of(case, scale)))
    assert case in e.cases, str(e)


def _clean_buffers(fn, *args):
    return runbook.largest_buffers(runbook.measure(fn, *args, buffers=True), count=1000)


def test_programs_without_the_roles_are_named_no_case():
    f32 = jnp.float32

    def mlp(w1, w2, x):  # products and a nonlinearity: no case's role
        return jnp.sum(jnp.tanh(x @ w1) @ w2)

    def classifier(w, x, labels):  # a log-softmax over 10 classes: no vocabulary
        logits = x @ w
        return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 10))

    def batched(a, b):  # a batched product with a square result: not queries x keys
        return jnp.einsum("bij,bjk->bik", a, b).sum()

    def histogram(counts, idx, v):  # a scatter-add in the forward pass: no gather's gradient
        return counts.at[idx].add(v)

    def update(x, i):  # an indexed update outside jax.vmap
        return x.at[i].set(0.0)

    s = jax.ShapeDtypeStruct
    i32 = jnp.int32
    programs = [
        (jax.grad(mlp), s((512, 512), f32), s((512, 512), f32), s((512, 512), f32)),
        (jax.grad(classifier), s((8, 10), f32), s((16384, 8), f32), s((16384,), i32)),
        (jax.grad(batched), s((4, 256, 64), f32), s((4, 64, 256), f32)),
        (histogram, s((2**20,), f32), s((2**20,), i32), s((2**20,), f32)),
        (update, s((1024, 1024), f32), s((), i32)),
    ]
    for fn, *args in programs:
        e = runbook.explain(_as_tpu_report(_clean_buffers(fn, *args)))
        assert e.cases == [], str(e)
    # Op names of the forms XLA records (the last from jax-ml/jax#13428's buffers), in roles
    # no case has: a batched product; a loss's name without a log-softmax beside it; a
    # 10-class product beside its log-softmax; a gradient's backward loop, stacking the
    # gradient of a scan's inputs; a forward loop's step that stacks nothing; a vmapped layer.
    roles = [
        ("f32[8,512,512]", "jit(f)/bij,bjk->bik/dot_general"),
        ("f32[16,8192]", "jit(loss_one_hot)/jvp()/dot_general"),
        ("f32[16384,10]", "jit(classifier)/jvp()/dot_general"),
        ("f32[16384]", "jit(classifier)/jvp(jit(log_softmax))/reduce_max"),
        ("f32[16,4,16]", "jit(loss)/transpose(jvp())/while/body/eval_jaxpr/add_any"),
        (
            "f32[64,4,16]",
            (
                "jit(loss)/transpose(jvp())/while/body/jit(dynamic_update_index_in_dim)"
                "/dynamic_update_slice"
            ),
        ),
        ("f32[16,4,16]", "jit(loss)/jvp()/while/body/tanh"),
        (
            "f32[2048,256]",
            "pmap(render_eval_fn)/jit(main)/Model/NerfMLP_0/vmap(jvp(Dense_5))/dot_general",
        ),
    ]
    buffers = [runbook.Buffer(MiB, shape, "temp", "", op, "") for shape, op in roles]
    e = runbook.explain(_as_tpu_report(buffers))
    assert e.cases == [], str(e)


# --- messages the runbook makes at run time ----------------------------------------------


@pytest.mark.skipif(NO_TPU is not None, reason=str(NO_TPU))
def test_the_tpu_compilers_first_check_is_explained_through_does_not_fit():
    error = _generate().tpu_first_check()
    e = runbook.explain(error)
    assert e.form == "TPU compiler: first memory check"
    assert e.what == "HLO temporaries"
    assert (e.needed, e.limit) == (error.needed, error.limit)
    assert e.needed > e.limit
    assert runbook.explain(error.__cause__) == e


@pytest.mark.skipif(NO_TPU is not None, reason=str(NO_TPU))
def test_the_tpu_compilers_logged_report_is_explained():
    generate = _generate()
    log = generate.tpu_log("copies")  # the whole log, as a user would paste it
    e = runbook.explain(log)
    assert e.buffers == runbook.explain(generate.first_report(log)).buffers
    six = 3 * 2**29 * 4  # the argument, and each of the two outputs
    assert e.needed == 3 * six
    assert e.limit == runbook.get_target("v5e").usable()
    assert sorted((b.kind, b.size) for b in e.buffers if b.kind != "temp") == [
        ("argument", six),
        ("output", six),
        ("output", six),
    ]
    assert e.cases == []


def test_the_cpu_runtimes_message_is_explained():
    e = runbook.explain(_generate().cpu_allocation())
    assert (e.platform, e.needed, e.limit) == ("CPU", 2**46 * 4, None)


# --- the command line ------------------------------------------------------------------------


def test_cli_explains_a_file(capsys):
    assert main(["explain", str(DATA / "tpu_easydel166.txt")]) == 0
    out = capsys.readouterr().out
    assert "attention-scores" in out
    assert "It needs 63.80 GiB" in out


def test_cli_reads_standard_input(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO((DATA / "gpu_jax13428.txt").read_text()))
    assert main(["explain", "-"]) == 0
    assert "jit(concatenate)/jit(main)/concatenate" in capsys.readouterr().out


def test_cli_garbage_is_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "runbook", "explain", "-"],
        input="no message here\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("runbook: error: `message` holds no out-of-memory message")


def test_cli_a_missing_file_is_one_line(capsys):
    assert main(["explain", str(DATA / "nope.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "cannot read" in err[0]
