"""vocab-logits: every verdict, every fix's result, the issue's targets."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runbook
from runbook._cli import main
from runbook.cases import vocab_logits
from runbook.cases._setup import vocab_logits as setup
from runbook.cases.vocab_logits import CASE, loss_vocab_tiles
from runbook.site import vocab_logits as page
from runbook.site._history import load_versions


@pytest.fixture(scope="module")
def seed(timed):
    return timed("vocab-logits")


@pytest.fixture(scope="module")
def found(seed):
    return page.evidence(seed[0])


@pytest.fixture(scope="module")
def verdicts(seed, found):
    return {c.key: c.verdict for c in page.claims(seed[0], found)}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("vocab-logits")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants) * len(CASE.scales["seed"]["tokens"])
    assert seconds < 60


def test_reproduction_grows_with_tokens_and_the_fix_barely(seed):
    result = seed[0]
    tokens = CASE.scales["seed"]["tokens"]
    repro = [result.one("grad-one-hot", tokens=t).temp for t in tokens]
    assert repro == sorted(repro)
    assert repro[-1] / repro[0] == pytest.approx(tokens[-1] / tokens[0], rel=0.05)
    logits = tokens[-1] * CASE.scales["seed"]["vocab"] * 4
    assert result.one("vocab-tiled", tokens=tokens[-1]).temp < logits / 8


def test_recommended_fix_saves_and_sits_near_its_floor(seed):
    result = seed[0]
    repro = max(result.select(role="reproduction"), key=lambda r: r.total)
    fix = result.one(vocab_logits.RECOMMENDED, **repro.params)
    assert fix.total == min(r.total for r in result.select(role="fix", **repro.params))
    assert repro.total / fix.total >= 1.5
    assert fix.overhead <= 1.25


def test_one_hot_detector_finds_the_one_hot_only(found):
    by = {(r["labels"], r["logits"]): r["one_hot"] for r in found["labels_dtypes"]}
    n, v = page.MAXTEXT_ONE_HOT["tokens"], page.MAXTEXT_ONE_HOT["vocab"]
    assert by[("integer", "float32")] == by[("integer", "bfloat16")] == []
    assert (f"bf16[{n},{v}]", n * v * 2) in by[("one-hot", "bfloat16")]


def test_fixes_give_the_same_value_and_gradient():
    checks = runbook.verify("vocab-logits", "tiny")
    fixes = {v.name for v in CASE.variants if v.role == "fix"}
    assert {c["name"] for c in checks} == fixes
    assert all(c["same"] for c in checks), checks


def test_vocab_tiles_match_autodiff_in_bfloat16():
    h, w, labels = setup.args(CASE.scales["tiny"], {"tokens": 64}, True, jnp.bfloat16)
    expected = jax.value_and_grad(vocab_logits.loss_integer, argnums=(0, 1))(h, w, labels)
    got = jax.value_and_grad(vocab_logits.loss_vocab_tiles, argnums=(0, 1))(h, w, labels)
    assert got[1][0].dtype == got[1][1].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert jnp.allclose(a.astype(jnp.float32), b.astype(jnp.float32), rtol=2e-2, atol=2e-2)


def test_token_chunks_must_divide_the_tokens():
    h, w, labels = setup.args(CASE.scales["tiny"], {"tokens": 64}, True)
    with pytest.raises(ValueError, match="`chunks`"):
        vocab_logits.loss_token_chunks(h, w, labels, chunks=7)


@pytest.mark.parametrize("chunks", [0, -1, 321, 2.0])
def test_vocab_tiles_take_from_one_chunk_to_one_per_column(chunks):
    h, w, labels = setup.args(CASE.scales["tiny"], {"tokens": 64}, True)  # vocabulary 320
    with pytest.raises(ValueError, match="`chunks`"):
        loss_vocab_tiles(h, w, labels, chunks=chunks)


# The vocabulary tiles against the whole logits, on real models' vocabularies (flax's lm1b
# example, T5, GPT-2's padded one; 32 chunks leave a ragged last slice) and one that 32
# divides, at few tokens and a narrow hidden width.

VOCABS = [30_000, 32_100, 50_304, 32_000]
OPTIONS = {
    "plain": {},
    "weights": {"weights": True},
    "bias": {"bias": True},
    "smoothing": {"label_smoothing": 0.1},
    "all": {"weights": True, "bias": True, "label_smoothing": 0.1},
}


def reference(h, w, labels, weights=None, bias=None, label_smoothing=0.0):
    """The loss from the whole float32 logits, as optax.softmax_cross_entropy computes it
    against optax.smooth_labels(one_hot(labels), label_smoothing), weighted per token."""
    logits = (h @ w).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    v = w.shape[1]
    targets = (1 - label_smoothing) * jax.nn.one_hot(labels, v) + label_smoothing / v
    per_token = -jnp.sum(targets * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    return jnp.sum(per_token if weights is None else weights * per_token)


def inputs(vocab, tokens=64, hidden=16, dtype=jnp.float32):
    """h, w, labels, a 0/1 weight per token and a bias; among the labels, the vocabulary's
    last column and the first of the last slice (which the slice before it holds when the
    last is ragged), so that a slice's picked or masked columns count."""
    rng = np.random.default_rng(vocab)
    h = rng.standard_normal((tokens, hidden))
    w = rng.standard_normal((hidden, vocab)) / np.sqrt(hidden)
    size = -(-vocab // vocab_logits.CHUNKS)
    labels = rng.integers(0, vocab, tokens)
    labels[:3] = vocab - 1, vocab - size, 0
    weights = (rng.random(tokens) < 0.7).astype(np.float32)
    weights[:3] = 1.0
    bias = rng.standard_normal(vocab)
    return (jnp.asarray(h, dtype), jnp.asarray(w, dtype), jnp.asarray(labels, jnp.int32),
            jnp.asarray(weights, dtype), jnp.asarray(bias, dtype))  # fmt: skip


def both(vocab, options, dtype=jnp.float32):
    """(value, gradients) of the tiles and of the reference, with respect to h, w and
    whichever of weights and bias `options` turns on."""
    h, w, labels, weights, bias = inputs(vocab, dtype=dtype)
    smoothing = options.get("label_smoothing", 0.0)
    args = (h, w, weights if "weights" in options else None, bias if "bias" in options else None)

    def tiles(h, w, weights, bias):
        return loss_vocab_tiles(h, w, labels, weights, bias, smoothing, chunks=32)

    def whole(h, w, weights, bias):
        return reference(h, w, labels, weights, bias, smoothing)

    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    got = jax.value_and_grad(tiles, argnums=argnums)(*args)
    expected = jax.value_and_grad(whole, argnums=argnums)(*args)
    return got, expected


def assert_close(got, expected, tolerance):
    leaves = jax.tree.leaves(got), jax.tree.leaves(expected)
    assert len(leaves[0]) == len(leaves[1])
    for a, b in zip(*leaves, strict=True):
        assert a.shape == b.shape
        assert a.dtype == b.dtype
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        error, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
        assert error <= tolerance * scale, f"{a.shape}: off by {error:.2e} of {scale:.2e}"


@pytest.mark.parametrize("options", OPTIONS.values(), ids=list(OPTIONS))
@pytest.mark.parametrize("vocab", VOCABS)
def test_vocab_tiles_match_the_whole_logits(vocab, options):
    got, expected = both(vocab, options)
    assert_close(got, expected, 1e-5)


def test_vocab_tiles_match_the_whole_logits_in_bfloat16():
    got, expected = both(32_100, OPTIONS["all"], jnp.bfloat16)
    assert got[1][0].dtype == got[1][1].dtype == jnp.bfloat16
    assert_close(got, expected, 3e-2)


def test_ignore_index_labels_with_weight_zero_count_for_nothing():
    h, w, labels, weights, bias = inputs(30_000)
    ignored = weights == 0
    assert ignored.any()
    labels = jnp.where(ignored, -100, labels)
    grad = jax.value_and_grad(loss_vocab_tiles, argnums=(0, 1, 4))
    value, (dh, dw, dbias) = grad(h, w, labels, weights, bias, 0.1)
    kept, (dh_kept, dw_kept, dbias_kept) = grad(h[~ignored], w, labels[~ignored], None, bias, 0.1)
    assert_close(value, kept, 1e-5)
    assert not dh[ignored].any()
    assert_close((dh[~ignored], dw, dbias), (dh_kept, dw_kept, dbias_kept), 1e-5)


def test_vocab_tiles_default_program_keeps_this_release_s_recorded_figures(seed):
    # The site's release files pin the measured call, loss_vocab_tiles(h, w, labels) with
    # chunks dividing the vocabulary: its compiled figures must not move.
    release = next((r for r in load_versions() if r["jax"] == jax.__version__), None)
    if release is None:
        pytest.skip(f"no release file for jax {jax.__version__}")
    recorded = [v for v in release["cases"]["vocab-logits"]["variants"]
                if v["name"] == "vocab-tiled"]  # fmt: skip
    assert recorded
    for v in recorded:
        report = seed[0].one("vocab-tiled", **v["params"]).to_json()
        assert (report["bytes"], report["lower_bound"]) == (v["bytes"], v["lower_bound"])


def test_tables_cover_every_variant_and_report(seed, found):
    result = seed[0]
    assert [r[0] for r in page.fix_table(result).rows] == [v.name for v in CASE.variants]
    assert len(page.dtype_table(found["labels_dtypes"]).rows) == 4
    reports = page.reports_table(result, found)
    assert [row[0] for row in reports.rows] == list(page.REPORTS)


def test_cli_json(capsys):
    assert main(["run", "vocab-logits", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "vocab-logits"
    assert {v["role"] for v in data["variants"]} == {"baseline", "reproduction", "fix"}
    for v in data["variants"]:
        b = v["bytes"]
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert v["lower_bound"] > 0
