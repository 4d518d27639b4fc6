"""gather-grad: every verdict, every fix's result, the issue's targets."""

from __future__ import annotations

import dataclasses

import jax
import pytest

import runbook
from runbook.cases import gather_grad
from runbook.cases.gather_grad import CASE, loss
from runbook.site import gather_grad as page


@pytest.fixture(scope="module")
def seed(timed):
    return timed("gather-grad", buffers=True)


@pytest.fixture(scope="module")
def verdicts(seed):
    return {c.key: c.verdict for c in page.claims(seed[0])}


def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("gather-grad")


def test_seed_scale_is_measured_fast(seed):
    result, seconds = seed
    assert len(result.reports) == 2 * len(CASE.variants)
    assert seconds < 30


def test_best_fix_within_one_percent_of_lower_bound(seed):
    best = min(seed[0].select(role="fix", index_dtype="int32"), key=lambda r: r.overhead)
    assert best.overhead <= 1.01


def test_reproduction_matches_xla_own_report(seed):
    grad = seed[0].one("grad", index_dtype="int32")
    args = gather_grad._args(CASE.scales["seed"], {"index_dtype": "int32"}, False)
    independent = runbook.xla_usage_report_total(jax.grad(loss), *args)
    assert independent == pytest.approx(grad.total, rel=0.01)


def test_gradient_roughly_doubles_the_forward(seed):
    result = seed[0]
    ratio = (
        result.one("grad", index_dtype="int32").total
        / result.one("forward", index_dtype="int32").total
    )
    assert ratio > 1.5


def test_fixes_give_the_same_gradient():
    checks = runbook.verify("gather-grad", "tiny")
    assert {c["name"] for c in checks} == {"grad-whole-index", "grad-chunked"}
    assert all(c["same"] for c in checks), checks


def test_same_result_check_catches_a_wrong_fix(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key
    wrong = runbook.Variant(
        "grad-wrong", "fix", "off by 1%", lambda p: jax.grad(lambda x, i: 1.01 * loss(x, i))
    )
    monkeypatch.setattr(
        gather_grad, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, wrong))
    )
    checks = runbook.verify("gather-grad", "tiny")
    assert [c["same"] for c in checks if c["name"] == "grad-wrong"] == [False, False]


def test_chunk_must_divide_rows():
    x, idx = gather_grad._args(CASE.scales["tiny"], {"index_dtype": "int32"}, True)
    with pytest.raises(ValueError, match="`chunk`"):
        gather_grad.loss_chunked(x, idx, chunk=3)


def test_manual_gradient_equals_jax_grad():
    x, idx = gather_grad._args(CASE.scales["tiny"], {"index_dtype": "int32"}, True)
    assert jax.numpy.allclose(page.manual_grad(x, idx), jax.grad(loss)(x, idx))


def test_one_compile_answers_with_and_without_buffers():
    # A case program is compiled once, with its buffers; a request without them gets none.
    plain = runbook.measure_case("gather-grad", "tiny")
    full = runbook.measure_case("gather-grad", "tiny", buffers=True)
    assert [r.total for r in plain.reports] == [r.total for r in full.reports]
    assert all(not r.buffers for r in plain.reports)
    assert all(r.buffers for r in full.reports)
