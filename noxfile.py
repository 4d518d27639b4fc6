#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.2.9"]
# ///
"""Sessions: tests and lint (default); docs, browser, versions and gpu (on demand)."""

from __future__ import annotations

import os
import runpy
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
    """Build the site, executing every page.

    `-- --fresh` deletes the previous build first; `-- --cuda` measures with JAX's CUDA
    build (on a machine with an NVIDIA GPU).
    """
    session.install("-e.", *nox.project.dependency_groups(PROJECT, "docs"))
    if "--cuda" in session.posargs:
        session.install("jax[cuda12]")
    build = ROOT / "docs" / "_build"
    if "--fresh" in session.posargs:
        shutil.rmtree(build, ignore_errors=True)
    session.run(
        "sphinx-build", "-n", "-T", "-W", "--keep-going", "-b", "html",
        "docs", str(build / "html"),
    )  # fmt: skip


@nox.session(default=False)
def browser(session: nox.Session) -> None:
    """Open every built page in headless Chromium (Debian's `chromium`) and check it."""
    if not (ROOT / "docs" / "_build" / "html" / "index.html").exists():
        session.error("no built site: run `nox -s docs` first")
    session.install("playwright")
    script = str(ROOT / "docs" / "_tools" / "browser_check.py")
    session.run("python", script, "--self-test")
    session.run("python", script, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff: lint and format check."""
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


def _releases() -> tuple[str, ...]:
    # The one list lives in the package; read it without importing JAX into nox's Python.
    return tuple(runpy.run_path(str(ROOT / "runbook" / "_releases.py"))["RELEASES"])


@nox.session(default=False)
@nox.parametrize("release", _releases(), ids=_releases())
def versions(session: nox.Session, release: str) -> None:
    """Measure every case in a fresh environment per JAX release (`-- --time-limit 120`).

    Writes docs/_data/versions/<release>.json; `nox -s "versions(0.4.30)"` runs one release.
    """
    # optax: the frozen-params case's train steps (the resolver picks a release that fits).
    session.install(f"jax=={release}", f"jaxlib=={release}", "numpy", "optax")
    session.install("--no-deps", "-e.")  # matplotlib is only needed to plot, not to measure
    out = ROOT / "docs" / "_data" / "versions" / f"{release}.json"
    session.run("python", "-m", "runbook._matrix", "--out", str(out), *session.posargs)


@nox.session(default=False, venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Real peaks on this machine's GPU, with the Python on PATH (a CUDA build of JAX).

    Writes docs/_data/gpu/<device-kind>.json. Needs no network: nothing is installed.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    session.run(
        "python", "-m", "runbook._gpu", "--out-dir", str(ROOT / "docs" / "_data" / "gpu"),
        *session.posargs, env={"PYTHONPATH": path},
    )  # fmt: skip


if __name__ == "__main__":
    nox.main()
