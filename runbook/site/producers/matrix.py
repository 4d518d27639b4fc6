"""The version matrix: every case's programs compiled in one JAX release, each in its own process.

``nox -s versions`` makes an environment per release and runs, inside it::

    python -m runbook.site.producers.matrix --out docs/_data/versions/0.4.30.json

A program that cannot be measured there is recorded, not raised: ``not applicable`` (this
JAX lacks an API the variant needs), ``failed`` (tracing or XLA rejected it; the reason is
kept), ``timeout`` (its compile ran past the limit and was killed: some releases take many
minutes on an unrolled loop) or ``not attempted`` (an earlier, smaller point of the same
variant timed out, so this one would too).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ... import __version__, _subprocess
from ..._case import case_names, get_case
from ..._case_types import Case, Variant
from ..._errors import DoesNotFitError, RunbookError
from ..._measure import measure
from ..._provenance import Provenance, host
from ..._subprocess import failure, one_line
from .._page import page_module

STATUSES = ("ok", "not applicable", "does not fit", "failed", "timeout", "not attempted")
# Seconds one program may take to compile (process start and JAX import included).
TIME_LIMIT = 240.0
# Seconds one case's claims may take to decide (they measure the case and more).
CLAIMS_TIME_LIMIT = 900.0


def _measure_point(
    name: str, variant: str, scale: str, params: dict[str, Any], target: str | None = None
) -> dict[str, Any]:
    """In the child: compile one program, return its CLI-shaped entry or the failure."""
    from ... import _targets

    case = get_case(name)
    v = case.variant(variant)
    size = case.scale(scale)
    t = _targets.get_target(target) if target else None  # required only where it compiles
    provenance = dataclasses.asdict(
        Provenance.for_target(t, case.devices) if t else Provenance.current()
    )
    try:
        with _targets.compiling_for(t):
            args = case.inputs(v, size, params, False)
            options = case.options() if t is None else {}
            report = measure(
                v.program(params), *args, name=v.name, compiler_options=options, target=t
            )
    except DoesNotFitError as e:
        return {"status": "does not fit", "reason": one_line(str(e)), "needed": e.needed,
                "limit": e.limit, "provenance": provenance}  # fmt: skip
    except Exception as e:  # noqa: BLE001 (any rejection by this release is data, not a crash)
        reason = f"{type(e).__name__}: {e}" if not isinstance(e, RunbookError) else str(e)
        return {"status": "failed", "reason": one_line(reason), "provenance": provenance}
    floor = case.floor_bytes(v, size, params, report.provenance.backend)
    report = dataclasses.replace(report, role=v.role, params=params, floor=floor)
    return {"status": "ok", "entry": report.to_json(), "provenance": provenance}


def _unmeasured(
    v: Variant, params: dict[str, Any], status: str, reason: str, seconds: float | None = None
) -> dict[str, Any]:
    return {"name": v.name, "role": v.role, "params": params, "status": status,
            "reason": reason, "seconds": seconds}  # fmt: skip


def measure_point(
    case: Case,
    variant: Variant,
    scale: str,
    params: dict[str, Any],
    *,
    time_limit: float,
    target: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Compile one program in a fresh process; return (entry, the child's provenance or None).

    The entry is the CLI's variant object plus ``"status": "ok"``, or an unmeasured entry
    with the status and the reason.
    """
    start = time.perf_counter()
    try:
        reply = _subprocess.call(
            "runbook.site.producers.matrix:_measure_point", devices=1 if target else case.devices,
            timeout=time_limit, name=case.name, variant=variant.name, scale=scale,
            params=params, target=target,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        reason = f"did not compile within the {time_limit:g} s limit"
        return _unmeasured(variant, params, "timeout", reason, round(time_limit, 3)), None
    except RunbookError as e:  # the child died (a crash, out of memory): its last words
        seconds = round(time.perf_counter() - start, 3)
        return _unmeasured(variant, params, "failed", failure(e), seconds), None
    if reply["status"] == "ok":
        return {**reply["entry"], "status": "ok"}, reply["provenance"]
    seconds = round(time.perf_counter() - start, 3)
    entry = _unmeasured(variant, params, reply["status"], reply["reason"], seconds)
    if reply["status"] == "does not fit":
        entry.update(needed=reply["needed"], limit=reply["limit"])
    return entry, reply["provenance"]


def _measure_points(
    name: str, variant: str, scale: str, grid: list[dict[str, Any]], target: str | None = None
) -> list[dict[str, Any]]:
    """In the child: `_measure_point` for every point of `grid`."""
    return [_measure_point(name, variant, scale, params, target) for params in grid]


def measure_points(
    case: Case,
    variant: Variant,
    scale: str,
    grid: list[dict[str, Any]],
    *,
    time_limit: float,
    target: str | None = None,
) -> list[tuple[dict[str, Any], dict[str, Any] | None]] | None:
    """Every point of one variant in one fresh process; None if it ran out of time or died
    (the caller then measures each point alone, to tell which)."""
    start = time.perf_counter()
    try:
        replies = _subprocess.call(
            "runbook.site.producers.matrix:_measure_points", devices=1 if target else case.devices,
            timeout=time_limit * len(grid), name=case.name, variant=variant.name, scale=scale,
            grid=grid, target=target,
        )  # fmt: skip
    except (subprocess.TimeoutExpired, RunbookError):
        return None
    seconds = round((time.perf_counter() - start) / len(grid), 3)
    out = []
    for params, reply in zip(grid, replies, strict=True):
        if reply["status"] == "ok":
            out.append(({**reply["entry"], "status": "ok"}, reply["provenance"]))
            continue
        entry = _unmeasured(variant, params, reply["status"], reply["reason"], seconds)
        if reply["status"] == "does not fit":
            entry.update(needed=reply["needed"], limit=reply["limit"])
        out.append((entry, reply["provenance"]))
    return out


def _not_applicable(case: Case, variant: Variant, target: str | None) -> str | None:
    """Why `variant` is not measured for `target` (this release lacks an API it needs, or
    its compiler cannot build it for that platform); None when it is measured. The matrix
    measures on CPU (JAX_PLATFORMS=cpu) and compiles for targets."""
    if not case.available(variant):
        return f"needs {variant.since}"
    if variant.unavailable is None:
        return None
    from ..._targets import get_target

    return variant.unavailable(get_target(target).platform if target else "cpu")


def run_case(
    name: str,
    scale: str = "seed",
    *,
    time_limit: float = TIME_LIMIT,
    target: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every variant and grid point of case `name`, in the shape of ``python -m runbook run --json``.

    ``variants`` holds the measured programs (each with ``"status": "ok"``); ``skipped``
    holds every other one with its status and reason.
    """
    case = get_case(name)
    size = case.scale(scale)
    measured: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    provenance = None
    for variant in case.variants:
        grid = case.grid(size)
        # All of a variant's points in one child first (a fresh process costs seconds); where
        # that child does not finish in time or dies, each point in a child of its own.
        excluded = _not_applicable(case, variant, target)
        together = (
            measure_points(case, variant, scale, grid, time_limit=time_limit, target=target)
            if excluded is None
            else None
        )
        timed_out = False
        for i, params in enumerate(grid):
            if excluded is not None:
                entry = _unmeasured(variant, params, "not applicable", excluded)
            elif together is not None:
                entry, child = together[i]
                provenance = provenance or child
            elif timed_out:
                reason = "an earlier point of this variant timed out"
                entry = _unmeasured(variant, params, "not attempted", reason)
            else:
                entry, child = measure_point(
                    case, variant, scale, params, time_limit=time_limit, target=target
                )
                provenance = provenance or child
                timed_out = entry["status"] == "timeout"
            (measured if entry["status"] == "ok" else skipped).append(entry)
            if progress:
                got = (
                    f"{entry['bytes']['total']:,} bytes"
                    if entry["status"] == "ok"
                    else entry["status"]
                )
                progress(f"{target or 'cpu'} {name} {variant.name} {params}: {got}")
    if provenance is None:  # no child answered: describe the devices the children would have had
        provenance = dataclasses.asdict(Provenance.current()) | {"devices": case.devices}
    return {
        "case": name, "scale": scale, "target": target, "backend": provenance["backend"],
        "jax": provenance["jax"],
        "jaxlib": provenance["jaxlib"], "device_kind": provenance["device_kind"],
        "devices": provenance["devices"], "machine": provenance["machine"],
        "generated": provenance["date"], "variants": measured, "skipped": skipped,
    }  # fmt: skip


def _claims(name: str) -> list[dict[str, str]]:
    """In the child: case `name`'s claims, decided on this release's CPU at the seed scale."""
    return [dataclasses.asdict(c) for c in page_module(name).claims()]


def run_claims(
    names: Sequence[str],
    *,
    time_limit: float = CLAIMS_TIME_LIMIT,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Each case's claims with this release's verdicts, each case in a fresh process.

    ``{"generated", "cases": {name: {"status", "claims" or "reason", "seconds"}}}``; a case
    whose claims crash XLA, fail or run out of time is recorded with that status.
    """
    out: dict[str, Any] = {}
    for name in names:
        start = time.perf_counter()
        try:
            found = {"status": "ok", "claims": _subprocess.call(
                "runbook.site.producers.matrix:_claims", devices=get_case(name).devices, timeout=time_limit,
                name=name)}  # fmt: skip
        except subprocess.TimeoutExpired:
            found = {"status": "timeout", "reason": f"not decided within {time_limit:g} s"}
        except RunbookError as e:
            found = {"status": "failed", "reason": failure(e)}
        found["seconds"] = round(time.perf_counter() - start, 1)
        out[name] = found
        if progress:
            progress(f"claims {name}: {found['status']} ({found['seconds']} s)")
    return {"generated": Provenance.current().date, "cases": out}


TARGETS = ("h100",)


def probe_target(target: str, time_limit: float = TIME_LIMIT) -> dict[str, Any]:
    """Can this release compile for `target`? ``{"status", "reason", "compiler"}``.

    A small gradient of a gather compiled in a fresh process: the plugin must be installed,
    register, make the topology and return a memory analysis.
    """
    from ..._targets import get_target

    dist = "jax-cuda12-plugin" if get_target(target).platform == "cuda" else "libtpu"
    try:
        compiler = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return {"status": "not applicable", "reason": f"{dist} is not installed for this "
                "release (none published, or it would not install)", "compiler": None}  # fmt: skip
    try:
        _subprocess.call("runbook.site.producers.matrix:_probe", timeout=time_limit, target=target)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "reason": "the probe did not compile in time",
                "compiler": compiler}  # fmt: skip
    except RunbookError as e:
        return {"status": "failed", "reason": failure(e), "compiler": compiler}
    return {"status": "ok", "reason": "", "compiler": compiler}


def _probe(target: str) -> int:
    import jax
    import jax.numpy as jnp

    from ...cases.gather_grad import loss

    args = (jax.ShapeDtypeStruct((8, 8, 8), jnp.float32), jax.ShapeDtypeStruct((64, 3), jnp.int32))
    return measure(jax.grad(loss), *args, target=target).total


def run_matrix(
    cases: Sequence[str] | None = None,
    *,
    scale: str = "seed",
    time_limit: float = TIME_LIMIT,
    targets: Sequence[str] = TARGETS,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every case in this JAX release: provenance at the top level, then ``cases``, then per
    target (compiled without the device) whether this release can, and its ``cases``."""
    start = time.perf_counter()
    names = list(cases or case_names())
    results = {
        name: run_case(name, scale, time_limit=time_limit, progress=progress) for name in names
    }
    # A case whose problem one kind of compiler makes (`Case.shown_on`) is compiled for
    # that target too, in every release that has its compiler.
    shown = {name: get_case(name).shown_on for name in names}
    on_targets = {}
    for target in dict.fromkeys([*targets, *filter(None, shown.values())]):
        found = probe_target(target, time_limit)
        if found["status"] == "ok":
            found["cases"] = {
                name: run_case(name, scale, time_limit=time_limit, target=target,
                               progress=progress)
                for name in names
                if target in targets or shown[name] == target
            }  # fmt: skip
        on_targets[target] = found
    claims = run_claims(names, progress=progress)
    p = Provenance.current()
    return {
        "jax": p.jax, "jaxlib": p.jaxlib, "backend": p.backend, "device_kind": p.device_kind,
        "generated": p.date, "machine": p.machine, "host": host(), "runbook": __version__,
        "scale": scale, "time_limit_seconds": time_limit,
        "elapsed_seconds": round(time.perf_counter() - start, 1), "cases": results,
        "targets": on_targets, "claims": claims,
    }  # fmt: skip


def merge(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`old` release file with the cases `new` measured replaced or added (the same release);
    provenance and date are `new`'s, the measuring and session seconds add up."""
    if old["jax"] != new["jax"]:
        raise RunbookError(f"cannot merge jax {new['jax']}'s cases into jax {old['jax']}'s file")
    merged = {**new, "cases": {**old["cases"], **new["cases"]}}
    for key in ("elapsed_seconds", "session_seconds"):
        if key in old and key in new:
            merged[key] = round(old[key] + new[key], 1)
        else:  # a file written outside `nox -s versions` has no session time
            merged.pop(key, None)
    targets = {}
    for name in {*old.get("targets", {}), *new.get("targets", {})}:
        before, after = old.get("targets", {}).get(name), new.get("targets", {}).get(name)
        if after is None or before is None or after["status"] != "ok" or before["status"] != "ok":
            targets[name] = after or before
        else:
            targets[name] = {**after, "cases": {**before.get("cases", {}), **after["cases"]}}
    merged["targets"] = targets
    if "claims" in old or "claims" in new:
        merged["claims"] = merge_claims(old.get("claims", {}), new.get("claims", {}))
    return merged


def merge_claims(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`old` claims with the cases `new` decided replaced or added; the date is `new`'s."""
    return {**old, **new, "cases": {**old.get("cases", {}), **new.get("cases", {})}}


def write_json(data: dict[str, Any], path: str | os.PathLike[str]) -> pathlib.Path:
    """Write `data` as indented JSON (parent folders made); return the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runbook.site.producers.matrix", description=__doc__
    )
    parser.add_argument("--out", required=True, help="the JSON file to write")
    parser.add_argument("--scale", default="seed")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per program")
    parser.add_argument(
        "--case", action="append",
        help="only this case (repeatable); an existing --out file keeps its other cases",
    )  # fmt: skip
    parser.add_argument(
        "--target", action="append", help=f"compile for this target too (default: {TARGETS})"
    )
    parser.add_argument(
        "--claims-only", action="store_true",
        help="decide only the claims, and add them to the existing --out file of this release",
    )  # fmt: skip
    args = parser.parse_args(argv)
    progress = lambda line: print(line, file=sys.stderr, flush=True)
    out = pathlib.Path(args.out)
    if args.claims_only:
        if not out.exists():
            print(f"runbook: error: --claims-only needs an existing --out file: {out}",
                  file=sys.stderr)  # fmt: skip
            return 2
        data = json.loads(out.read_text())
        found = run_claims(args.case or case_names(), progress=progress)
        if args.case:  # the other cases' claims stay
            found = merge_claims(data.get("claims", {}), found)
        print(write_json({**data, "claims": found}, out))
        return 0
    try:
        data = run_matrix(
            args.case, scale=args.scale, time_limit=args.time_limit,
            targets=args.target or TARGETS,
            progress=progress,
        )  # fmt: skip
    except RunbookError as e:
        print(f"runbook: error: {e}", file=sys.stderr)
        return 2
    started = os.environ.get("RUNBOOK_SESSION_STARTED")  # set by `nox -s versions`
    if started:
        data["session_seconds"] = round(time.time() - float(started), 1)
    if args.case and out.exists():
        data = merge(json.loads(out.read_text()), data)
    print(write_json(data, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
