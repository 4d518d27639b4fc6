"""The build's measurement pre-pass: the slow calls pages declare, made first, on every core.

A page lists, in its front matter, the slow calls of its own code::

    runbook:
      cases: [donation]
      prepare:
        - runbook.verify("donation")
        - runbook.site.donation.peaks()

Before Sphinx executes the pages it is about to read, the docs extension makes the calls
they declare in a pool of worker processes: each page's calls in one process, in order,
the longest pages first. Each call fills the measurement cache (``RUNBOOK_CACHE_DIR``), and
the page, making the same call, reads it back: no page spends minutes on work that the
other cores could share.

Every build runs it: ``docs/_tools/build_site.py`` (``nox -s docs``, Read the Docs) sets
``RUNBOOK_PREPARE=1``; ``RUNBOOK_PREPARE=0`` builds without it. While each measuring child
started a new Python, it made a 2-core machine's cold build slower (494 s against 404 s),
the build being CPU-bound. Measured again once children forked from a server that has
imported JAX (`runbook._forkserver`), cold ``nox -s docs`` from fresh clones of code that
differed only in how an interrupt is handled: 383.7 s with it, no page executing for
longer than 41.2 s (the diagnose page, whose case table was not cached then), against
361.3 s without it, with five pages over 60 s (diagnose 109.7 s).
``nox -s bench`` records each page's execution and pre-pass seconds.

What to declare: calls whose work the page's other cells do not repeat. Real runs (each in
a process of its own), fix checks, the diagnose corpus and the diagnose page's table of
the cases' own programs (each diagnosis cached) are. A seed-scale compile is
not: the page's later cells compile the same programs again, which in the page's kernel
JAX's own cache would have answered, so declared it is compiled twice.

A declaration is the call exactly as the page's code writes it (`unwritten` checks this),
with nothing in scope but ``runbook`` (``runbook.get_case("donation").variants`` where a
cell might say ``CASE.variants``):
a declared call the page does not make would be work for nothing, and a call the page
makes but does not declare is still made, only in the page. A call that fails here is
reported and left to the page, which fails with the whole traceback.

A page whose kernel forces host devices before JAX starts (``devices: 4`` in its
``runbook:`` block, beside the line of its code that appends `device_flags`) has its calls
made in a fresh process under the same ``XLA_FLAGS``: the variable is part of every
measurement's cache key, so a call made under another value would be one the page never
reads.
"""

from __future__ import annotations

import ast
import concurrent.futures
import contextlib
import importlib
import json
import multiprocessing
import os
import pathlib
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from runbook_docs import PREPARE_VAR, front_block  # the docs extension, beside this module

