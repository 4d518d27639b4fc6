"""The benchmark ``nox -s bench`` runs: how long measuring takes, what it adds to a bare
compile, what each fix costs at run time, and how long the site takes to build.

    python -m runbook.site.producers.bench --out docs/_data/bench/bench.json [--docs] [--case NAME]

Every ratio is measured side by side in the one run: both sides on the same machine, in
the same minutes. Nothing here is cached: the measurement cache is switched off.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ... import __version__, _provenance, _subprocess
from ..._case import case_names, get_case, measure_case
from ..._diagnose import diagnose
from ..._errors import RunbookError
from ..._measure import compile_fn, measure
from ..._provenance import Provenance
from ..._runtime import runtime_peak
from ..._targets import targets, unavailable
from . import matrix as _matrix

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case_seconds(names: Sequence[str], progress: Callable[[str], None]) -> dict[str, Any]:
    """Seconds to measure each case at seed scale, on this backend and on each target."""
    out: dict[str, Any] = {}
    wheres = [None, *(t.name for t in targets() if unavailable(t) is None)]
    for name in names:
        out[name] = {}
        for where in wheres:
            seconds = _seconds(functools.partial(measure_case, name, "seed", target=where))
            out[name][where or "cpu"] = round(seconds, 3)
            progress(f"measure {name} on {where or 'cpu'}: {out[name][where or 'cpu']} s")
    return out


def _cold(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` after JAX's in-memory caches are emptied (outside the timing): a second
    ``lower().compile()`` of one program is otherwise a cache hit, not a compile."""

    def timed() -> float:
        jax.clear_caches()
        return _seconds(fn)

    return timed


def measure_overhead(names: Sequence[str], progress: Callable[[str], None]) -> dict[str, Any]:
    """`measure`'s and `diagnose`'s time against a bare ``jax.jit(f).lower(...).compile()``
    of the same program (the reproduction at seed scale), interleaved, best of three each,
    every one a real compile (JAX's caches emptied before each)."""
    out = {}
    for name in names:
        case = get_case(name)
        if case.devices > 1:  # needs forced host devices: its own process
            continue
        v = next(v for v in case.variants if v.role == "reproduction")
        size = case.scale("seed")
        params = case.grid(size)[0]
        args = case.inputs(v, size, params, False)
        options = case.options()
        program = v.program(params)
        plain_measure = functools.partial(measure, program, *args, compiler_options=options)
        timers = {
            "bare_compile": _cold(
                functools.partial(compile_fn, program, *args, compiler_options=options)
            ),
            "measure": _cold(plain_measure),
            "measure_buffers": _cold(functools.partial(plain_measure, buffers=True)),
            "diagnose": _cold(functools.partial(diagnose, program, *args)),
        }
        seconds: dict[str, list[float]] = {k: [] for k in timers}
        for _ in range(3):  # interleaved, so that the machine's load falls on all alike
            for k, timed in timers.items():
                seconds[k].append(timed())
        best = {k: min(v) for k, v in seconds.items()}
        row: dict[str, Any] = {"program": v.name}
        row |= {f"{k}_seconds": round(s, 4) for k, s in best.items()}
        out[name] = row | {
            f"{k}_ratio": round(s / best["bare_compile"], 3)
            for k, s in best.items()
            if k != "bare_compile"
        }
        progress(f"overhead {name}: {out[name]['measure_ratio']}x without buffers")
    return out


def fix_runtimes(names: Sequence[str], progress: Callable[[str], None]) -> dict[str, Any]:
    """Each variant's run time at the runnable scale, as a ratio to the reproduction's."""
    out: dict[str, Any] = {}
    for name in names:
        case = get_case(name)
        params = case.grid(case.scale(case.runnable_scale))[0]
        seconds: dict[str, float | str] = {}
        for v in case.variants:
            if not case.available(v):
                continue
            try:
                seconds[v.name] = runtime_peak(name, v.name, params=params, repeats=3).seconds
            except RunbookError as e:
                seconds[v.name] = f"failed: {_subprocess.one_line(str(e))}"
        repro = next(v.name for v in case.variants if v.role == "reproduction")
        base = seconds.get(repro)
        out[name] = {
            "scale": case.runnable_scale,
            "params": params,
            "seconds": {k: round(s, 5) if isinstance(s, float) else s for k, s in seconds.items()},
            "ratio_to_reproduction": {
                k: round(s / base, 3)
                for k, s in seconds.items()
                if isinstance(s, float) and isinstance(base, float) and base
            },
        }
        progress(f"runtimes {name}: {out[name]['ratio_to_reproduction']}")
    return out


