"""The hosted-build rehearsal's memory figure: a process tree's summed memory, sampled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_tools"))

from tree_memory import Peak, page_of, sample, watching

HOLD = 256 * 2**20
# A parent that starts a child holding HOLD bytes of its own pages, then waits for it.
CHILD = f"b = bytearray({HOLD}); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(30)"
PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {CHILD!r}])"


def test_the_peak_counts_the_memory_a_grandchild_holds():
    env = {**os.environ, "RUNBOOK_PAGE": "cases/some-page"}  # what the docs extension sets
    with subprocess.Popen([sys.executable, "-c", PARENT], env=env) as proc:
        peak = Peak()
        try:
            with watching(proc.pid, peak, every=0.2):
                deadline = time.monotonic() + 20
                while peak.pss < HOLD and time.monotonic() < deadline:
                    time.sleep(0.2)
            pss, rss, largest = sample(proc.pid)
        finally:
            proc.kill()
            subprocess.run(["pkill", "-f", "b = bytearray"], check=False)
    assert HOLD <= peak.pss < 2 * HOLD + 200 * 2**20
    assert HOLD <= largest <= pss <= rss
    assert "GiB summed proportional set size" in str(peak)
    # The page the processes work for holds what they hold, by the variable they inherited.
    assert set(peak.by_page) == {"cases/some-page"}
    assert HOLD <= peak.by_page["cases/some-page"] <= peak.pss
    assert "cases/some-page" in str(peak)
    # And ran from the first sample that saw it to the last.
    first, last = peak.spans["cases/some-page"]
    assert 0 <= last - first < 30
    assert "the longest pages ran, in seconds: cases/some-page" in str(peak)


def test_a_process_that_has_gone_holds_nothing():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    assert sample(done.pid) == (0, 0, 0)


# A page's kernel that starts a child burning CPU_SECONDS of CPU, waits for it, then idles.
CPU_SECONDS = 1.5
BURN = (
    f"import time; end = time.process_time() + {CPU_SECONDS}\nwhile time.process_time() < end: pass"
)
KERNEL = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {BURN!r}]); time.sleep(30)"


def test_a_pages_cpu_counts_a_child_it_has_reaped_and_the_build_counts_the_page():
    # The build's root is a shell that is no page's, as Sphinx is; the kernel below it is.
    env = {**os.environ, "RUNBOOK_PAGE": "cases/busy-page"}
    with subprocess.Popen([sys.executable, "-c", KERNEL], env=env) as proc:
        peak = Peak()
        try:
            with watching(os.getpid(), peak, every=0.2):
                deadline = time.monotonic() + 20
                while (
                    peak.cpu.get("cases/busy-page", 0) < CPU_SECONDS and time.monotonic() < deadline
                ):
                    time.sleep(0.2)
                time.sleep(0.5)  # samples after the child has gone: its time is its parent's
        finally:
            proc.kill()
    # Once, not twice: the child's seconds, seen live and then in its parent's reaped time.
    assert CPU_SECONDS <= peak.cpu["cases/busy-page"] < CPU_SECONDS + 1.0
    assert peak.cpu_total >= peak.cpu["cases/busy-page"]
    assert "the pages that used the most CPU, in seconds: cases/busy-page" in str(peak)


def test_a_pre_pass_worker_is_told_from_a_page_kernel_of_a_build_with_the_pre_pass_on():
    # The build's switch (RUNBOOK_PREPARE=1) reaches every process, the pages' kernels too;
    # only the pre-pass's own workers say so (docs/_ext/runbook_prepare.py's WORKER).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "_ext"))
    import runbook_prepare

    labels = {}
    for value in ("1", runbook_prepare.WORKER):
        env = {**os.environ, "RUNBOOK_PAGE": "cases/a-page", "RUNBOOK_PREPARE": value}
        with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env) as p:
            try:
                # Until the child has exec'd, /proc may show the parent's environment.
                deadline = time.monotonic() + 20
                while (label := page_of(p.pid)) is None and time.monotonic() < deadline:
                    time.sleep(0.05)
                labels[value] = label
            finally:
                p.kill()
    assert labels == {"1": "cases/a-page", runbook_prepare.WORKER: "cases/a-page (pre-pass)"}
