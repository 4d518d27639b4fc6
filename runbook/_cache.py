"""A content-addressed store of measurements, so that pages re-measure only what changed.

Off unless ``RUNBOOK_CACHE_DIR`` names a folder (``nox -s docs`` sets it). An entry's key
hashes everything its figures depend on: the source of the measurement core and of the
case's own module, the JAX, jaxlib and compiler-plugin versions, the XLA/JAX environment,
and the request itself (case, scale, variant, grid point, target, options). Edit a case
module and only that case's entries miss; edit the core and every entry misses. The
detectors (``runbook/detectors``) read compiled programs and never change one: they are
keyed into every entry made on this machine, and into a compile for a target only through
the case whose detector it is, so that a new or changed detector re-makes no stored compile.
Nothing is ever invalidated in place: a changed input is a different key.

A program compiled for a GPU or TPU target without its device (`compile_only`) measures the
same on every machine, so its entries are keyed without the machine, and a second, read-only
store may hold them: ``RUNBOOK_STORE_DIR`` names a folder of JSON-lines files that
`runbook.site.producers.store` (``nox -s store``) writes from a build's entries. The docs set
it to ``docs/_store``: the hosted build reads those compiles instead of repeating them. A
store file counts only while the measurement core is the one it was made with, and each of
its entries is keyed by the rest (case module, versions, environment, request), so a store
never answers for code or compilers it was not made with.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ._targets import own_env

PACKAGE = pathlib.Path(__file__).resolve().parent
ENV_VAR = "RUNBOOK_CACHE_DIR"
# The page that asks (the docs extension names it before each page executes), so that
# `nox -s bench` can tell which page made each entry and which pages used it again.
PAGE_VAR = "RUNBOOK_PAGE"
HITS = "hits.tsv"  # one line per entry read back: the page that read it, the entry's key
STORE_VAR = "RUNBOOK_STORE_DIR"
# One line per compile-only entry a build used: its store key, and whether it was computed,
# read back from this folder, or read from the store (`MADE`, `CACHED`, `STORED`).
USED = "used.tsv"
MADE, CACHED, STORED = "made", "cached", "stored"
_ENV_PREFIXES = ("XLA_", "JAX_", "TPU_", "CUDA_VISIBLE_DEVICES")
_DISTRIBUTIONS = (
    "jax",
    "jaxlib",
    "jax-cuda12-plugin",
    "libtpu",
    "nvidia-cuda-nvcc-cu12",
    "nvidia-cudnn-cu12",
)


def directory() -> pathlib.Path | None:
    """The cache folder, or None when caching is off."""
    value = os.environ.get(ENV_VAR)
    return pathlib.Path(value) if value else None


def _hash_files(paths: list[pathlib.Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _per_case(path: pathlib.Path) -> bool:
    """A case module, a page's own module (``runbook/site/<case>.py``, the watch page's), a
    corpus program or a detector: each is hashed with the entries it measures (a detector:
    `detectors_hash`), not into the core. The site's shared renderers
    (``runbook/site/_*.py``) and its producers are core."""
    parts = path.relative_to(PACKAGE).parts
    if parts[0] in ("cases", "detectors"):
        return True
    if parts[0] != "site" or len(parts) < 2:
        return False
    return parts[1] == "corpus" or (len(parts) == 2 and not parts[1].startswith("_"))


# The producers that run after a build (the store's), run builds (the benchmark's) or write
# a data file that a page only reads (the real corpus's), never inside one: editing them
# changes no stored figure.
_OUTSIDE_BUILDS = tuple(
    PACKAGE / "site" / "producers" / f for f in ("store.py", "bench.py", "real_corpus.py")
)
# What runs programs for real on this machine (real peaks, the host's memory, their turns)
# and starts the children they run in: no compile for a target executes it, nor depends on
# how its process started, so the stores do not depend on it (`run_hash`).
_RUN_ONLY = tuple(
    PACKAGE / f for f in ("_runtime.py", "_host.py", "_subprocess.py", "_forkserver.py")
)


@functools.cache
def core_hash() -> str:
    """The measurement core: every module of the package but the cases and their pages, the
    detectors (`detectors_hash`) and the real runs' own modules (`run_hash`)."""
    left_out = (*_OUTSIDE_BUILDS, *_RUN_ONLY)
    return _hash_files([p for p in PACKAGE.rglob("*.py") if not _per_case(p) and p not in left_out])


