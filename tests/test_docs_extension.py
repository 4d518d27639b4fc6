"""The docs' own Sphinx extension (docs/_ext/runbook_docs.py): the per-page fingerprints that
re-run exactly the pages whose inputs changed, and the check that the navigation mirrors
the case list."""

from __future__ import annotations

import pathlib
import shutil
import sys
import time

import pytest

from runbook.site.producers.bench import docs_extension

ROOT = pathlib.Path(__file__).resolve().parents[1]
runbook_docs = docs_extension()
# Under its name, as Sphinx imports it: the pre-pass module (tests/test_prepare.py) imports it
# so, and two copies would leave `doctest.testmod` finding none of this one's examples.
sys.modules["runbook_docs"] = runbook_docs

JAX = {
    "jax": "1",
    "jaxlib": "1",
    "numpy": "2",
    "backend": "cpu",
    "device_kind": "cpu",
    "devices": 1,
}


PAGE = """---
kernelspec:
  name: python3
runbook:
  cases: [{cases}]
  data: [{data}]
---

# A page
"""


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the package and a small docs folder with three pages."""
    shutil.copytree(ROOT / "runbook", tmp_path / "runbook")
    docs = tmp_path / "docs"
    for folder in ("cases", "_static", "_build/html", "_data/versions", "_data/gpu"):
        (docs / folder).mkdir(parents=True)
    (docs / "cases" / "gather-grad.md").write_text(PAGE.format(cases="gather-grad", data="gpu"))
    (docs / "cases" / "pmap-loop.md").write_text(PAGE.format(cases="pmap-loop", data=""))
    (docs / "index.md").write_text("# the landing page, with no runbook block\n")
    (docs / "conf.py").write_text("project = 'x'\n")
    (docs / "_static" / "site.css").write_text("p {}\n")
    (docs / "_build" / "html" / "index.html").write_text("<p>built</p>\n")
    (docs / "_data" / "versions" / "0.1.json").write_text('{"bytes": 1}\n')
    (docs / "_data" / "gpu" / "H100.json").write_text('{"bytes": 2}\n')
    return tmp_path


def _prints(tree: pathlib.Path, probe: dict | None = None) -> dict[str, str]:
    """Each page's fingerprint."""
    env = runbook_docs.environment(probe or JAX)
    hashes = runbook_docs.input_hashes(tree, tree / "docs", env)
    docs = tree / "docs"
    return {
        p.relative_to(docs).as_posix(): runbook_docs.page_fingerprint(p, hashes)
        for p in docs.rglob("*.md")
        if "_build" not in p.parts
    }


def _touch(tree: pathlib.Path, path: str) -> None:
    with (tree / path).open("a") as f:
        f.write("\n# changed\n")


def _changed(tree: pathlib.Path, path: str) -> set[str]:
    before = _prints(tree)
    _touch(tree, path)
    after = _prints(tree)
    return {page for page in before if before[page] != after[page]}


@pytest.mark.parametrize(
    "module",
    [
        "runbook/cases/gather_grad.py",
        "runbook/cases/_setup/gather_grad.py",
        "runbook/site/gather_grad.py",
    ],
)
def test_a_case_s_files_rerun_its_page_and_the_pages_of_every_case(tree, module):
    assert _changed(tree, module) == {"cases/gather-grad.md", "index.md"}


def test_the_site_s_shared_renderers_are_core(tree):
    assert _changed(tree, "runbook/site/__init__.py") == set(_prints(tree))


def test_the_core_reruns_every_page(tree):
    assert _changed(tree, "runbook/_measure.py") == set(_prints(tree))


def test_a_data_folder_reruns_the_pages_that_read_it(tree):
    assert _changed(tree, "docs/_data/gpu/H100.json") == {"cases/gather-grad.md", "index.md"}
    assert _changed(tree, "docs/_data/versions/0.1.json") == {"index.md"}


def test_a_new_case_module_is_a_case_and_reruns_the_pages_of_every_case(tree):
    before = _prints(tree)
    (tree / "runbook" / "cases" / "new_case.py").write_text("CASE = None\n")
    after = _prints(tree)
    assert {p for p in before if before[p] != after[p]} == {"index.md"}


@pytest.mark.parametrize("module", ["runbook/runs/recompilation.py", "runbook/_host.py"])
def test_a_real_run_is_its_case_s_and_what_it_shares_is_core(tree, module):
    (tree / "docs" / "cases" / "recompilation.md").write_text(
        PAGE.format(cases="recompilation", data="")
    )
    changed = _changed(tree, module)
    if module.startswith("runbook/runs/"):
        assert changed == {"cases/recompilation.md", "index.md"}
    else:
        assert changed == set(_prints(tree))


@pytest.mark.parametrize(
    "change", ["docs/conf.py", "docs/_static/site.css", "docs/_build/html/index.html"]
)
def test_styling_and_build_outputs_rerun_nothing(tree, change):
    # Sphinx re-runs a changed page itself and compares conf.py's values itself.
    assert _changed(tree, change) == set()


@pytest.mark.parametrize(
    ("key", "value"), [("jax", "2"), ("jaxlib", "2"), ("backend", "gpu"), ("devices", 8)]
)
def test_jax_and_the_backend_rerun_every_page(tree, key, value):
    before, after = _prints(tree), _prints(tree, {**JAX, key: value})
    assert all(before[p] != after[p] for p in before)