def docs_builds(
    progress: Callable[[str], None], case_module: str
) -> tuple[dict[str, Any], dict[str, float], dict[str, float]]:
    """The site built in a copy of the repository, as `nox -s docs` builds it
    (``docs/_tools/build_site.py``, its measurement pre-pass included): cold (empty build
    folder and measurement cache), warm (nothing changed), then after a one-line edit to one
    case module. Also, for the cold build, each page's execution time and the seconds of
    the calls it declared, which the pre-pass made before the pages ran."""
    with tempfile.TemporaryDirectory(prefix="runbook-bench-") as tmp:
        copy = pathlib.Path(tmp) / "repo"
        shutil.copytree(
            ROOT, copy, ignore=shutil.ignore_patterns("_build", ".nox", ".git", "*.pyc", ".ci-venv")
        )
        env = {**os.environ, "PYTHONPATH": str(copy), "JAX_PLATFORMS": "cpu"}
        env.pop("RUNBOOK_CACHE_DIR", None)
        command = [sys.executable, "docs/_tools/build_site.py", "docs/_build/html"]
        out: dict[str, Any] = {}
        pages: dict[str, float] = {}
        prepared: dict[str, float] = {}
        for label in ("cold", "warm", "one-line edit to a case module"):
            if label.startswith("one-line"):
                module = copy / "runbook" / "cases" / case_module
                module.write_text(module.read_text() + "\n# a one-line edit\n")
            build = functools.partial(
                subprocess.run, command, cwd=copy, env=env, check=True, capture_output=True
            )
            seconds = _seconds(build)
            out[label] = round(seconds, 1)
            progress(f"docs build, {label}: {out[label]} s")
            if label == "cold":
                cache = copy / "docs" / "_build" / "runbook-cache"
                pages = _page_seconds(copy / "docs" / "_build" / "html" / ".doctrees")
                prepared = prepare_seconds(cache)
                out["profile"] = profile(cache)
        out["edited_module"] = case_module
        return out, pages, prepared


def prepare_seconds(cache: pathlib.Path) -> dict[str, float]:
    """The seconds of each page's declared calls, made by the build's pre-pass
    (``docs/_ext/runbook_prepare.py`` logs them in the cache folder), longest first."""
    import importlib

    if str(ROOT / "docs" / "_ext") not in sys.path:  # where it imports the docs extension from
        sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    found: dict[str, float] = collections.defaultdict(float)
    for (page, _), seconds in (
        importlib.import_module("runbook_prepare").last_seconds(cache).items()
    ):
        found[page] += seconds
    return {k: round(v, 1) for k, v in sorted(found.items(), key=lambda kv: -kv[1])}


def _where(request: dict[str, Any]) -> str:
    """What an entry compiled for: a target's name, else this machine's backend."""
    return str(request.get("target") or jax.default_backend())


