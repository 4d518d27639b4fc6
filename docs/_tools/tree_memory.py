"""The memory and CPU time of a process and all its descendants, sampled while they run
(Linux).

Proportional set size (PSS) divides each shared page among the processes that map it, so
a sum over processes counts the machine's memory once; the resident set (RSS) counts shared
pages once per process. Read the Docs' builders limit the build's memory as a whole.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                found.setdefault(parent, []).append(int(entry.name))
    return found


def _rollup(pid: int) -> dict[str, int]:
    """Pss and Rss of `pid` in bytes (empty if it has gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    return {
        key: int(line.split()[1]) * 1024
        for line in text.splitlines()
        if (key := line.split(":")[0]) in ("Pss", "Rss")
    }


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) of `pid` and of the children it has waited for (0 if
    it has gone): a child's time moves into its parent's when the parent reaps it."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / TICK  # utime, stime, cutime, cstime


def page_of(pid: int) -> str | None:
    """The docs page a process works for: the `RUNBOOK_PAGE` its environment inherited (the
    docs extension sets it before a page's kernel starts), or None; "PAGE (pre-pass)" for
    the processes its declared calls started before the pages ran (`RUNBOOK_PREPARE` set to
    the pre-pass worker's "pre-pass", not the build's switch "1", which page kernels inherit)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = next((e for e in env if e.startswith(b"RUNBOOK_PAGE=")), None)
    page = found.split(b"=", 1)[1].decode() if found else None
    return f"{page} (pre-pass)" if page and b"RUNBOOK_PREPARE=pre-pass" in env else page


def sample(
    root: int, pages: dict[str, int] | None = None, cpu: dict[tuple[str, int], float] | None = None
) -> tuple[int, int, int]:
    """(summed PSS, summed RSS, the largest single PSS) of `root` and its descendants; into
    `pages`, the summed PSS of each page's processes in this sample; into `cpu`, keyed by
    (page, pid) for each process that starts a page's tree (a kernel, a pre-pass worker),
    the CPU seconds of that tree so far: its own, its live descendants' and what it reaped."""
    children, pss, rss, largest = _children(), 0, 0, 0
    order, todo, page = [], [root], {root: None}
    while todo:
        pid = todo.pop()
        order.append(pid)
        todo += children.get(pid, [])
        found = _rollup(pid)
        pss, rss = pss + found.get("Pss", 0), rss + found.get("Rss", 0)
        largest = max(largest, found.get("Pss", 0))
        page[pid] = page_of(pid) if pages is not None else None
        if page[pid] and pages is not None:
            pages[page[pid]] = pages.get(page[pid], 0) + found.get("Pss", 0)
    if cpu is not None:
        tree: dict[int, float] = {}
        for pid in reversed(order):  # descendants before their parents
            tree[pid] = cpu_seconds(pid) + sum(tree.get(c, 0.0) for c in children.get(pid, []))
        cpu["", root] = max(cpu.get(("", root), 0.0), tree[root])  # the whole tree
        parent = {c: p for p, cs in children.items() for c in cs}
        for pid in order:
            name = page.get(pid)
            if name and page.get(parent.get(pid, 0)) != name:
                cpu[name, pid] = max(cpu.get((name, pid), 0.0), tree[pid])
    return pss, rss, largest


class Peak:
    """The highest `sample` seen: summed PSS, with the RSS and largest process at that time;
    each page's most (`by_page`), the first and last time its processes were seen
    (`spans`, `time.monotonic()` seconds): how long its kernel ran, and the CPU seconds its
    processes used (`cpu`, to within the last sample of each)."""

    def __init__(self) -> None:
        self.pss = self.rss = self.largest = 0
        self.samples = 0
        self.by_page: dict[str, int] = {}
        self.spans: dict[str, tuple[float, float]] = {}
        self._trees: dict[tuple[str, int], float] = {}

    def see(self, root: int) -> None:
        now: dict[str, int] = {}
        pss, rss, largest = sample(root, now, self._trees)
        seen = time.monotonic()
        for page, used in now.items():
            self.by_page[page] = max(self.by_page.get(page, 0), used)
            self.spans[page] = (self.spans.get(page, (seen, seen))[0], seen)
        self.samples += 1
        if pss > self.pss:
            self.pss, self.rss, self.largest = pss, rss, largest

    @property
    def cpu(self) -> dict[str, float]:
        """CPU seconds by page, most first."""
        out: dict[str, float] = {}
        for (page, _), seconds in self._trees.items():
            if page:
                out[page] = out.get(page, 0.0) + seconds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def cpu_total(self) -> float:
        """CPU seconds of the whole tree."""
        return sum(seconds for (page, _), seconds in self._trees.items() if not page)

    def __str__(self) -> str:
        gib = 2**30
        top = sorted(self.by_page.items(), key=lambda kv: -kv[1])[:5]
        pages = ", ".join(f"{page} {used / gib:.2f}" for page, used in top)
        spans = sorted(self.spans.items(), key=lambda kv: kv[1][0] - kv[1][1])[:5]
        longest = ", ".join(f"{page} {last - first:.0f}" for page, (first, last) in spans)
        cpu = ", ".join(f"{page} {seconds:.0f}" for page, seconds in list(self.cpu.items())[:8])
        return (
            f"{self.pss / gib:.2f} GiB summed proportional set size ({self.rss / gib:.2f} GiB "
            f"summed resident set, {self.largest / gib:.2f} GiB in its largest process), "
            f"{self.samples} samples"
            + (f"; the most pages held, in GiB: {pages}" if top else "")
            + (f"; the longest pages ran, in seconds: {longest}" if spans else "")
            + (f"; {self.cpu_total:.0f} CPU-seconds in all" if self._trees else "")
            + (f"; the pages that used the most CPU, in seconds: {cpu}" if cpu else "")
        )


@contextlib.contextmanager
def watching(root: int, peak: Peak, every: float = 1.0) -> Iterator[Peak]:
    """Inside, a thread samples `root`'s tree every `every` seconds into `peak`."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(every):
            peak.see(root)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
