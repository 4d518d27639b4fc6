"""`runbook.watch` on the runtime cases' own loops: each reproduction is named as its case,
with the case's fix to copy; each recommended fix draws no finding."""

from __future__ import annotations

import pytest

import runbook
from runbook.site import watched_cases


@pytest.fixture(scope="module")
def rows():
    return {(r["case"], r["role"]): r for r in watched_cases.loops()}


def test_the_runtime_cases_are_the_ones_watched():
    runtime = {n for n in runbook.case_names() if runbook.get_case(n).runtime}
    assert runtime == set(watched_cases.CASES)


@pytest.mark.parametrize("case", list(watched_cases.CASES))
def test_reproduction_is_named_as_its_case(rows, case):
    r = rows[case, "reproduction"]
    assert r["steps"] == watched_cases.CASES[case]
    assert r["cases"] == [case], r
    module = case.replace("-", "_")
    assert all(c and c.startswith(f"runbook.cases.{module}.") for c in r["copy"]), r


@pytest.mark.parametrize("case", list(watched_cases.CASES))
def test_recommended_fix_draws_no_finding(rows, case):
    r = rows[case, "fix"]
    assert r["steps"] == watched_cases.CASES[case]
    assert r["cases"] == [], r


def test_a_watched_loop_is_cached_like_the_pages(tmp_path, monkeypatch):
    # The docs build sets a cache folder: the watched loops' keys must name real sources.
    monkeypatch.setenv("RUNBOOK_CACHE_DIR", str(tmp_path))
    first = watched_cases.watched("live-references", "keep-floats")
    assert list(tmp_path.rglob("*.json"))
    assert watched_cases.watched("live-references", "keep-floats") == first
