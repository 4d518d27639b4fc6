#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.2.9"]
# ///
"""Sessions: tests, docs, lint (default); versions, gpu, browser (on demand)."""

from __future__ import annotations

import shutil
from pathlib import Path

import nox

nox.needs_version = ">=2025.2.9"
nox.options.default_venv_backend = "uv|virtualenv"

ROOT = Path(__file__).parent
PROJECT = nox.project.load_toml("pyproject.toml")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (pass pytest options after --)."""
    session.install("-e.", *nox.project.dependency_groups(PROJECT, "test"))
    session.run("pytest", *session.posargs)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the site, executing every page. `-- --serve` is not offered: open docs/_build/html."""
    session.install("-e.", *nox.project.dependency_groups(PROJECT, "docs"))
    build = ROOT / "docs" / "_build"
    if "--fresh" in session.posargs:
        shutil.rmtree(build, ignore_errors=True)
    session.run(
        "sphinx-build", "-n", "-T", "-W", "--keep-going", "-b", "html",
        "docs", str(build / "html"),
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff: lint and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
