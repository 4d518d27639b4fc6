"""The package's layout: no import cycles, and case modules that stand alone."""

from __future__ import annotations

import ast
import graphlib
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
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def test_the_graph_reader_sees_imports_in_functions_and_skips_type_checking(tmp_path):
    graph = import_graph()
    assert "runbook._provenance" in graph["runbook._cache"]  # imported inside a function
    assert "runbook._case" not in graph["runbook"]  # only under TYPE_CHECKING


def test_no_import_cycles_between_runbook_modules():
    try:
        graphlib.TopologicalSorter(import_graph()).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def test_a_cycle_is_caught():
    graph = import_graph()
    graph["runbook._case_types"] = graph["runbook._case_types"] | {"runbook._case"}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


@pytest.mark.parametrize("module", sorted(_CASES.values()))
def test_a_case_module_imports_alone_and_pulls_in_only_the_case_types(module):
    code = (
        f"import json, sys, {module}\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('runbook'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    pulled = set(json.loads(out.strip().splitlines()[-1])) - {module}
    assert pulled <= CASE_MAY_IMPORT, f"{module} pulled in {sorted(pulled - CASE_MAY_IMPORT)}"
