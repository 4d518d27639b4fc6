"""Rehearse the hosted build: run exactly what `.readthedocs.yaml` declares, and time it.

A fresh clone of the committed tree (HEAD, as Read the Docs checks out a commit), a fresh
virtual environment on the Python the file names (`build.tools.python`), then the file's
`build.jobs` commands in Read the Docs' order, each in a shell with that environment first on
PATH and `READTHEDOCS_OUTPUT` set, and the installers' caches empty. Prints each step's seconds
and the total, and fails when the total passes Read the Docs' build time limit. Also prints the
build step's peak memory, every process of it summed (proportional set size, sampled each
second), and fails above `--memory-limit` GiB (`MEMORY_LIMIT` unless told).

    nox -s rtd                      # what .ci/run runs
    nox -s rtd -- --offline-build   # the build step with no network (loopback only; root)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from tree_memory import Peak, watching

ROOT = Path(__file__).resolve().parents[2]
# Read the Docs' default build time limit on its community plan, in seconds.
LIMIT = 15 * 60
# GiB the build step may hold, every process summed: Read the Docs' community builders allow
# 7 GB (6.5 GiB) and once allowed 3 GB. The peak moves from run to run with which pages'
# kernels overlap; this line leaves room for that and fails a build that keeps what its
# processes freed again (see MALLOC in build_site.py).
MEMORY_LIMIT = 4.0
# The order Read the Docs runs a build's jobs in (`build.jobs.build` holds one per format).
JOBS = ("post_checkout", "pre_system_dependencies", "post_system_dependencies",
        "pre_create_environment", "post_create_environment", "pre_install", "install",
        "post_install", "pre_build", "build", "post_build")  # fmt: skip


def _interpreter(version: str) -> str:
    """The path of a Python `version` on this machine, as uv finds it."""
    found = subprocess.run(["uv", "python", "find", "--no-project", version],
                           capture_output=True, text=True, check=False)  # fmt: skip
    if found.returncode != 0:
        sys.exit(f"rehearse: no Python {version} on this machine (the file's build.tools.python)")
    return found.stdout.strip()


def _commands(config: dict) -> list[tuple[str, str]]:
    jobs = config.get("build", {}).get("jobs", {})
    steps = []
    for job in JOBS:
        found = jobs.get(job) or []
        if job == "build":  # one list per output format; html is the one we host
            found = found.get("html", [])
        steps += [(job, command) for command in found]
    return steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offline-build", action="store_true",
                        help="run the build step in a network namespace with loopback only")  # fmt: skip
    parser.add_argument("--limit", type=float, default=LIMIT, help="seconds allowed in all")
    parser.add_argument("--memory-limit", type=float, default=MEMORY_LIMIT,
                        help="GiB the build step may hold at its peak")  # fmt: skip
    parser.add_argument("--keep-cache", type=Path, default=None,
                        help="copy the build's measurement cache here, for `bench.profile`")  # fmt: skip
    parser.add_argument("--keep-html", type=Path, default=None,
                        help="copy the built site here, to compare it with another build")  # fmt: skip
    args = parser.parse_args(argv)
    config = yaml.safe_load((ROOT / ".readthedocs.yaml").read_text())
    python = _interpreter(str(config["build"]["tools"]["python"]))
    work = Path(tempfile.mkdtemp(prefix="rtd-"))
    checkout, venv, output = work / "checkout", work / "venv", work / "_readthedocs"
    times: list[tuple[str, float]] = []
    peak = Peak()
    start = time.perf_counter()
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True)
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        times.append(("checkout and create_environment", time.perf_counter() - start))
        env = {k: v for k, v in os.environ.items()
               if k not in ("VIRTUAL_ENV", "JAX_PLATFORMS", "UV_COMPILE_BYTECODE")}  # fmt: skip
        env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", READTHEDOCS="True",
                   READTHEDOCS_OUTPUT=str(output))  # fmt: skip
        # A builder starts with empty caches: the installers' caches here would time an
        # install from this machine's earlier downloads.
        env.update(PIP_CACHE_DIR=str(work / "pip-cache"), UV_CACHE_DIR=str(work / "uv-cache"))
        for job, command in _commands(config):
            print(f"rehearse: [{job}] {command}", flush=True)
            if job == "build" and args.offline_build:
                command = f"ip link set lo up && {command}"
                run = ["unshare", "--net", "bash", "-ec", command]
            else:
                run = ["bash", "-ec", command]
            began = time.perf_counter()
            with subprocess.Popen(run, cwd=checkout, env=env) as proc:
                if job == "build":
                    with watching(proc.pid, peak):
                        proc.wait()
            if proc.wait():
                raise subprocess.CalledProcessError(proc.returncode, run)
            times.append((f"{job}: {command[:60]}", time.perf_counter() - began))
        total = time.perf_counter() - start
        if not (output / "html" / "index.html").exists():
            sys.exit("rehearse: the build wrote no $READTHEDOCS_OUTPUT/html/index.html")
        cache = checkout / "docs" / "_build" / "runbook-cache"
        if args.keep_cache is not None and cache.exists():
            shutil.copytree(cache, args.keep_cache, dirs_exist_ok=True)
        if args.keep_html is not None:
            shutil.copytree(output / "html", args.keep_html, dirs_exist_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for step, seconds in times:
        print(f"rehearse: {seconds:7.1f} s  {step}")
    print(f"rehearse: {total:7.1f} s  in all (limit {args.limit:.0f} s), Python {python}")
    print(f"rehearse: build step's peak memory {peak}")
    if total > args.limit:
        print("rehearse: over the hosted build's time limit", file=sys.stderr)
        return 1
    if peak.pss > args.memory_limit * 2**30:
        print(f"rehearse: over {args.memory_limit} GiB of memory at the peak", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
