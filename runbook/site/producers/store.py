"""Make docs/_store/: every program the site compiles for a GPU or TPU target, as measured.

    nox -s store    (python -m runbook.site.producers.store [--out DIR] [--no-build])

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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ... import _cache

ROOT = pathlib.Path(__file__).resolve().parents[3]
OUT = ROOT / "docs" / "_store"
CACHE = ROOT / "docs" / "_build" / "runbook-cache"
COMMAND = "nox -s store"


def header() -> dict[str, Any]:
    """What every entry of a store file was made with."""
    return {
        "core": _cache.core_hash(),
        "versions": _cache._versions(),
        "made_by": COMMAND,
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


def write(entries: Mapping[str, Mapping[str, Any]], out: pathlib.Path) -> dict[str, int]:
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
    top = header()
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument("--cache", type=pathlib.Path, default=CACHE)
    parser.add_argument("--no-build", action="store_true",
                        help="write from the entries the last build logged")  # fmt: skip
    args = parser.parse_args(argv)
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
