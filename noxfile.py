#!/usr/bin/env -S uv run --script
# /// script
# dependencies = ["nox>=2025.10.14"]
# ///
"""Sessions: tests and lint (default); docs, rtd, browser, versions, bench, gpu and gpu-corpus
(on demand)."""

from __future__ import annotations

import logging
import os
import re
import runpy
import shutil
import time
from pathlib import Path

import nox

nox.needs_version = ">=2025.10.14"  # the first nox with the download_python option
nox.options.default_venv_backend = "uv|virtualenv"
# A session whose Python is not on the machine (docs and tests(newest) run on 3.13) gets one
# from uv, a python-build-standalone build, where the network allows (virtualenv backend:
# nox's own download, with its `pbs` extra). `--download-python never` turns that off.
nox.options.download_python = "auto"


class _SayWhatToInstall(logging.Filter):
    """Where a session's Python is neither on the machine nor downloadable, nox skips it with
    "Python interpreter 3.13 not found", after a line on what CI would do; say instead, in one
    line, what to install. (Should nox reword its line, its own comes through unchanged.)"""

    NOT_FOUND = re.compile(r"Python interpreter (\S+) not found")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message == "Missing interpreters will error by default on CI systems.":
            return False
        said = self.NOT_FOUND.sub(
            lambda found: (
                f"needs Python {found[1]}, which nox neither found nor could download: install it"
                f" (your distribution's python{found[1]}, python.org, or"
                f" `uv python install {found[1]}`) and run again"
            ),
            message,
        )
        if said != message:
            record.msg, record.args = said, ()
        return True


logging.getLogger("nox").addFilter(_SayWhatToInstall())

ROOT = Path(__file__).parent
PROJECT = nox.project.load_toml("pyproject.toml")


# Without a GPU or TPU, JAX must not try to start the compiler plugins' runtimes (the
# `targets` extra installs them): pages and tests measure on the CPU and compile for targets.
CPU_ONLY = {"JAX_PLATFORMS": "cpu"}

# uv installs without compiling bytecode, pip compiles it: without .pyc files every Python a
# session starts (each test worker, each measuring child, each notebook) compiles JAX's
# sources again where PYTHONDONTWRITEBYTECODE is set, and its first imports race where not.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


# The one list of releases and tested ends lives in the package; read it without importing
# JAX into nox's Python.
RELEASES = runpy.run_path(str(ROOT / "runbook" / "_releases.py"))
ENDS = RELEASES["TESTED"]  # {"oldest": (python, jax), "newest": (python, jax)}


@nox.session
@nox.parametrize(("python", "release"), [ENDS["oldest"], ENDS["newest"]], ids=["oldest", "newest"])
def tests(session: nox.Session, release: str) -> None:
    """Run the test suite at both ends of the tested range (pass pytest options after --).

    `nox -s "tests(oldest)"` or `nox -s "tests(newest)"` runs one end.
    """
    session.install(
        "-e.[targets]", f"jax=={release}", f"jaxlib=={release}",
        *nox.project.dependency_groups(PROJECT, "test"),
    )  # fmt: skip
    # One worker per core; a worker that runs out of tests takes some of another's, so one
    # long file does not leave the others idle (pass `-n 0` after -- to run in this process).
    session.run(
        "pytest", "-n", "auto", "--maxprocesses", "8", "--dist", "worksteal", *session.posargs,
        env=CPU_ONLY,
    )  # fmt: skip


@nox.session(default=False, python=ENDS["newest"][0])
def docs(session: nox.Session) -> None:
    """Build the site, executing every page.

    `-- --fresh` deletes the previous build first; `-- --cuda` measures with JAX's CUDA
    build (on a machine with an NVIDIA GPU); `-- --no-store` compiles every program for the
    GPU and TPU targets here instead of reading what docs/_store holds (`nox -s store`).
    """
    session.install("-e.[targets]", *nox.project.dependency_groups(PROJECT, "docs"))
    env = dict(CPU_ONLY)
    if "--no-store" in session.posargs:
        env["RUNBOOK_STORE_DIR"] = ""
    if "--cuda" in session.posargs:
        session.install("jax[cuda12]")
        env = {}
    build = ROOT / "docs" / "_build"
    if "--fresh" in session.posargs:
        shutil.rmtree(build, ignore_errors=True)
    # The same command as Read the Docs' (see .readthedocs.yaml).
    session.run("python", "docs/_tools/build_site.py", str(build / "html"), env=env)


