"""Make docs/_store/: every program the site compiles for a GPU or TPU target, as measured.

    nox -s store    (python -m runbook.site.producers.store [--out DIR] [--no-build])
    nox -s "store_tests(oldest)"   (... --tests [pytest options]: the test suite's, below)

builds the site into a fresh folder (every page executes; the measurement cache in
``docs/_build/runbook-cache`` and the current store answer what they hold), then writes each
compile-only entry the build used to ``<target>.jsonl``: a header line (the measurement
core's hash, the jax, jaxlib and compiler-plugin versions, the date, this command), then one
line per entry, sorted by key. A compile for a target runs the target's own XLA compiler
and no device, so its result is the same on every machine with the same sources, compilers
and settings, which its key hashes (`runbook._cache.store_key`). The hosted build reads these
lines instead of compiling again; it compiles what the store lacks.

Run it after changing the measurement core or a case, and commit ``docs/_store``: the tests
fail while the store is older than the code (``tests/test_store.py``).

``--tests`` does the same for the test suite at the JAX release installed: it runs the
suite with this module as a pytest plugin, which writes down every compile-only entry a
test asks for (`collecting`), into ``tests/_store/jax-<release>/<target>.jsonl``; the
suite reads it there (``tests/conftest.py``). Each tested end has its own, since the
compilers' versions are in every key.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ... import _cache

ROOT = pathlib.Path(__file__).resolve().parents[3]
OUT = ROOT / "docs" / "_store"
CACHE = ROOT / "docs" / "_build" / "runbook-cache"
COMMAND = "nox -s store"
TESTS = ROOT / "tests" / "_store"
# Where the plugin (`pytest_configure`) writes what the tests asked for: a file per process.
COLLECT_VAR = "RUNBOOK_STORE_COLLECT"
PLUGIN = "runbook.site.producers.store"  # this module, which runs as __main__ here


def tests_store(release: str) -> pathlib.Path:
    """The test suite's store for a JAX release."""
    return TESTS / f"jax-{release}"


def tests_command(release: str) -> str | None:
    """The session that makes the suite's store for `release`, None for a release that is
    neither tested end."""
    from ..._releases import TESTED

    ends = [end for end, (_, tested) in TESTED.items() if tested == release]
    return f'nox -s "store_tests({ends[0]})"' if ends else None


def header(command: str = COMMAND) -> dict[str, Any]:
    """What every entry of a store file was made with."""
    return {
        "core": _cache.core_hash(),
        "versions": _cache._versions(),
        "made_by": command,
        "date": datetime.date.today().isoformat(),
    }