@functools.cache
def run_hash() -> str:
    """The modules that run programs for real here: keyed into every entry made on this
    machine (`key`), never into a compile for a target."""
    return _hash_files(list(_RUN_ONLY))


@functools.cache
def detectors_hash() -> str:
    """The detectors of `runbook.diagnose` (``runbook/detectors``): what a diagnosis reads a
    compiled program with. Keyed into every entry made on this machine (`_payload`)."""
    return _hash_files(list((PACKAGE / "detectors").rglob("*.py")))


@functools.cache
def module_hash(module: str) -> str:
    """A case module's source (``runbook.cases.gather_grad``); for a case's page module
    (``runbook.site.gather_grad``) or real run (``runbook.runs.recompilation``), its source
    and its case's, which it measures (a site module that is no case's page: its own
    source); a case's measurement setup (``runbook/cases/_setup/<case>.py``) and its detector
    (``runbook/detectors/<case>.py``, which its page may call) count with it."""
    relative = module.split(".", 1)[1].replace(".", "/") + ".py"
    paths = [PACKAGE / relative]
    case = PACKAGE / "cases" / relative.split("/")[-1]
    if relative.startswith(("site/", "runs/")) and case.exists():
        paths.append(case)
    setup = PACKAGE / "cases" / "_setup" / case.name  # the case's inputs and floor, if apart
    detector = PACKAGE / "detectors" / case.name
    if case in paths:
        paths += [p for p in (setup, detector) if p.exists()]
    return _hash_files(paths)


@functools.cache
def _versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {}
    for dist in _DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


@functools.cache
def _machine() -> str:
    """This machine, as far as real runs depend on it: processor, cores, OS."""
    import platform

    from ._provenance import host

    found = host()
    return f"{platform.system()} {platform.machine()}, {found['cpu']}, {found['cores']} cores"


def compile_only(request: Mapping[str, Any]) -> bool:
    """Whether `request` compiles for a GPU or TPU target without the device: its result
    depends on the compiler, not on this machine."""
    return request.get("target") not in (None, "cpu")


def _keyed_env() -> dict[str, str]:
    """The XLA/JAX settings of this process that a measurement depends on. Flags are keyed
    as XLA reads them, whitespace-separated: a child's ``XLA_FLAGS`` rebuilt without its
    device flag (``""``) keys as unset, and a flag appended after a space as one written
    alone, or the same compile would be made again under each spelling."""
    own = own_env()
    env = {}
    for k, v in sorted(os.environ.items()):
        if k == "XLA_FLAGS":
            v = " ".join(v.split())
        if k.startswith(_ENV_PREFIXES) and own.get(k) != v and (v or k != "XLA_FLAGS"):
            env[k] = v
    return env


def _payload(request: Mapping[str, Any], module: str | None) -> dict[str, Any]:
    env = _keyed_env()
    env.pop(ENV_VAR, None)
    env.pop("TPU_LIBRARY_PATH", None)  # where libtpu lies on this machine: its version is keyed
    return {
        "request": request,
        "machine": None if compile_only(request) else _machine(),
        # A diagnosis is only ever made and cached on this machine: a compile for a target
        # holds a compiled program's figures, which no detector changes.
        "detectors": None if compile_only(request) else detectors_hash(),
        "module": module_hash(module) if module else None,
        "versions": _versions(),
        "env": env,
    }


