"""The docs' own Sphinx extension (docs/_ext/runbook_docs.py): the build fingerprint that
keeps numbers from going stale, and the check that the navigation mirrors the case list."""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "runbook_docs", ROOT / "docs" / "_ext" / "runbook_docs.py"
)
assert _spec is not None
assert _spec.loader is not None
runbook_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runbook_docs)

JAX = {
    "jax": "1",
    "jaxlib": "1",
    "numpy": "2",
    "backend": "cpu",
    "device_kind": "cpu",
    "devices": 1,
}


@pytest.fixture
def tree(tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of the package and a small docs folder."""
    shutil.copytree(ROOT / "runbook", tmp_path / "runbook")
    docs = tmp_path / "docs"
    for folder in ("cases", "_static", "_build/html", "_data"):
        (docs / folder).mkdir(parents=True)
    (docs / "index.md").write_text("# page\n")
    (docs / "conf.py").write_text("project = 'x'\n")
    (docs / "_static" / "site.css").write_text("p {}\n")
    (docs / "_build" / "html" / "index.html").write_text("<p>built</p>\n")
    (docs / "_data" / "matrix.json").write_text('{"bytes": 1}\n')
    return tmp_path


def _print(tree: pathlib.Path, environment: dict | None = None) -> str:
    return runbook_docs.fingerprint(tree, tree / "docs", environment or JAX)[0]


@pytest.mark.parametrize(
    "change",
    [
        "runbook/_measure.py",
        "runbook/cases/gather_grad.py",
        "docs/_data/matrix.json",
    ],
)
def test_a_change_to_what_numbers_depend_on_changes_the_fingerprint(tree, change):
    before = _print(tree)
    with (tree / change).open("a") as f:
        f.write("\n# changed\n")
    assert _print(tree) != before


def test_a_new_package_module_changes_the_fingerprint(tree):
    before = _print(tree)
    (tree / "runbook" / "cases" / "new_case.py").write_text("CASE = None\n")
    assert _print(tree) != before


@pytest.mark.parametrize(
    "change",
    ["docs/index.md", "docs/conf.py", "docs/_static/site.css", "docs/_build/html/index.html"],
)
def test_pages_styling_and_build_outputs_leave_it_alone(tree, change):
    # Sphinx re-runs a changed page itself and compares conf.py's values itself.
    before = _print(tree)
    with (tree / change).open("a") as f:
        f.write("\n")
    assert _print(tree) == before


@pytest.mark.parametrize(
    ("key", "value"), [("jax", "2"), ("jaxlib", "2"), ("backend", "gpu"), ("devices", 8)]
)
def test_jax_and_the_backend_change_the_fingerprint(tree, key, value):
    assert _print(tree, {**JAX, key: value}) != _print(tree)


def test_xla_flags_change_the_fingerprint(tree, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    before = _print(tree)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert _print(tree) != before


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
    listed = [line.strip() for line in index.splitlines() if line.strip().startswith("cases/")]
    assert runbook_docs.case_toctree_problem(listed, runbook.case_names()) is None
