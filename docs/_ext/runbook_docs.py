"""The site's own Sphinx extension: the build fingerprint, the case-list check, docstrings.

Sphinx re-reads (and so re-executes) only the pages whose source changed. Every page's
numbers also depend on the `runbook` package, the JAX release, the backend and the data
files the pages read, so those go into the config value ``runbook_fingerprint``, which is
registered with ``rebuild="env"``: when it changes, Sphinx discards its environment and
every page runs again. A rebuild with nothing changed re-runs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

# Environment variables that change what XLA compiles (and so the bytes it reports).
ENV_PREFIXES = ("XLA_", "JAX_", "TF_CPP_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
# Under docs/, what is not an input of a page's numbers: build outputs, styling, tooling.
# Pages (.md) are not hashed either: Sphinx already re-runs a page whose source changed.
NOT_INPUTS = {"_build", "jupyter_execute", "_static", "_tools", "_ext", "__pycache__"}


def backend() -> dict[str, Any]:
    """JAX's versions and default backend, asked of a child process.

    A child, because initialising a GPU backend in the Sphinx process would hold device
    memory that the executing pages need.
    """
    probe = (
        "import json, jax, jaxlib, numpy; d = jax.devices()[0]; print(json.dumps({"
        "'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'numpy': numpy.__version__,"
        "'backend': jax.default_backend(), 'device_kind': d.device_kind,"
        "'devices': jax.device_count()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def fingerprint(
    root: pathlib.Path, docs: pathlib.Path, environment: dict[str, Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """A short hash of everything a number on the site depends on, and what went into it.

    Args:
        root: the repository (its ``runbook/**/*.py`` are hashed).
        docs: the Sphinx source folder (its data files are hashed).
        environment: JAX versions and backend; `backend()` when not given.
    """
    digest = hashlib.sha256()
    for path in sorted((root / "runbook").rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    for path in sorted(docs.rglob("*")):
        rel = path.relative_to(docs)
        if path.is_file() and path.suffix != ".md" and not NOT_INPUTS & set(rel.parts):
            if rel.as_posix() == "conf.py":
                continue  # Sphinx compares its config values itself
            digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes())
    parts: dict[str, Any] = {
        **(environment if environment is not None else backend()),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()[:16], parts


def case_toctree_problem(listed: Sequence[str], case_names: Sequence[str]) -> str | None:
    """Why the Cases toctree does not mirror the case list, or None when it does."""
    pages = [d for d in listed if d.startswith("cases/")]
    expected = [f"cases/{name}" for name in case_names]
    if pages == expected:
        return None
    return (
        f"the toctree of index.md lists case pages {pages} but runbook.case_names() gives "
        f"{expected}: add, remove or reorder the pages so the navigation mirrors the cases."
    )


def _check_case_pages(app: Any, env: Any) -> None:
    from sphinx.util import logging

    import runbook

    listed = env.toctree_includes.get(env.config.root_doc, [])
    problem = case_toctree_problem(listed, runbook.case_names())
    if problem:  # a warning: an error under -W
        logging.getLogger(__name__).warning(problem, location=env.config.root_doc)


_MARKDOWN_CODE = re.compile(r"(?<![`:\w])`([^`]+)`(?!`)")


def markdown_code(lines: list[str]) -> None:
    """Make the package's Markdown-style docstrings valid reStructuredText, in place.

    Single-backtick `code` becomes a code literal (in reST it would be a cross-reference
    to nothing, or broken markup before a letter) and ``|`` is escaped (a substitution
    reference otherwise). Doctest lines are left alone.

    Examples:
        >>> lines = ["Compile `fn` for `jax.ShapeDtypeStruct`s: |a - b|.", ">>> f(`x`)"]
        >>> markdown_code(lines)
        >>> lines[0]
        'Compile :code:`fn`\\\\  for :code:`jax.ShapeDtypeStruct`\\\\ s: \\\\|a - b\\\\|.'
        >>> lines[1]
        '>>> f(`x`)'
    """
    for i, line in enumerate(lines):
        if line.lstrip().startswith((">>>", "...")):
            continue
        line = line.replace("|", r"\|")
        lines[i] = _MARKDOWN_CODE.sub(r":code:`\1`\\ ", line)


def _process_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]):
    markdown_code(lines)


def setup(app: Any) -> dict[str, Any]:
    app.add_config_value("runbook_fingerprint", "", "env")
    app.connect("env-check-consistency", _check_case_pages)
    # After napoleon (priority 500) has turned the Google-style sections into fields.
    app.connect("autodoc-process-docstring", _process_docstring, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
