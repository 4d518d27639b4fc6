"""The evaluation corpus of `runbook.diagnose`: what it names, misses and raises falsely.

Each corpus program should draw exactly its expected cases. Where a release's detectors do
not, the miss or false alarm is pinned below with its reason: a pinned miss that starts
passing fails the test as surely as a new miss (update the pins, and the page says so).
"""

from __future__ import annotations

import json

import jax
import pytest

import runbook
from runbook._diagnose import Diagnosis
from runbook.site import corpus
from runbook.site.corpus.evaluate import counts
from runbook.site.corpus.known import KNOWN_FALSE_ALARMS, KNOWN_MISSES


def _pinned(table: dict[str, dict[str, dict[str, str]]]) -> dict[str, list[str]]:
    if jax.__version__ not in table:
        pytest.skip(f"no corpus pins for jax {jax.__version__}")
    return {name: sorted(cases) for name, cases in table[jax.__version__].items()}


@pytest.fixture(scope="module")
def outcomes() -> list[corpus.Outcome]:
    return corpus.evaluate()


COMPILED = [n for n in runbook.case_names() if not runbook.get_case(n).runtime]


def test_corpus_covers_every_compile_time_case_with_user_like_programs():
    entries = corpus.entries()
    names = COMPILED
    for e in entries:
        assert e.expected <= set(names), e.name
        assert e.source, e.name
        assert e.shape, e.name
    for case in names:
        assert sum(case in e.expected for e in entries) >= 3, case
    assert sum(e.clean for e in entries) >= 10
    assert any(len(e.expected) > 1 for e in entries)  # several mechanisms at once
    assert len({e.name for e in entries}) == len(entries)


def test_misses_are_exactly_the_known_ones(outcomes):
    assert corpus.misses(outcomes) == _pinned(KNOWN_MISSES)


def test_false_alarms_are_exactly_the_known_ones_and_none_on_clean_programs(outcomes):
    assert corpus.false_alarms(outcomes) == _pinned(KNOWN_FALSE_ALARMS)
    assert [o.entry.name for o in outcomes if o.entry.clean and o.cases] == []


def test_pinned_reasons_name_programs_and_cases_of_the_corpus():
    known = {e.name: e for e in corpus.entries()}
    for table, expected in ((KNOWN_MISSES, True), (KNOWN_FALSE_ALARMS, False)):
        for pins in table.values():
            for name, cases in pins.items():
                assert name in known, name
                for case, reason in cases.items():
                    assert (case in known[name].expected) is expected, (name, case)
                    assert len(reason) > 20


def test_table_counts_each_mechanism(outcomes):
    found = counts(outcomes, COMPILED)
    misses, alarms = corpus.misses(outcomes), corpus.false_alarms(outcomes)
    for case, c in found.items():
        expecting = [o for o in outcomes if case in o.entry.expected]
        assert c["programs"] == len(expecting)
        assert c["missed"] == sum(case in m for m in misses.values())
        assert c["named"] == c["programs"] - c["missed"]
        assert c["false alarms"] == sum(case in a for a in alarms.values())
    rows = {r[0]: r for r in corpus.table(outcomes).rows}
    assert rows["donation"][1:] == [
        str(found["donation"][k]) for k in ("programs", "named", "missed", "false alarms")
    ]
    assert rows["clean programs (any case named)"][1] == str(sum(o.entry.clean for o in outcomes))
    assert "jax " + jax.__version__ in corpus.table(outcomes).caption


def test_a_miss_is_reported_as_one():
    """The counting can fail: an outcome missing its case counts as a miss."""
    entry = corpus.get("ema-update")
    fake = corpus.Outcome(entry, (), (), {}, 1, 0.0, "here")
    assert corpus.misses([fake]) == {"ema-update": ["donation"]}
    alarm = corpus.Outcome(corpus.get("matmul-chain"), ("donation",), (), {}, 1, 0.0, "here")
    assert counts([fake, alarm], ["donation"])["donation"] == {
        "programs": 1,
        "named": 0,
        "missed": 1,
        "false alarms": 1,
    }


# --- when nothing is recognised ------------------------------------------------------------


@pytest.fixture(scope="module")
def unnamed() -> Diagnosis:
    """A corpus program no detector names (a miss pinned above)."""
    fn, args = corpus.get("per-example-grads").build()
    return runbook.diagnose(fn, *args)