def _records(cache: pathlib.Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The cache's compile-only entries made with today's measurement core, by store key
    (which hashes the rest: recorded by the process that made each, a child with its own
    XLA flags included)."""
    core = _cache.core_hash()
    for path in cache.glob("*/*.json"):
        record = json.loads(path.read_text())
        if record.get("store_key") and record.get("core") == core:
            yield record["store_key"], record


def _stored(folder: pathlib.Path) -> Iterator[dict[str, Any]]:
    """The entries of the store at `folder` made with this measurement core (the rest of
    what they depend on is in their keys, which the build's log matches)."""
    for line in _cache._store(folder).values():
        yield json.loads(line)


def collect(cache: pathlib.Path, store: pathlib.Path) -> tuple[dict[str, dict[str, Any]], Any]:
    """The compile-only entries the last build used, by store key, and a count of where each
    came from (`runbook._cache.MADE`, `CACHED`, `STORED`; "missing": found in neither)."""
    found: dict[str, dict[str, Any]] = {}
    for entry in _stored(store):
        found[entry["key"]] = entry
    for digest, record in _records(cache):
        found[digest] = record
    used: dict[str, str] = {}
    log = cache / _cache.USED
    for line in log.read_text().splitlines() if log.exists() else []:
        digest, _, source = line.partition("\t")
        used.setdefault(digest, source)
    counts = collections.Counter(s if d in found else "missing" for d, s in used.items())
    return {d: found[d] for d in sorted(used) if d in found}, counts


def write(
    entries: Mapping[str, Mapping[str, Any]], out: pathlib.Path, command: str = COMMAND
) -> dict[str, int]:
    """One file per target; a file whose entries did not change keeps its header (its date)."""
    by_target: dict[str, list[str]] = collections.defaultdict(list)
    for digest, entry in entries.items():
        module = entry["module"]
        line = {"key": digest, "module": module, "request": entry["request"],
                "source": _cache.module_hash(module) if module else None,
                "value": entry["value"]}  # fmt: skip
        by_target[entry["request"]["target"]].append(json.dumps(line, sort_keys=True))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.jsonl"):
        if stale.stem not in by_target:
            stale.unlink()
    top = header(command)
    for target, lines in by_target.items():
        path = out / f"{target}.jsonl"
        body = "".join(f"{line}\n" for line in lines)
        if path.exists():
            first, _, old = path.read_text().partition("\n")
            if old == body and {**json.loads(first), "date": top["date"]} == top:
                continue
        path.write_text(json.dumps(top, sort_keys=True) + "\n" + body)
    return {t: len(lines) for t, lines in sorted(by_target.items())}


def build(cache: pathlib.Path, store: pathlib.Path) -> None:
    """Build the site into a fresh folder, so that every page executes, using `cache` and
    `store` (the build empties its log of the entries used first)."""
    html = ROOT / "docs" / "_build" / "store-html"
    shutil.rmtree(html, ignore_errors=True)
    env = {**os.environ, _cache.ENV_VAR: str(cache), _cache.STORE_VAR: str(store)}
    script = str(ROOT / "docs" / "_tools" / "build_site.py")
    subprocess.run([sys.executable, script, str(html)], cwd=ROOT, env=env, check=True)
    shutil.rmtree(html, ignore_errors=True)


def collecting(cached: Callable[..., Any], folder: pathlib.Path) -> Callable[..., Any]:
    """`runbook._cache.cached`, also writing each compile-only entry asked for (computed, or
    read from a store) to a file of this process's in `folder`. Only what the package asks
    for, and not while a test has set another store: tests of the cache and the store make
    up requests, values and measurement cores."""
    store = os.environ.get(_cache.STORE_VAR)

    def asked(request: Mapping[str, Any], compute: Callable[[], Any], **kw: Any) -> Any:
        value = cached(request, compute, **kw)
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if (
            _cache.compile_only(request)
            and caller.startswith("runbook.")
            and os.environ.get(_cache.STORE_VAR) == store
        ):
            module = kw.get("module")
            line = {"store_key": _cache.store_key(request, module=module), "module": module,
                    "request": request, "value": value}  # fmt: skip
            with (folder / f"{os.getpid()}.jsonl").open("a") as f:
                f.write(json.dumps(line, default=str) + "\n")
        return value

    return asked


def pytest_configure(config: Any) -> None:
    """As a pytest plugin (``-p runbook.site.producers.store``), in every worker: collect."""
    folder = os.environ.get(COLLECT_VAR)
    if folder:
        _cache.cached = collecting(_cache.cached, pathlib.Path(folder))


def _current(entry: Mapping[str, Any]) -> bool:
    """Whether an entry is still one today's code would ask for: its case module unchanged,
    and a diagnosis for a target made by today's detectors (their hash is in its request)."""
    detectors = entry["request"].get("detectors")
    if detectors is not None and detectors != _cache.detectors_hash():
        return False
    return not entry["module"] or entry["source"] == _cache.module_hash(entry["module"])


def from_tests(pytest_args: Sequence[str], out: pathlib.Path, release: str) -> int:
    """Run the test suite here (JAX `release`), reading `out` and collecting; write `out`
    from what the tests asked for. Returns pytest's exit code."""
    command = tests_command(release) or f"{COMMAND} -- --tests"
    with tempfile.TemporaryDirectory(prefix="runbook-collect-") as folder:
        env = {**os.environ, COLLECT_VAR: folder, _cache.STORE_VAR: str(out)}
        env.pop(_cache.ENV_VAR, None)
        argv = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-n", "auto", "--dist",
                "worksteal", "-q", *pytest_args]  # fmt: skip
        code = subprocess.run(argv, cwd=ROOT, env=env, check=False).returncode
        # What earlier runs wrote that is still valid (today's core, its module unchanged):
        # a run of part of the suite keeps the rest's.
        entries = {e["key"]: e for e in _stored(out) if _current(e)}
        for path in pathlib.Path(folder).glob("*.jsonl"):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                entries[entry["store_key"]] = entry
    written = write(dict(sorted(entries.items())), out, command)
    print(f"store: {sum(written.values())} entries the tests asked for in {out}: "
          + ", ".join(f"{t} {n}" for t, n in written.items())
          + f"; pytest exited {code}", flush=True)  # fmt: skip
    return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--cache", type=pathlib.Path, default=CACHE)
    parser.add_argument("--no-build", action="store_true",
                        help="write from the entries the last build logged")  # fmt: skip
    parser.add_argument("--tests", action="store_true",
                        help="the test suite's store, at the JAX release installed")  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    if args.tests:
        import jax  # the release whose compilers the entries come from

        release = jax.__version__
        return from_tests(rest, args.out or tests_store(release), release)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.out = args.out or OUT
    if not args.no_build:
        build(args.cache, args.out)
    entries, counts = collect(args.cache, args.out)
    written = write(entries, args.out)
    print(f"store: {sum(written.values())} entries, "
          + ", ".join(f"{t} {n}" for t, n in written.items()) + "; the build "
          + ", ".join(f"{s} {n}" for s, n in sorted(counts.items())), flush=True)  # fmt: skip
    if counts.get("missing"):
        print(f"store: {counts['missing']} entries the build used are in neither the cache "
              "nor the store; the hosted build compiles them")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