def test_xla_flags_rerun_every_page(tree, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    before = _prints(tree)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    after = _prints(tree)
    assert all(before[p] != after[p] for p in before)


def test_a_page_without_a_block_depends_on_everything(tree):
    hashes = runbook_docs.input_hashes(tree, tree / "docs", runbook_docs.environment(JAX))
    deps = runbook_docs.dependencies(tree / "docs" / "index.md", hashes)
    assert set(deps) == set(hashes)


def test_an_unknown_case_in_a_block_is_an_error(tree):
    page = tree / "docs" / "cases" / "bad.md"
    page.write_text(PAGE.format(cases="no-such-case", data=""))
    hashes = runbook_docs.input_hashes(tree, tree / "docs", runbook_docs.environment(JAX))
    with pytest.raises(ValueError, match="unknown case 'no-such-case'"):
        runbook_docs.page_fingerprint(page, hashes)


def test_every_real_page_declares_what_it_reads():
    hashes = runbook_docs.input_hashes(ROOT, ROOT / "docs", runbook_docs.environment(JAX))
    rows = runbook_docs.dependency_rows(ROOT / "docs", hashes)
    pages = {row[0] for row in rows}
    assert {"index", "status", "cases/gather-grad"} <= pages
    for page in (ROOT / "docs" / "cases").glob("*.md"):
        assert runbook_docs.declared(page)["cases"] == [page.stem]


def test_backend_is_asked_of_a_child_process():
    found = runbook_docs.backend()
    assert set(found) == {"jax", "jaxlib", "numpy", "backend", "device_kind", "devices"}
    import jax

    assert found["jax"] == jax.__version__


def test_case_toctree_must_list_every_case_in_order():
    names = ["gather-grad", "pmap-loop"]
    assert (
        runbook_docs.case_toctree_problem(["cases/gather-grad", "cases/pmap-loop", "guide"], names)
        is None
    )
    assert "mirrors" in runbook_docs.case_toctree_problem(["cases/gather-grad"], names)
    assert runbook_docs.case_toctree_problem(["cases/pmap-loop", "cases/gather-grad"], names)


def test_case_toctree_check_uses_the_real_case_list():
    import runbook

    index = (ROOT / "docs" / "index.md").read_text()
    assert ":glob:\n\ncases/*\n" in index  # the Cases navigation is the folder's pages
    listed = sorted(f"cases/{p.stem}" for p in (ROOT / "docs" / "cases").glob("*.md"))
    assert runbook_docs.case_toctree_problem(listed, runbook.case_names()) is None
    assert runbook_docs.case_toctree_problem(listed[1:], runbook.case_names()) is not None


def test_the_extension_doctests_pass():
    import doctest

    failed, tried = doctest.testmod(runbook_docs)
    assert tried >= 3
    assert failed == 0


# The forks run no JAX; JAX, loaded by earlier tests, warns on any fork all the same.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_sphinx_starts_parallel_reads_in_the_order_asked(tmp_path: pathlib.Path):
    """Sphinx's own task runner, with one worker, runs the chunks of `one_page_a_chunk` in
    `read_order`'s order (it pops waiting tasks from the end: a Sphinx that changed this
    would run the heaviest pages last)."""
    from sphinx.util.parallel import ParallelTasks

    log = tmp_path / "started"
    order = runbook_docs.read_order(
        ["status", "guide", "index", "cases/light", "cases/heavy", "versions"],
        {"cases/heavy": 200.0, "cases/light": 40.0},
    )
    assert order == ["cases/heavy", "cases/light", "guide", "index", "versions", "status"]

    def record(chunk: list[str]) -> None:
        with log.open("a") as f:
            f.write(chunk[0] + "\n")
        time.sleep(1.0)  # a page outlasts queueing them all (forks of a loaded process too)

    for nproc in (1, 2):
        log.write_text("")
        tasks = ParallelTasks(nproc)
        for chunk in runbook_docs.one_page_a_chunk(order, nproc):
            tasks.add_task(record, chunk)
        tasks.join()
        started = log.read_text().split()
        # Pages of equal length run in lockstep: with two workers, two at a time, in order.
        pairs = [set(order[i : i + nproc]) for i in range(0, len(order), nproc)]
        assert [set(started[i : i + nproc]) for i in range(0, len(order), nproc)] == pairs


def test_reads_follow_the_last_build_then_the_benchmark(tmp_path: pathlib.Path):
    docs = tmp_path / "docs"
    (docs / "_data" / "bench").mkdir(parents=True)
    (docs / "_data" / "bench" / "bench.json").write_text(
        '{"docs_page_seconds": {"cases/a": 10, "cases/b": 99}}'
    )
    app = type("App", (), {"srcdir": str(docs)})()
    first = type("Env", (), {})()
    names = ["index", "cases/a", "cases/b"]
    runbook_docs._order_reads(app, first, names)
    assert names == ["cases/b", "cases/a", "index"]
    rebuilt = type("Env", (), {"nb_metadata": {"cases/a": {"exec_data": {"runtime": 500.0}}}})()
    runbook_docs._order_reads(app, rebuilt, names)
    assert names == ["cases/a", "cases/b", "index"]
