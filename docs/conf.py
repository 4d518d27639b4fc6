"""Sphinx configuration: MyST-NB pages executed at every build, warnings are errors.

A rebuild re-runs the pages whose source changed, and the pages whose inputs changed: the
case modules and data each page names in its front matter, the measurement core, JAX and
the backend (see docs/_ext/runbook_docs.py).
"""

from __future__ import annotations

import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS / "_ext"))

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
    "runbook_docs",  # per-page fingerprints, the case-list check, docstrings
]
exclude_patterns = [
    "_build",
    "jupyter_execute",
    "_tools",
    "_ext",
    "**.ipynb_checkpoints",
    "README.md",
]
nitpicky = True  # also for builds that do not pass -n (Read the Docs)
# Types in the attributes of `runbook.Diagnosis` with no page of their own (and no offline
# inventory for the standard library's).
nitpick_ignore = [
    ("py:class", "collections.abc.Mapping"),
    ("py:class", "runbook._program.NearMiss"),
]

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
    # Wide measurement tables need the width more than a page outline: the landing page and
    # the case pages (whose outline is in the header) go without the right-hand sidebar.
    "secondary_sidebar_items": {"index": [], "cases/*": []},
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


# --- numbers never stale: see docs/_ext/runbook_docs.py ---------------------------------

# Measurements are stored by the hash of everything they depend on (runbook/_cache.py), so a
# page re-executed because a neighbour changed re-measures only what changed.
os.environ.setdefault("RUNBOOK_CACHE_DIR", str(DOCS / "_build" / "runbook-cache"))
# What the GPU and TPU compilers made of each program the pages compile for a target, as
# `nox -s store` recorded them (the same on every machine: see runbook/_cache.py). A build
# compiles what it lacks; RUNBOOK_STORE_DIR= (empty) compiles everything here.
os.environ.setdefault("RUNBOOK_STORE_DIR", str(DOCS / "_store"))
os.environ["RUNBOOK_DOCS_DIR"] = str(DOCS)