def profile(cache: pathlib.Path) -> dict[str, Any]:
    """Where a cold build's seconds went, from the measurement cache it filled: each entry's
    own seconds (less the entries it computed inside) by the page that made it, by target
    and by kind of request; and the entries that more than one page used."""
    from ..._cache import HITS

    made: dict[str, tuple[str, dict[str, Any], float]] = {}
    for path in cache.glob("*/*.json"):
        record = json.loads(path.read_text())
        made[path.stem] = (
            record.get("page") or "?",
            record["request"],
            record.get("own_seconds", 0.0),
        )
    users: dict[str, set[str]] = {digest: {page} for digest, (page, _, _) in made.items()}
    hits = cache / HITS
    for line in hits.read_text().splitlines() if hits.exists() else []:
        page, _, digest = line.partition("\t")
        users.setdefault(digest, set()).add(page)

    def tally(by: Callable[[str, dict[str, Any]], str]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for page, request, seconds in made.values():
            row = out.setdefault(by(page, request), {"seconds": 0.0, "entries": 0})
            row["seconds"] += seconds
            row["entries"] += 1
        ranked = sorted(out.items(), key=lambda kv: -kv[1]["seconds"])
        return {
            k: {"seconds": round(v["seconds"], 1), "entries": int(v["entries"])} for k, v in ranked
        }

    shared = [d for d, pages in users.items() if d in made and len(pages) > 1]
    return {
        "entries": len(made),
        "seconds": round(sum(s for *_, s in made.values()), 1),
        "by_page": tally(lambda page, _: page),
        "by_target": tally(lambda _, request: _where(request)),
        "by_kind": tally(lambda _, request: f"{request.get('kind', '?')} on {_where(request)}"),
        "used_by_several_pages": {
            "entries": len(shared),
            "seconds_saved": round(sum(made[d][2] * (len(users[d]) - 1) for d in shared), 1),
            "pages": dict(
                collections.Counter(p for d in shared for p in users[d] if p != made[d][0])
            ),
        },
    }


def projection(
    builds: dict[str, Any],
    pages: dict[str, float],
    cases: int,
    to: int = 25,
    prepared: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The cold build with `to` cases, from this one's measured page times: each case page
    costs the median of today's; the pages that read every case grow in proportion; the
    rest of the build (Sphinx itself, the pages' imports) stays; pages share the cores.
    A page's cost is its execution time plus its calls that the pre-pass made (`prepared`)."""
    import statistics

    before = prepared or {}
    pages = {p: pages.get(p, 0.0) + before.get(p, 0.0) for p in {*pages, *before}}
    case_pages = [s for page, s in pages.items() if page.startswith("cases/")]
    others = sum(s for page, s in pages.items() if not page.startswith("cases/"))
    cores = os.cpu_count() or 1
    overhead = max(builds["cold"] - sum(pages.values()) / cores, 0.0)
    per_case = statistics.median(case_pages) if case_pages else 0.0
    work = sum(case_pages) + per_case * (to - cases) + others * to / cases
    return {
        "cases": to, "measured_cases": cases, "cores": cores,
        "median_case_page_seconds": round(per_case, 1),
        "seconds": round(overhead + work / cores, 1),
    }  # fmt: skip


def docs_extension() -> types.ModuleType:
    """The docs' own Sphinx extension, loaded from docs/_ext (it is not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "runbook_docs", ROOT / "docs" / "_ext" / "runbook_docs.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page_seconds(doctrees: pathlib.Path) -> dict[str, float]:
    """Each page's execution time in the build whose environment is in `doctrees`, longest
    first (the docs extension reads it to start the longest pages of a first build first)."""
    import pickle

    with (doctrees / "environment.pickle").open("rb") as f:
        found = docs_extension().page_seconds(pickle.load(f))
    return {k: round(v, 1) for k, v in sorted(found.items(), key=lambda kv: -kv[1])}


def run(
    names: Sequence[str] | None = None,
    *,
    docs: bool = False,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    os.environ.pop("RUNBOOK_CACHE_DIR", None)  # a benchmark measures the work, not the cache
    names = list(names or case_names())
    load = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews timings
    p = Provenance.current()
    data: dict[str, Any] = {
        "jax": p.jax, "jaxlib": p.jaxlib, "backend": p.backend, "device_kind": p.device_kind,
        "generated": p.date, "machine": p.machine, "host": _provenance.host(), "runbook": __version__,
        "measure_case_seconds": case_seconds(names, progress),
        "measure_overhead": measure_overhead(names, progress),
        "fix_runtimes": fix_runtimes(names, progress),
    }  # fmt: skip
    if docs:
        builds, pages, prepared = docs_builds(progress, _module_file(names[0]))
        data["docs_profile"] = builds.pop("profile")
        data["docs_build_seconds"] = builds
        data["docs_page_seconds"] = pages
        data["docs_prepare_seconds"] = prepared
        data["docs_projection"] = projection(builds, pages, len(case_names()), prepared=prepared)
    data["load_average"] = {"start": load, "end": [round(x, 2) for x in os.getloadavg()]}
    return data


def _module_file(name: str) -> str:
    from ..._case import _CASES

    return _CASES[name].rsplit(".", 1)[1] + ".py"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runbook.site.producers.bench", description=__doc__
    )
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    parser.add_argument("--docs", action="store_true", help="also time cold and warm docs builds")
    args = parser.parse_args(argv)
    try:
        data = run(args.case, docs=args.docs, progress=_stderr)
    except RunbookError as e:
        print(f"runbook: error: {e}", file=sys.stderr)
        return 2
    print(_matrix.write_json(data, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