def _digest(payload: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def key(request: Mapping[str, Any], *, module: str | None = None) -> str:
    """The key of `request` (JSON-able), with the sources and environment it depends on."""
    run = None if compile_only(request) else run_hash()
    return _digest({**_payload(request, module), "core": core_hash(), "run": run})


def store_key(request: Mapping[str, Any], *, module: str | None = None) -> str:
    """`key` less the measurement core, which a store file records once for all its entries."""
    return _digest(_payload(request, module))


def store_directory() -> pathlib.Path | None:
    """The folder of stored compile-only entries, or None when there is none."""
    value = os.environ.get(STORE_VAR)
    return pathlib.Path(value) if value else None


_KEY = re.compile(r'\{"key": "([0-9a-f]{64})"')  # how each stored entry's line starts


@functools.cache
def _store(folder: pathlib.Path) -> dict[str, str]:
    """The stored entries made with this measurement core, by store key: each one's line,
    parsed only when read (the store holds thousands of programs' reports)."""
    lines: dict[str, str] = {}
    for path in sorted(folder.glob("*.jsonl")):
        with path.open() as f:
            header = json.loads(f.readline())
            if header.get("core") != core_hash():
                continue  # made by another measurement core: none of its entries count
            for line in f:
                found = _KEY.match(line)
                if found:
                    lines[found[1]] = line
    return lines


def stored(request: Mapping[str, Any], *, module: str | None = None) -> tuple[bool, Any]:
    """(True, value) when the store holds `request`'s result, else (False, None)."""
    folder = store_directory()
    if folder is None or not compile_only(request):
        return False, None
    line = _store(folder).get(store_key(request, module=module))
    return (True, json.loads(line)["value"]) if line is not None else (False, None)


def _log(folder: pathlib.Path, name: str, fields: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / name).open("a") as log:  # one short append: lines never interleave
        log.write("\t".join(fields) + "\n")


# Per thread (pages compile for several targets in threads), for each computation under
# way: the seconds of the entries it computed inside.
_local = threading.local()
# For the computation under way, the store keys of the compile-only entries it used inside:
# a context variable, so that the threads `runbook.site.parallel` starts (each in a copy of
# the context) add to their caller's list. An entry records them, and reading it back
# counts them as used again: `nox -s store` keeps every compile a build needs, even those
# inside an entry this machine had cached.
_uses: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("uses", default=None)


def cached(
    request: Mapping[str, Any], compute: Callable[[], Any], *, module: str | None = None
) -> Any:
    """`compute()`'s JSON-able result, stored under `request`'s key; computed once per key.

    Each entry also records the page that made it and the seconds its computation took
    itself (``own_seconds``: less the entries it computed inside); a read-back is logged
    in the folder's `HITS` file. A compile-only request missing here is read from the
    store (`stored`) when it holds it; each compile-only entry a build uses is logged in
    the folder's `USED` file."""
    folder = directory()
    if folder is None:
        found, value = stored(request, module=module)
        return value if found else compute()
    digest = key(request, module=module)
    path = folder / digest[:2] / f"{digest}.json"
    page = os.environ.get(PAGE_VAR)
    own = [store_key(request, module=module)] if compile_only(request) else []
    if path.exists():
        if page:
            _log(folder, HITS, [page, digest])
        record = json.loads(path.read_text())
        _used(folder, CACHED, own + record.get("uses", []))
        return record["value"]
    if own:
        found, value = stored(request, module=module)
        if found:
            _used(folder, STORED, own)
            return value
    inside: list[float] = _local.__dict__.setdefault("inside", [])
    inside.append(0.0)
    uses: list[str] = []
    token = _uses.set(uses)
    start = time.perf_counter()
    try:
        value = compute()
    finally:
        seconds = time.perf_counter() - start
        _uses.reset(token)
        inner = inside.pop()
        if inside:
            inside[-1] += seconds
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"request": request, "value": value, "page": page, "module": module,
              "seconds": round(seconds, 3), "own_seconds": round(seconds - inner, 3),
              "uses": sorted(set(uses))}  # fmt: skip
    if own:  # what `nox -s store` needs to keep it, whatever environment this process had
        record.update(store_key=own[0], core=core_hash())
    # Write then rename: pages running in parallel never read half a file.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(record, f, default=str)
    pathlib.Path(f.name).replace(path)
    _used(folder, MADE, own)
    outer = _uses.get()
    if outer is not None:
        outer.extend(uses)  # what the entry used inside, its caller used too
    return value


def _used(folder: pathlib.Path, source: str, keys: list[str]) -> None:
    """Log compile-only entries as used (`USED`), and count them in the caller's entry."""
    outer = _uses.get()
    if outer is not None:
        outer.extend(keys)
    for k in keys:
        _log(folder, USED, [k, source])