def test_nothing_recognised_still_says_what_dominates(unnamed):
    assert not unnamed.findings
    (top, *_) = unnamed.dominant()
    # The whole batch of per-example gradients, made by the squared norm on one line.
    assert top.bytes >= 128 * 256 * 512 * 4
    assert "integer_pow" in top.op
    assert "corpus/programs.py:" in top.source
    assert top.bytes >= 0.9 * unnamed.report.total
    assert top.steps is None
    groups = unnamed.dominant(50)
    assert [g.bytes for g in groups] == sorted((g.bytes for g in groups), reverse=True)
    # The memory live at the peak, each piece once: never past the total.
    assert sum(g.count for g in groups) == len(unnamed.at_peak)
    assert sum(g.bytes for g in groups) == unnamed.peak <= unnamed.report.total
    text = str(unnamed)
    assert "No known mechanism found. What dominates" in text
    assert top.source in text


def test_nothing_recognised_in_html_and_json(unnamed):
    html = unnamed._repr_html_()
    assert "What dominates" in html
    assert "integer_pow" in html
    data = json.loads(json.dumps(unnamed.to_json()))
    assert data["dominant"][0]["op"] == unnamed.dominant()[0].op
    assert data["dominant"][0]["bytes"] == unnamed.dominant()[0].bytes
    assert data["closest"] == unnamed.closest.to_json()


def test_buffers_stacked_per_loop_step_are_flagged():
    fn, args = corpus.get("checkpointed-scan").build()  # a clean program: no finding
    d = runbook.diagnose(fn, *args)
    assert not d.findings
    stacked = [g for g in d.dominant(50) if g.steps]
    assert stacked
    assert all(g.steps == 64 for g in stacked)
    assert all(g.shape.split("[")[1].startswith("64,") for g in stacked)
    assert "stacked per step of a 64-step loop" in str(d)
    assert Diagnosis.from_record(d.to_record()).stacked == d.stacked
    # Nothing in the matrix chain is written step by step.
    fn, args = corpus.get("matmul-chain").build()
    assert not any(g.steps for g in runbook.diagnose(fn, *args).dominant(50))


def test_the_closest_case_is_rendered_with_why_it_was_not_named(unnamed):
    # The squared norms outside vmap hold the batch; the vmapped part is small.
    closest = unnamed.closest
    assert closest is not None
    assert closest.case == "vmap-materialize"
    assert "named from" in closest.reason
    assert closest.bytes < 0.25 * unnamed.report.total
    assert f"Closest: {closest.case}" in str(unnamed)
    assert f"Closest: {closest.case}" in unnamed._repr_html_()


def test_a_target_programs_diagnosis_is_read_from_the_store_keyed_by_the_detectors(
    tmp_path, monkeypatch
):
    import importlib

    from runbook import _cache, _targets
    from runbook.site.producers import store

    # The module (the package's `evaluate` is its function).
    evaluate = importlib.import_module("runbook.site.corpus.evaluate")
    ready = [e for e in corpus.entries() if e.target and not _targets.unavailable(e.target)]
    if not ready:
        pytest.skip("no GPU or TPU compiler installed: no corpus program is diagnosed for one")
    entry = next(e for e in ready if e.devices == 1)
    request = evaluate._request(entry)
    value = {"name": entry.name, "cases": [], "informational": [], "shares": {}, "total": 1,
             "seconds": 0.0, "provenance": "read from the store"}  # fmt: skip
    store.write({_cache.store_key(request): {"module": None, "request": request, "value": value}},
                tmp_path)  # fmt: skip
    monkeypatch.delenv(_cache.ENV_VAR, raising=False)
    monkeypatch.setenv(_cache.STORE_VAR, str(tmp_path))

    def compiled(name):
        raise AssertionError(f"{name} was diagnosed again")

    monkeypatch.setattr(evaluate, "diagnose_entry", compiled)
    [outcome] = evaluate.evaluate([entry.name])
    assert outcome.provenance == "read from the store"
    # Another detector's source is another key: the stored diagnosis is not read.
    monkeypatch.setattr(_cache, "detectors_hash", lambda: "another detector")
    with pytest.raises(AssertionError, match="diagnosed again"):
        evaluate.evaluate([entry.name])
