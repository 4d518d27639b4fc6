"""The build's measurement pre-pass (docs/_ext/runbook_prepare.py): each call a page declares
is one its code makes, and the pre-pass makes it where the page will read it back."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))  # where its pool's processes import it from, too
import runbook_prepare

PAGES = sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_every_declaration_is_written_in_the_page(page: pathlib.Path) -> None:
    assert runbook_prepare.unwritten(page) == []


def test_the_slowest_pages_declare_their_calls() -> None:
    declaring = {p.relative_to(DOCS).with_suffix("").as_posix() for p in PAGES
                 if runbook_prepare.declared(p)}  # fmt: skip
    assert {
        "diagnose",
        "cases/scan-residuals",
        "cases/pmap-loop",
        "cases/frozen-params",
    } <= declaring


PAGE = """---
runbook:
  cases: [a]
  data: []{devices}
  prepare:
    - 'runbook.verify("a")'
    - runbook.site.case_timelines("a")
---

# A page

```{{code-cell}}
{first}
checks = runbook.verify(
    "a")
```
"""
FORCE = 'os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"'


def test_unwritten_names_what_the_code_does_not_make(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE.format(devices="", first=""))
    assert runbook_prepare.declared(page) == [
        'runbook.verify("a")',
        'runbook.site.case_timelines("a")',
    ]
    assert runbook_prepare.devices(page) == 1
    assert runbook_prepare.unwritten(page) == ['runbook.site.case_timelines("a")']
    page.write_text(PAGE.format(devices="\n  devices: 4", first=""))
    assert runbook_prepare.devices(page) == 4
    assert runbook_prepare.unwritten(page) == ['runbook.site.case_timelines("a")', FORCE]
    page.write_text(PAGE.format(devices="\n  devices: 4", first=FORCE))
    assert runbook_prepare.unwritten(page) == ['runbook.site.case_timelines("a")']


def test_modules_are_the_runbook_chains() -> None:
    call = '[runbook.runtime_peak("x", v.name) for v in runbook.cases.gather_grad.CASE.variants]'
    assert runbook_prepare._modules(call) == [
        "runbook", "runbook.cases", "runbook.cases.gather_grad", "runbook.cases.gather_grad.CASE",
    ]  # fmt: skip


def test_a_pages_calls_run_with_its_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBOOK_PAGE", "")  # run_page names the page here
    monkeypatch.setenv("RUNBOOK_PREPARE", "")
    two = "__import__('jax').device_count() == 2 or 1 / 0"
    [(_, error)] = runbook_prepare.run_page("p", [two], 2)
    assert error is None
    [(_, error), (_, fine)] = runbook_prepare.run_page("p", [two, "None"], 1)
    assert error.startswith("ZeroDivisionError")
    assert fine is None


def test_prepare_measures_for_the_page_the_longest_first(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("RUNBOOK_PAGE", "")
    monkeypatch.setenv("RUNBOOK_CACHE_DIR", str(cache))
    monkeypatch.setenv("RUNBOOK_STORE_DIR", "")
    call = 'runbook.measure_case("inplace-copy", "tiny")'
    cache.mkdir()
    (cache / runbook_prepare.SECONDS).write_text("q\tNone\t9.0\n")  # known to be the longest
    said: list[str] = []
    calls = [("cases/inplace-copy", call, 1), ("p", "runbook.nope()", 1), ("q", "None", 1)]
    took = runbook_prepare.prepare(calls, cache, workers=1, say=said.append)
    assert set(took) == {(page, c) for page, c, _ in calls}
    # First the longest, as known from the last build; then the others in the order given.
    assert [line.split("  ")[-2:] for line in said[1:3]] == [
        ["q", "None"],
        ["cases/inplace-copy", call],
    ]
    assert said[3].endswith("runbook.nope() failed, left to the page: AttributeError: "
                            "module 'runbook' has no attribute 'nope'")  # fmt: skip
    # Every entry the call made is the page's, and the same call, made again in a fresh
    # process as the page's kernel is, reads them back. (Not in this one: earlier tests
    # here may have set variables of the XLA/JAX environment, which the keys include.)
    entries = [json.loads(p.read_text()) for p in cache.glob("*/*.json")]
    assert entries
    assert {e["page"] for e in entries} == {"cases/inplace-copy"}
    runbook_prepare.prepare(calls[:1], cache, workers=1, say=said.append)
    assert len(list(cache.glob("*/*.json"))) == len(entries)
    # Each call's seconds are kept for the next build's order.
    rows = (cache / runbook_prepare.SECONDS).read_text().splitlines()
    assert sorted(r.split("\t")[1] for r in rows) == sorted(c for _, c, _ in calls)