@nox.session(default=False)
def browser(session: nox.Session) -> None:
    """Open every built page in headless Chromium (Debian's `chromium`) and check it."""
    if not (ROOT / "docs" / "_build" / "html" / "index.html").exists():
        session.error("no built site: run `nox -s docs` first")
    session.install("playwright")
    script = str(ROOT / "docs" / "_tools" / "browser_check.py")
    session.run("python", script, "--self-test")
    session.run("python", script, *session.posargs)


@nox.session(default=False, venv_backend="none")
def rtd(session: nox.Session) -> None:
    """Rehearse the hosted build: `.readthedocs.yaml`'s own install and build commands, in a
    fresh clone and environment on the Python it names, timed against Read the Docs' limit.

    `-- --offline-build` runs its build step with no network (loopback only; needs root).
    """
    script = str(ROOT / "docs" / "_tools" / "rehearse_rtd.py")
    session.run("uv", "run", "--no-project", "--with", "pyyaml", "python", script,
                *session.posargs)  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff (lint and format check) and mypy over the package, which ships py.typed."""
    session.install("-e.[targets]", *nox.project.dependency_groups(PROJECT, "lint"))
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", env=CPU_ONLY)


@nox.session(default=False)
@nox.parametrize(
    ("python", "release"),
    [(RELEASES["python_for"](r), r) for r in RELEASES["RELEASES"]],
    ids=list(RELEASES["RELEASES"]),
)
def versions(session: nox.Session, release: str) -> None:
    """Measure every case in a fresh environment per JAX release (`-- --time-limit 120`), on
    CPU and compiled for an H100 where that release's GPU compiler is published (and for the
    TPU a case names in `Case.shown_on`, where that release's libtpu is published).

    Each release runs on a Python it publishes wheels for (3.12 or newer from jax 0.11 on);
    where that Python is not on the machine, nox says so in one line and skips the release.
    Writes docs/_data/versions/<release>.json; `nox -s "versions(0.4.30)"` runs one release.
    """
    started = time.time()  # the file records the session's time, installs included
    # optax: the frozen-params case's train steps (the resolver picks a release that fits).
    session.install(f"jax=={release}", f"jaxlib=={release}", "numpy", "optax")
    session.install("--no-deps", "-e.")  # matplotlib is only needed to plot, not to measure
    try:  # the GPU compiler of this release, where one was published; else "not applicable"
        session.install(
            f"jax-cuda12-plugin=={release}", "nvidia-cuda-nvcc-cu12>=12.6.85", "nvidia-cudnn-cu12"
        )
    except nox.command.CommandFailed:
        session.log(f"no jax-cuda12-plugin {release}: its GPU targets are recorded as such")
    try:  # the TPU compiler, for the cases a TPU shows (Case.shown_on), where published
        session.install(f"jax[tpu]=={release}")
    except nox.command.CommandFailed:  # before jax 0.5, jax[tpu] pins an unpublished libtpu
        session.log(f"no libtpu for jax {release}: its TPU targets are recorded as such")
    # jaxlib 0.4.35 finds ptxas only in a regular `nvidia.cuda_nvcc` package, which the
    # current wheel is not (a namespace package); CUDA_ROOT is the path jaxlib checks first.
    env = {**CPU_ONLY, "RUNBOOK_SESSION_STARTED": repr(started)}
    nvcc = sorted(
        Path(session.virtualenv.location).glob("lib/python*/site-packages/nvidia/cuda_nvcc")
    )
    if nvcc:
        env["CUDA_ROOT"] = str(nvcc[0])
    out = ROOT / "docs" / "_data" / "versions" / f"{release}.json"
    session.run(
        "python",
        "-m",
        "runbook.site.producers.matrix",
        "--out",
        str(out),
        *session.posargs,
        env=env,
    )


@nox.session(default=False, python=ENDS["newest"][0])
def bench(session: nox.Session) -> None:
    """Time measuring, its overhead over a bare compile, each fix's run time and the docs
    builds (cold, warm, after a one-line case edit). Writes docs/_data/bench/bench.json."""
    session.install("-e.[targets]", *nox.project.dependency_groups(PROJECT, "docs"))
    out = ROOT / "docs" / "_data" / "bench" / "bench.json"
    session.run("python", "-m", "runbook.site.producers.bench", "--out", str(out), "--docs", *session.posargs,
                env=CPU_ONLY)  # fmt: skip


# The docs' own Python, whatever runs nox: a store made at another release would answer for
# nothing the site's build asks (its entries are keyed by the compilers' versions).
@nox.session(default=False, python=ENDS["newest"][0])
def store(session: nox.Session) -> None:
    """Build the site (every page executes) and write docs/_store: each program it compiled
    for a GPU or TPU target, as measured, for builds elsewhere to read instead of compiling.
    Run after changing the measurement core or a case, and commit docs/_store."""
    session.install("-e.[targets]", *nox.project.dependency_groups(PROJECT, "docs"))
    session.run("python", "-m", "runbook.site.producers.store", *session.posargs, env=CPU_ONLY)


@nox.session(default=False)
@nox.parametrize(("python", "release"), [ENDS["oldest"], ENDS["newest"]], ids=["oldest", "newest"])
def store_tests(session: nox.Session, release: str) -> None:
    """Run the test suite at one end, as `nox -s tests` does, and write tests/_store/jax-<release>:
    each compile for a GPU or TPU target the tests asked for, which the suite then reads
    instead of compiling. Run after changing the measurement core or a case (pytest options
    after --), and commit tests/_store."""
    session.install(
        "-e.[targets]", f"jax=={release}", f"jaxlib=={release}",
        *nox.project.dependency_groups(PROJECT, "test"),
    )  # fmt: skip
    session.run("python", "-m", "runbook.site.producers.store", "--tests", *session.posargs,
                env=CPU_ONLY)  # fmt: skip


@nox.session(default=False)
def oom(session: nox.Session) -> None:
    """The out-of-memory messages the runbook makes itself (XLA's TPU compiler for a v5e,
    without the device; XLA's CPU runtime), for `runbook.explain`'s page and tests. Writes
    docs/_data/oom/{tpu_v5e_gather_grad,tpu_v5e_vocab_logits,cpu_ones}.txt."""
    session.install("-e.[targets]")
    session.run("python", "-m", "runbook.site.producers.oom", *session.posargs, env=CPU_ONLY)


@nox.session(default=False, name="timeline-check")
def timeline_check(session: nox.Session) -> None:
    """runbook.timeline's peak against a real run's, on this machine's CPU, for every
    variant of the single-device compile-time cases: docs/_data/timeline/cpu.json."""
    session.install("-e.")
    session.run(
        "python", "-m", "runbook.site.producers.timeline_check", *session.posargs, env=CPU_ONLY
    )


@nox.session(default=False, name="real-corpus")
@nox.parametrize(("python", "release"), [ENDS["oldest"], ENDS["newest"]], ids=["oldest", "newest"])
def real_corpus(session: nox.Session, release: str) -> None:
    """Diagnose the real-program corpus at its authors' scale on CPU and for the H100 and
    v5e targets, with each program's fixes measured, at one end of the tested releases
    (`nox -s "real-corpus(newest)"`): docs/_data/corpus/real.json, one row per program,
    target and release. Options after --: --targets, --programs, --diagnose-only, --fixes (see the
    module's help); --watch instead runs the single-device programs' training loops under
    runbook.watch: docs/_data/corpus/watched.json."""
    session.install(
        "-e.[targets]", f"jax=={release}", f"jaxlib=={release}", "equinox", "flax"
    )  # fmt: skip
    session.run(
        "python", "-m", "runbook.site.producers.real_corpus", *session.posargs, env=CPU_ONLY
    )


@nox.session(default=False, venv_backend="none")
def gpu(session: nox.Session) -> None:
    """Real peaks on this machine's GPU, with the Python on PATH (a CUDA build of JAX).

    Writes docs/_data/gpu/<device-kind>.json. Needs no network: nothing is installed.
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    session.run(
        "python", "-m", "runbook.site.producers.gpu", "--out-dir", str(ROOT / "docs" / "_data" / "gpu"),
        *session.posargs, env={"PYTHONPATH": path},
    )  # fmt: skip


@nox.session(name="gpu-corpus", default=False, venv_backend="none")
def gpu_corpus(session: nox.Session) -> None:
    """The real-program corpus's peaks on this machine's GPU, with the Python on PATH (a CUDA
    build of JAX, with flax, equinox and optax). Writes docs/_data/corpus/gpu-<device-kind>.json."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    session.run(
        "python", "-m", "runbook.site.corpus.real._peaks", *session.posargs, env={"PYTHONPATH": path}
    )  # fmt: skip


if __name__ == "__main__":
    nox.main()
