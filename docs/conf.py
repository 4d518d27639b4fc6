"""Sphinx configuration: MyST-NB pages executed at every build, warnings are errors.

Sphinx re-reads (and so re-executes) only the pages whose source changed. Every page's
numbers also depend on the `runbook` package, the JAX release and the backend, so those
go into `runbook_fingerprint`, a config value with ``rebuild="env"``: when it changes,
Sphinx discards its environment and every page runs again. A warm rebuild with nothing
changed re-runs nothing; a rebuild after any change that could move a number re-runs all.
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

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent

project = "JAX Memory Runbook"
author = "JAX Memory Runbook developers"
copyright = "2026, JAX Memory Runbook developers"
REPOSITORY = "https://github.com/jax-memory-runbook/jax-memory-runbook"

extensions = [
    "myst_nb",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.extlinks",
]
exclude_patterns = ["_build", "jupyter_execute", "_tools", "**.ipynb_checkpoints", "README.md"]
nitpicky = True  # also for builds that do not pass -n (Read the Docs)

# Every page runs at build time; a cell that raises fails the build.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 900
nb_merge_streams = True
nb_execution_excludepatterns: list[str] = []  # none: every page runs on CPU
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist", "substitution"]
myst_heading_anchors = 3

# Cross-references to the JAX documentation. Intersphinx would need JAX's objects.inv,
# which is only on the network, and the site must build with no network at all; so these
# are plain links through `extlinks`: {jax-api}`jax.grad` links the API page of jax.grad.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
extlinks = {
    "jax-api": ("https://docs.jax.dev/en/latest/_autosummary/%s.html", "%s"),
    "jax-doc": ("https://docs.jax.dev/en/latest/%s", "%s"),
}

# The API reference on the guide page: signatures without annotations, which would be
# cross-references to jax types that no offline inventory can resolve.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "JAX Memory Runbook"
html_static_path = ["_static"]
html_css_files = ["runbook.css"]
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": "main",
    "path_to_docs": "docs",
    "use_repository_button": True,
    "use_source_button": True,
    "use_issues_button": True,
    "home_page_in_toc": True,
    "show_toc_level": 2,
    # The landing page's case table needs the width more than a two-entry page outline.
    "secondary_sidebar_items": {"**": ["page-toc.html"], "index": []},
    "navigation_with_keys": False,
}
# pydata-sphinx-theme falls back to an empty mode on a first visit (empty localStorage) and
# logs a console error for it; start from "auto" (follow the reader's system setting).
html_context = {"default_mode": "auto"}
copybutton_exclude = ".linenos, .gp, .go"
# The copy button (on every code block and cell) copies what a reader types: no `>>> ` or
# `... ` doctest prompts, and IPython's `!` dropped from shell commands.
copybutton_prompt_text = r">>> |\.\.\. |!"
copybutton_prompt_is_regexp = True

# `!python -m runbook ...` in a page must run this build's interpreter, whatever PATH was.
os.environ["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), os.environ["PATH"]])


# --- the fingerprint of everything a number on the site depends on -------------------

# Environment variables that change what XLA compiles (and so the bytes it reports).
_ENV_PREFIXES = ("XLA_", "JAX_", "TF_CPP_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
# Files under docs/ that are not pages but that pages read (data files from nox sessions).
_NOT_INPUTS = {
    "_build",
    "jupyter_execute",
    "_static",
    "_tools",
    "__pycache__",
    ".ipynb_checkpoints",
}


def _backend() -> dict[str, str]:
    """JAX's versions and default backend, asked of a child process.

    A child, because initialising a GPU backend in the Sphinx process would hold device
    memory the executing pages need.
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


def fingerprint() -> tuple[str, dict[str, object]]:
    """A hash of the package source, the docs' data files, JAX, the backend and the machine."""
    digest = hashlib.sha256()
    package = ROOT / "runbook"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    for path in sorted(DOCS.rglob("*")):
        rel = path.relative_to(DOCS)
        if (
            path.is_file()
            and path.suffix not in {".md", ".py"}
            and not _NOT_INPUTS & set(rel.parts)
        ):
            digest.update(rel.as_posix().encode() + b"\0" + path.read_bytes())
    parts: dict[str, object] = {
        **_backend(),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }
    digest.update(json.dumps(parts, sort_keys=True).encode())
    return digest.hexdigest()[:16], parts


runbook_fingerprint, _parts = fingerprint()
# The pages' kernels inherit the environment: the status page shows what the build hashed.
os.environ["RUNBOOK_DOCS_FINGERPRINT"] = runbook_fingerprint
os.environ["RUNBOOK_DOCS_FINGERPRINT_PARTS"] = json.dumps(_parts, sort_keys=True)


# --- navigation mirrors the case list --------------------------------------------------


def _check_case_pages(app, env) -> None:
    """Warn (an error under -W) unless the Cases toctree lists exactly `runbook.case_names()`."""
    from sphinx.util import logging

    import runbook

    logger = logging.getLogger("runbook")
    expected = [f"cases/{name}" for name in runbook.case_names()]
    listed = [
        d for d in env.toctree_includes.get(env.config.root_doc, []) if d.startswith("cases/")
    ]
    if listed != expected:
        logger.warning(
            "the Cases toctree in index.md lists %s but runbook.case_names() gives %s: "
            "add, remove or reorder the case pages so the navigation mirrors the case list.",
            listed, expected, location=env.config.root_doc,
        )  # fmt: skip


# --- docstrings: the package writes `code` the Markdown way ---------------------------

_MARKDOWN_CODE = re.compile(r"(?<![`:\w])`([^`]+)`(?!`)")


def _markdown_code(app, what, name, obj, options, lines: list[str]) -> None:
    """Render the package's single-backtick `code` as code, and `|x|` as text, not markup.

    Runs after napoleon has turned the Google-style sections into fields. Doctest lines
    are left alone.
    """
    for i, line in enumerate(lines):
        if line.lstrip().startswith((">>>", "...")):
            continue
        line = line.replace("|", r"\|")
        lines[i] = _MARKDOWN_CODE.sub(r":code:`\1`\\ ", line)


def setup(app):
    app.connect("autodoc-process-docstring", _markdown_code, priority=900)
    app.add_config_value("runbook_fingerprint", "", "env")
    app.connect("env-check-consistency", _check_case_pages)
    return {"parallel_read_safe": True}
