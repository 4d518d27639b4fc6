"""Build the site as every build does (`nox -s docs`, Read the Docs): Sphinx, run again once
only if a page's kernel could not bind its port, or died.

    python docs/_tools/build_site.py OUTPUT_DIR

Each page executes in a Jupyter kernel, whose TCP ports jupyter_client picks free and then
releases for the kernel to bind. In a parallel build another kernel, starting at the same
moment, can take one in between (jupyter/jupyter_client#487): the kernel dies at start with
"Address already in use" and the build fails, though nothing was measured wrong. That
failure, and no other, is built again once; what the first attempt measured is in the
build's measurement cache and is not measured again.

A kernel that dies while a page runs (nbclient's "Kernel died") is built again once too,
after the build shows what is known of the death: the last words it wrote inside a capture
of its C++ log (`runbook._quiet` keeps those in `STDERR_DIR` while a capture is open;
otherwise they would die with it), and how much memory the machine had left. A page that
kills its kernel every time fails the second build the same way.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPHINX = ["-m", "sphinx", "-j", "auto", "-n", "-T", "-W", "--keep-going", "-b", "html", "docs"]
# What a build prints when a page's kernel is lost: at start, to a port race; later, dead.
PORT_TAKEN = "zmq.error.ZMQError: Address already in use"
KERNEL_DIED = "DeadKernelError: Kernel died"
STDERR_DIR = ROOT / "docs" / "_build" / "stderr"  # runbook._quiet.KEEP_VAR points here
# Where docs/conf.py keeps the measurement cache unless RUNBOOK_CACHE_DIR says otherwise.
CACHE = Path(os.environ.get("RUNBOOK_CACHE_DIR") or ROOT / "docs" / "_build" / "runbook-cache")
USED = "used.tsv"  # runbook._cache.USED: each compile for a target the build used, and whence
# glibc's malloc keeps much of what a process frees: an arena per thread (XLA runs many), and
# once a large block has been freed it serves later large blocks from the heap, which is
# seldom handed back. With these, blocks of 128 KiB or more are mapped and unmapped as they
# come and go: the build holds what its processes use, not what they once used. Its peak,
# every process summed, is what Read the Docs limits (`nox -s rtd` measures it). The
# children that measure a CPU run-time peak set their own 1 MiB threshold, in a build or
# not (`runbook._subprocess.child_env`).
MALLOC = {
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(128 * 1024),
}


# The measurement pre-pass (docs/_ext/runbook_prepare.py): the slow calls pages declare,
# made first in a process per core. RUNBOOK_PREPARE=0 builds without it.
PREPARE = {"RUNBOOK_PREPARE": "1"}


def build(output: str) -> tuple[int, str | None]:
    """Run Sphinx once, passing its output on: (exit status, the kernel loss it printed)."""
    lost = None
    shutil.rmtree(STDERR_DIR, ignore_errors=True)
    with subprocess.Popen(
        [sys.executable, *SPHINX, output],
        cwd=ROOT,
        env={**MALLOC, **PREPARE, **os.environ, "RUNBOOK_STDERR_DIR": str(STDERR_DIR)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            lost = lost or next((s for s in (PORT_TAKEN, KERNEL_DIED) if s in line), None)
    return proc.returncode, lost


def last_words() -> str:
    """What processes that died inside a capture of their C++ log had written there."""
    found = []
    for path in sorted(STDERR_DIR.glob("stderr-*.log")):
        lines = path.read_text(errors="replace").strip().splitlines()[-20:]
        found.append(f"--- {path.name} (pid {path.name.split('-')[1]}), its last lines:")
        found.extend(lines or ["(nothing written)"])
    return "\n".join(found) if found else "no process died inside a capture of its C++ log"


def memory_left() -> str:
    """The machine's memory now, from /proc/meminfo (Linux), in GiB."""
    try:
        info = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return "memory unknown"
    gib = {k: int(info[k].split()[0]) / 2**20 for k in ("MemTotal", "MemAvailable") if k in info}
    return ", ".join(f"{k} {v:.1f} GiB" for k, v in gib.items())


def target_compiles() -> str:
    """Where the build's compiles for GPU and TPU targets came from (docs/_store, this
    machine's cache, or compiled now), from the log the measurement cache keeps."""
    log = CACHE / USED
    lines = log.read_text().splitlines() if log.exists() else []
    first = dict(reversed([line.split("\t")[:2] for line in lines if "\t" in line]))
    counts = collections.Counter(first.values())  # each entry counted where it came from first
    return (f"build_site: compiles for GPU and TPU targets: {counts['stored']} read from "
            f"docs/_store, {counts['cached']} from this machine's cache, {counts['made']} "
            "compiled now")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit(__doc__)
    output = str(Path(args[0]).resolve())  # Sphinx runs from the repository's root
    (CACHE / USED).unlink(missing_ok=True)  # this build's log only (`nox -s store` reads it)
    status, lost = build(output)
    if status and lost == PORT_TAKEN:
        print("build_site: a page's kernel found its port taken at start "
              "(jupyter/jupyter_client#487); building again", flush=True)  # fmt: skip
        status, lost = build(output)
    elif status and lost == KERNEL_DIED:
        print(f"build_site: a page's kernel died ({memory_left()}); "
              f"{last_words()}\nbuilding again", flush=True)  # fmt: skip
        status, lost = build(output)
    if status and lost == KERNEL_DIED:
        print(f"build_site: a kernel died again ({memory_left()}); {last_words()}", flush=True)
    print(target_compiles(), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
