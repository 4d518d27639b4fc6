"""vocab-logits: every verdict, every fix's result, the issue's targets."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import pytest

import runbook
from runbook._cli import main
from runbook.cases import vocab_logits
from runbook.cases.vocab_logits import CASE
from runbook.site import vocab_logits as page


@pytest.fixture(scope="module")
def seed():
    start = time.perf_counter()
    result = runbook.measure_case("vocab-logits", "seed")
    return result, time.perf_counter() - start


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
    h, w, labels = vocab_logits._args(CASE.scales["tiny"], {"tokens": 64}, True, jnp.bfloat16)
    expected = jax.value_and_grad(vocab_logits.loss_integer, argnums=(0, 1))(h, w, labels)
    got = jax.value_and_grad(vocab_logits.loss_vocab_tiles, argnums=(0, 1))(h, w, labels)
    assert got[1][0].dtype == got[1][1].dtype == jnp.bfloat16
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert jnp.allclose(a.astype(jnp.float32), b.astype(jnp.float32), rtol=2e-2, atol=2e-2)


def test_chunks_must_divide():
    h, w, labels = vocab_logits._args(CASE.scales["tiny"], {"tokens": 64}, True)
    with pytest.raises(ValueError, match="`chunks`"):
        vocab_logits.loss_token_chunks(h, w, labels, chunks=7)
    with pytest.raises(ValueError, match="`chunks`"):
        vocab_logits.loss_vocab_tiles(h, w, labels, 7)


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
