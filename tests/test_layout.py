"""The package's layout: no import cycles, the site imported only by the site, case modules
that stand alone, registries read from the modules, and every page module's protocol."""

from __future__ import annotations

import ast
import graphlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import runbook
from runbook._case import _CASES

PACKAGE = Path(runbook.__file__).parent

# What `import runbook.cases.<case>` may bring of the package: the package's own start
# (its version check and the plugin filter), the case types, and the errors they raise.
CASE_MAY_IMPORT = {
    "runbook",
    "runbook._releases",
    "runbook._quiet",
    "runbook._errors",
    "runbook._case_types",
    "runbook.cases",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports, at any depth of its code, except under
    ``if TYPE_CHECKING:`` (never run)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif source in modules:
                    found.add(source)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module's imports of the package, with the module a case's `Case.figures` names
    counted as an import of `runbook._case`, which loads it by name to measure the case."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    for name in runbook.case_names():
        figures = runbook.get_case(name).figures
        if figures is not None:
            graph["runbook._case"].add(figures.partition(":")[0])
    return graph


def _outside_site(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports of `runbook.site` by modules outside it."""
    inside = ("runbook.site", "runbook.site.")
    return {
        m: found
        for m, imports in graph.items()
        if not m.startswith(inside)
        and (found := {i for i in imports if i == "runbook.site" or i.startswith(inside[1])})
    }


def test_the_graph_reader_sees_imports_in_functions_and_skips_type_checking(tmp_path):
    graph = import_graph()
    assert "runbook._provenance" in graph["runbook._cache"]  # imported inside a function
    assert "runbook._case" not in graph["runbook"]  # only under TYPE_CHECKING


def test_no_import_cycles_between_runbook_modules():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_nothing_outside_the_site_imports_it():
    assert _outside_site(import_graph()) == {}


def test_an_import_of_the_site_from_the_library_is_caught():
    graph = import_graph()
    graph["runbook._measure"] = graph["runbook._measure"] | {"runbook.site._accelerator"}
    assert _outside_site(graph) == {"runbook._measure": {"runbook.site._accelerator"}}


def test_a_cycle_is_caught():
    graph = import_graph()
    graph["runbook._case_types"] = graph["runbook._case_types"] | {"runbook._case"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


# One fresh Python imports each case module in turn, first forgetting every module of the
# package the one before brought in (JAX, imported once, stays): each import is seen alone.
_EACH_ALONE = """
import json, sys, importlib, jax
pulled = {}
for module in sys.argv[1:]:
    for m in [m for m in sys.modules if m == "runbook" or m.startswith("runbook.")]:
        del sys.modules[m]
    importlib.import_module(module)
    pulled[module] = sorted(m for m in sys.modules if m.startswith("runbook"))
print(json.dumps(pulled))
"""


@pytest.fixture(scope="module")
def pulled_alone() -> dict[str, list[str]]:
    """Each case module's imports of the package, when imported alone."""
    out = subprocess.run(
        [sys.executable, "-c", _EACH_ALONE, *sorted(_CASES.values())],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    found: dict[str, list[str]] = json.loads(out.strip().splitlines()[-1])
    return found


def test_each_import_is_seen_alone(pulled_alone):
    # the child forgets what one import brought in before the next: the case types, which
    # every case module imports, are seen in each
    assert all("runbook._case_types" in found for found in pulled_alone.values())


@pytest.mark.parametrize("module", sorted(_CASES.values()))
def test_a_case_module_imports_alone_and_pulls_in_only_the_case_types(module, pulled_alone):
    pulled = set(pulled_alone[module]) - {module}
    # and its own measurement setup, where it keeps one (`runbook/cases/_setup/<case>.py`)
    allowed = CASE_MAY_IMPORT | {
        "runbook.cases._setup",
        module.replace(".cases.", ".cases._setup."),
    }
    assert pulled <= allowed, f"{module} pulled in {sorted(pulled - allowed)}"


def test_a_case_s_setup_belongs_to_a_case_and_imports_no_case():
    graph = import_graph()
    for path in sorted((PACKAGE / "cases" / "_setup").glob("[!_]*.py")):
        assert (PACKAGE / "cases" / path.name).exists(), f"{path.name}: no case of that name"
        imported = graph[_module_name(path)]
        assert not {m for m in imported if m.startswith("runbook.cases.") and "_setup" not in m}


def test_every_case_module_is_a_case_named_for_its_file():
    found = sorted(p.stem for p in (PACKAGE / "cases").glob("*.py") if not p.stem.startswith("_"))
    assert [n.replace("-", "_") for n in runbook.case_names()] == found
    for name in runbook.case_names():
        assert runbook.get_case(name).name == name


def test_every_compile_time_case_has_a_detector_named_for_it():
    from runbook.detectors import MODULES

    compiled = {n for n in runbook.case_names() if not runbook.get_case(n).runtime}
    assert {m.CASE for m in MODULES} == compiled
    for module in MODULES:
        assert module.__name__.rpartition(".")[2] == module.CASE.replace("-", "_")
        assert callable(module.detect)
        assert callable(module.rule)
        assert module.PATTERN


@pytest.mark.parametrize("name", runbook.case_names())
def test_every_page_module_keeps_its_protocol(name):
    from runbook.site._page import CasePage, page_module, protocols

    module = page_module(name)
    wanted = protocols(name)
    assert wanted[0] is CasePage
    for protocol in wanted:
        assert isinstance(module, protocol), f"{module.__name__} is not a {protocol.__name__}"
    params = inspect.signature(module.claims).parameters
    assert params["target"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["scale"].default == "seed"
    if hasattr(module, "REPORTS"):
        assert module.REPORTS
        assert all(isinstance(k, str) and k and v for k, v in module.REPORTS.items())
    if runbook.get_case(name).figures is not None:
        assert module.KEY_FIGURE in module.FIGURES
        assert module.RECOMMENDED in {v.name for v in runbook.get_case(name).variants}


def test_a_page_without_its_claims_breaks_the_protocol():
    import types

    from runbook.site._page import CasePage, CitedPage

    page = types.ModuleType("runbook.site.nothing")
    assert not isinstance(page, CasePage)
    page.claims = lambda *args, target=None, scale="seed": []  # type: ignore[attr-defined]
    assert isinstance(page, CasePage)
    assert not isinstance(page, CitedPage)


@pytest.mark.parametrize("name", runbook.case_names())
def test_a_case_module_stays_short_enough_to_read(name):
    # what a reader copies, and its `CASE`; a long setup goes to runbook/cases/_setup/.
    limit = 250
    lines = (PACKAGE / "cases" / f"{name.replace('-', '_')}.py").read_text().count("\n")
    assert lines <= limit, f"{name}: {lines} lines"
