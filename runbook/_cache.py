"""A content-addressed store of measurements, so that pages re-measure only what changed.

Off unless ``RUNBOOK_CACHE_DIR`` names a folder (``nox -s docs`` sets it). An entry's key
hashes everything its figures depend on: the source of the measurement core and of the
case's own module, the JAX, jaxlib and compiler-plugin versions, the XLA/JAX environment,
and the request itself (case, scale, variant, grid point, target, options). Edit a case
module and only that case's entries miss; edit the core and every entry misses. Nothing is
ever invalidated in place: a changed input is a different key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
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
    """A case module, a page's own module (``runbook/site/<case>.py``, the watch page's) or
    a corpus program: each is hashed with the entries it measures, not into the core. The
    site's shared renderers (``runbook/site/_*.py``) and its producers are core."""
    parts = path.relative_to(PACKAGE).parts
    if parts[0] == "cases":
        return True
    if parts[0] != "site" or len(parts) < 2:
        return False
    return parts[1] == "corpus" or (len(parts) == 2 and not parts[1].startswith("_"))


@functools.cache
def core_hash() -> str:
    """The measurement core: every module of the package but the cases and their pages."""
    return _hash_files([p for p in PACKAGE.rglob("*.py") if not _per_case(p)])


@functools.cache
def module_hash(module: str) -> str:
    """A case module's source (``runbook.cases.gather_grad``); for a case's page module
    (``runbook.site.gather_grad``) or real run (``runbook.runs.recompilation``), its source
    and its case's, which it measures (a site module that is no case's page: its own
    source); a case's measurement setup (``runbook/cases/_setup/<case>.py``) counts with it."""
    relative = module.split(".", 1)[1].replace(".", "/") + ".py"
    paths = [PACKAGE / relative]
    case = PACKAGE / "cases" / relative.split("/")[-1]
    if relative.startswith(("site/", "runs/")) and case.exists():
        paths.append(case)
    setup = PACKAGE / "cases" / "_setup" / case.name  # the case's inputs and floor, if apart
    if case in paths and setup.exists():
        paths.append(setup)
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


def key(request: Mapping[str, Any], *, module: str | None = None) -> str:
    """The key of `request` (JSON-able), with the sources and environment it depends on."""
    own = own_env()
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(_ENV_PREFIXES) and own.get(k) != v
    }
    env.pop(ENV_VAR, None)
    payload = {
        "request": request,
        "machine": _machine(),
        "core": core_hash(),
        "module": module_hash(module) if module else None,
        "versions": _versions(),
        "env": env,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


# Per thread (pages compile for several targets in threads), for each computation under
# way: the seconds of the entries it computed inside.
_local = threading.local()


def cached(
    request: Mapping[str, Any], compute: Callable[[], Any], *, module: str | None = None
) -> Any:
    """`compute()`'s JSON-able result, stored under `request`'s key; computed once per key.

    Each entry also records the page that made it and the seconds its computation took
    itself (``own_seconds``: less the entries it computed inside); a read-back is logged
    in the folder's `HITS` file."""
    folder = directory()
    if folder is None:
        return compute()
    digest = key(request, module=module)
    path = folder / digest[:2] / f"{digest}.json"
    page = os.environ.get(PAGE_VAR)
    if path.exists():
        if page:
            with (folder / HITS).open("a") as log:  # one short append: lines never interleave
                log.write(f"{page}\t{digest}\n")
        return json.loads(path.read_text())["value"]
    inside: list[float] = _local.__dict__.setdefault("inside", [])
    inside.append(0.0)
    start = time.perf_counter()
    try:
        value = compute()
    finally:
        seconds = time.perf_counter() - start
        inner = inside.pop()
        if inside:
            inside[-1] += seconds
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"request": request, "value": value, "page": page,
              "seconds": round(seconds, 3), "own_seconds": round(seconds - inner, 3)}  # fmt: skip
    # Write then rename: pages running in parallel never read half a file.
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(record, f, default=str)
    pathlib.Path(f.name).replace(path)
    return value
