"""Sphinx configuration: MyST-NB pages executed at every build, warnings are errors."""

from __future__ import annotations


project = "JAX Memory Runbook"
author = "JAX Memory Runbook developers"
copyright = "2026, JAX Memory Runbook developers"

extensions = ["myst_nb", "sphinx_copybutton", "sphinx_design", "sphinx.ext.intersphinx"]
exclude_patterns = ["_build", "jupyter_execute", "**.ipynb_checkpoints", "README.md"]

# Every page runs at build time; a cell that raises fails the build.
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_execution_timeout = 900
nb_merge_streams = True
nb_execution_excludepatterns: list[str] = []  # none: every page runs on CPU
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist", "substitution"]
myst_heading_anchors = 3

# Intersphinx needs the network; the site must build without it, so links are plain.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}

html_theme = "sphinx_book_theme"
html_title = "JAX Memory Runbook"
html_static_path = ["_static"]
html_css_files = ["runbook.css"]
html_theme_options = {
    "repository_url": "https://github.com/jax-memory-runbook/jax-memory-runbook",
    "repository_branch": "main",
    "path_to_docs": "docs",
    "use_repository_button": True,
    "use_source_button": True,
    "show_toc_level": 2,
}
copybutton_exclude = ".linenos, .gp, .go"