_CELL = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```", re.DOTALL | re.MULTILINE)
SECONDS = "prepare.tsv"  # in the cache folder: each call's seconds when it was last made
# What a worker sets PREPARE_VAR to: not "1", the build's switch, which every process of a
# build run with it inherits, page kernels included (docs/_tools/tree_memory.py tells them apart).
WORKER = "pre-pass"


def declared(page: pathlib.Path) -> list[str]:
    """The calls a page's front matter lists under ``runbook: prepare:``."""
    calls = front_block(page).get("prepare") or []
    if not isinstance(calls, list) or not all(isinstance(c, str) for c in calls):
        raise ValueError(f"{page}: runbook: prepare: must be a list of calls")
    return calls


def devices(page: pathlib.Path) -> int:
    """The host devices the page's kernel forces (``runbook: devices:``), else 1."""
    return int(front_block(page).get("devices", 1))


def device_flags(count: int) -> str:
    """What a page forcing `count` host devices appends to ``XLA_FLAGS``."""
    return f" --xla_force_host_platform_device_count={count}"


def _bare(text: str) -> str:
    return re.sub(r"\s+", "", text)  # a call may wrap, and be indented, anywhere


def unwritten(page: pathlib.Path) -> list[str]:
    """What the page declares and its code cells do not write out as declared: calls, and
    the line that forces its devices."""
    code = "\n".join(_bare(cell) for cell in _CELL.findall(page.read_text()))
    missing = [c for c in declared(page) if _bare(c) not in code]
    if devices(page) > 1:
        line = f'os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + "{device_flags(devices(page))}"'
        missing += [line] * (_bare(line) not in code)
    return missing


def _modules(call: str) -> list[str]:
    """Every dotted prefix of every ``runbook.`` name chain in `call` (``runbook.site.x.f``
    gives ``runbook``, ``runbook.site``, ...): the modules to import before evaluating it."""
    chains = []
    for node in ast.walk(ast.parse(call, mode="eval")):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "runbook" and parts:
            names = [node.id, *reversed(parts)]
            chains += [".".join(names[:i]) for i in range(1, len(names))]
    return list(dict.fromkeys(chains))


def run_page(page: str, calls: Sequence[str], count: int = 1) -> list[tuple[float, str | None]]:
    """Evaluate a page's `calls` in order, as the page would, with its `count` host
    devices: each one's seconds and the error it raised, else None.

    In one process, as in the page's kernel: a later call finds the programs an earlier one
    compiled in JAX's own caches, emptied once the page's calls are done."""
    if count > 1:  # before JAX starts: in a fresh process
        env = dict(os.environ)
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + device_flags(count)
        here = str(pathlib.Path(__file__).parent)
        script = (f"import sys, json; sys.path.insert(0, {here!r}); import runbook_prepare as p; "
                  f"print(json.dumps(p.run_page({page!r}, {list(calls)!r})))")  # fmt: skip
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
        )
        said = done.stdout.strip().splitlines()
        if done.returncode == 0 and said:
            return [(seconds, error) for seconds, error in json.loads(said[-1])]
        lost = f"the page's process failed: {done.stderr.strip()[-300:]}"
        return [(time.perf_counter() - start, lost)] * len(calls)
    os.environ["RUNBOOK_PAGE"] = page  # whose entries these are (runbook._cache.PAGE_VAR)
    os.environ[PREPARE_VAR] = WORKER  # and made before it ran
    out: list[tuple[float, str | None]] = []
    for call in calls:
        start = time.perf_counter()
        error = None
        try:
            for name in _modules(call):
                with contextlib.suppress(ModuleNotFoundError):  # an attribute, not a module
                    importlib.import_module(name)
            namespace = {"runbook": importlib.import_module("runbook")}
            eval(compile(call, f"<{page} prepare>", "eval"), namespace)
        except Exception as e:  # noqa: BLE001 - the page makes the call again and shows it
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out.append((time.perf_counter() - start, error))
    import jax

    jax.clear_caches()  # the next page's programs are others
    return out


def last_seconds(folder: pathlib.Path) -> dict[tuple[str, str], float]:
    """Each call's seconds when it was last made in this cache folder."""
    log = folder / SECONDS
    rows = [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []
    return {(page, call): float(seconds) for page, call, seconds in rows}


def prepare(
    calls: Iterable[tuple[str, str, int]],
    folder: pathlib.Path,
    *,
    page_seconds: Mapping[str, float] | None = None,
    workers: int | None = None,
    say: Callable[[str], None] = print,
) -> dict[tuple[str, str], float]:
    """Run each page's calls (``(page, call, devices)``, a page's in the order given) in a
    pool of `workers` processes (default: one per core), the pages expected to take longest
    first. Returns the seconds of each call, by ``(page, call)``.

    One process per core, not one more to take the turn of one waiting for a real run's
    (`runbook.runtime_peak` runs one at a time): with one more, the hosted build's
    rehearsal measured a peak of 4.27 GiB summed over its processes, over its 4 GiB."""
    known, seconds = last_seconds(folder), page_seconds or {}
    pages: dict[tuple[str, int], list[str]] = {}
    for page, call, n in calls:
        mine = pages.setdefault((page, n), [])
        if call not in mine:
            mine.append(call)

    def expected(item: tuple[tuple[str, int], list[str]]) -> float:
        (page, _), mine = item  # the calls' times when last made here, else the page's time
        if all((page, c) in known for c in mine):
            return sum(known[page, c] for c in mine)
        return seconds.get(page, 0.0)

    todo = sorted(pages.items(), key=lambda item: -expected(item))
    if not todo:
        return {}
    workers = min(workers or os.cpu_count() or 1, len(todo))
    count = sum(len(mine) for _, mine in todo)
    say(f"prepare: {count} calls that {len(todo)} pages declare, in {workers} processes")
    start = time.perf_counter()
    took: dict[tuple[str, str], float] = {}
    context = multiprocessing.get_context("spawn")  # JAX's threads do not survive a fork
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        running = {pool.submit(run_page, page, mine, n): (page, mine) for (page, n), mine in todo}
        for done in concurrent.futures.as_completed(running):
            page, mine = running[done]
            try:
                results = done.result()
            except concurrent.futures.process.BrokenProcessPool as e:  # a worker died
                results = [(0.0, f"{type(e).__name__}: {e}")] * len(mine)
            for call, (s, error) in zip(mine, results, strict=True):
                took[page, call] = s
                said = f" failed, left to the page: {error}" if error else ""
                say(f"prepare: {s:6.1f} s  {page}  {call}{said}")
    folder.mkdir(parents=True, exist_ok=True)
    rows = [f"{page}\t{call}\t{s:.1f}" for (page, call), s in {**known, **took}.items()]
    (folder / SECONDS).write_text("\n".join(rows) + "\n")
    wall = time.perf_counter() - start
    say(f"prepare: done in {wall:.1f} s ({sum(took.values()):.1f} s of calls)")
    return took
