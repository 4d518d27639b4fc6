"""GPU evidence: every variant's real peak on this machine's GPU, beside its prediction.

``nox -s gpu`` runs, with the Python that has a CUDA build of JAX::

    python -m runbook.site.producers.gpu --out-dir docs/_data/gpu

Per case: the compile-time analysis on the GPU backend at every scale (each program in a
fresh process), then the largest scale whose every program the prediction says fits,
then each program executed there in a fresh process, its peak read from
``memory_stats()["peak_bytes_in_use"]``. A case that needs more devices than the machine
has is measured through the programs that run on one device (the per-device program);
the others are recorded as not applicable.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ... import __version__, _provenance, _subprocess
from ..._case import case_names, get_case, measure_case
from ..._errors import RunbookError, WontFitError
from ..._host import available_bytes
from ..._provenance import Provenance
from ..._runtime import SAFETY, runtime_peak
from . import matrix as _matrix

# Seconds one program may take to compile, process start included. (Real runs are bounded
# by runtime_peak's own limit.)
TIME_LIMIT = 600.0


def choose_scale(
    predictions: Mapping[str, int | None], limit: int, *, safety: float = SAFETY
) -> tuple[str | None, str]:
    """The largest scale whose programs all fit in `safety` x `limit` bytes, and why.

    Args:
        predictions: per scale, the largest compile-time total (bytes per device) of any of
            its programs; None where none could be compiled.
        limit: the bytes one device can hold (``memory_stats()["bytes_limit"]``).
        safety: the share of `limit` a program may plan to use.

    Returns:
        (scale, reason), or (None, reason) when no scale fits.

    Examples:
        >>> choose_scale({"seed": 200 * 2**30, "small": 2**30, "tiny": 2**20}, 80 * 2**30)[0]
        'small'
    """
    allowed = int(safety * limit)
    known = {s: b for s, b in predictions.items() if b is not None}
    fitting = {s: b for s, b in known.items() if b <= allowed}
    if not fitting:
        smallest = min(known.values(), default=None)
        need = f"the smallest scale needs {smallest:,} bytes" if smallest else "nothing compiled"
        return None, f"no scale fits: {need}, {allowed:,} allowed ({safety:.0%} of {limit:,})"
    scale = max(fitting, key=fitting.__getitem__)
    too_big = sorted(s for s in known if s not in fitting)
    reason = (
        f"largest scale whose programs all fit: {scale!r} needs at most {fitting[scale]:,} "
        f"bytes per device, {allowed:,} allowed ({safety:.0%} of {limit:,})"
    )
    return scale, reason + (f"; too large: {', '.join(too_big)}" if too_big else "")


def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, or "" where it cannot be read."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return ""
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def device_info() -> dict[str, Any]:
    """This process's accelerator: kind, count, usable bytes per device, driver and runtime."""
    import jax

    devices = jax.local_devices()
    stats = [d.memory_stats() or {} for d in devices]
    limits = [s["bytes_limit"] for s in stats if "bytes_limit" in s]
    if not limits and devices[0].platform == "cpu":  # CPUs report no limit: the host's memory
        limits = [available_bytes()]
    return {
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "bytes_limit": min(limits) if limits else None,
        "driver": driver_version(),
        "platform_version": getattr(devices[0].client, "platform_version", ""),
    }


def slug(device_kind: str) -> str:
    """A file name for a device kind: ``slug("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"``."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", device_kind).strip("-") or "unknown"


def _largest(result: Mapping[str, Any]) -> int | None:
    totals = [v["bytes"]["total"] for v in result["variants"]]
    return max(totals) if totals else None


def _too_few_devices(result: dict[str, Any], needed: int, present: int) -> dict[str, Any]:
    """Failures of programs that need more devices than exist are not applicable here."""
    for entry in result["skipped"]:
        if entry["status"] == "failed":
            entry["status"] = "not applicable"
            entry["reason"] = f"needs {needed} devices, {present} present ({entry['reason']})"
    return result


def measure_runtime(name: str, scale: str, result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Execute every program that compiled at `scale`, each in a fresh process.

    A refusal (the prediction exceeds what the device allows) or a failure is recorded.
    """
    peaks = []
    for entry in result["variants"]:
        base = {"name": entry["name"], "role": entry["role"], "params": entry["params"]}
        try:
            peak = runtime_peak(name, entry["name"], scale=scale, params=entry["params"], repeats=1)
        except WontFitError as e:
            peaks.append({**base, "status": "won't fit", "reason": _subprocess.one_line(str(e))})
            continue
        except RunbookError as e:  # a crash on the device is a result, like a refusal
            peaks.append({**base, "status": "failed", "reason": _subprocess.failure(e)})
            continue
        except subprocess.TimeoutExpired as e:
            peaks.append({**base, "status": "failed", "reason": _subprocess.one_line(str(e))})
            continue
        peaks.append({
            **base, "status": "ok", "predicted": peak.predicted, "measured": peak.measured,
            "ratio": round(peak.ratio, 4), "agrees": peak.agrees, "seconds": peak.seconds,
            "method": peak.method, "compile_peak": peak.compile_peak,
            "inputs_peak": peak.inputs_peak,
        })  # fmt: skip
    return peaks


def add_target_predictions(
    name: str, scale: str, runtime: list[dict[str, Any]], device_kind: str
) -> None:
    """Beside each real peak, what the runbook's deviceless target for this device kind
    predicted for the same program (``target``, ``target_predicted``), where one matches."""
    from ..._targets import matching, unavailable

    target = matching(device_kind)
    if target is None or unavailable(target) is not None:
        return
    for peak in runtime:
        if peak["status"] != "ok":
            continue
        try:
            result = measure_case(
                name, scale, target=target.name, variants=[peak["name"]], at=peak["params"]
            )
        except RunbookError as e:
            peak.update(target=target.name, target_predicted=None, target_reason=str(e))
            continue
        found = result.select(peak["name"])
        peak.update(target=target.name, target_predicted=found[0].total if found else None)


def run_case(
    name: str,
    info: Mapping[str, Any],
    *,
    scales: Sequence[str] | None = None,
    time_limit: float = TIME_LIMIT,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """One case: compile-time analysis at every scale, the scale chosen, real peaks there.

    Args:
        name: a case name.
        info: from `device_info()`.
        scales: only these scales (default: all of the case's).
        time_limit: seconds per compile.
        progress: called with a line per measured program.
    """
    case = get_case(name)
    compiled = {}
    for scale in scales or case.scales:
        case.scale(scale)
        result = _matrix.run_case(name, scale, time_limit=time_limit, progress=progress)
        if info["devices"] < case.devices:
            result = _too_few_devices(result, case.devices, info["devices"])
        compiled[scale] = result
    predictions = {scale: _largest(result) for scale, result in compiled.items()}
    if info["bytes_limit"] is None:
        raise RunbookError(f"{info['device_kind']} reports no bytes_limit: cannot plan a scale.")
    chosen, reason = choose_scale(predictions, info["bytes_limit"])
    runtime = measure_runtime(name, chosen, compiled[chosen]) if chosen else []
    if chosen:
        add_target_predictions(name, chosen, runtime, info["device_kind"])
    return {
        "case": name, "devices_needed": case.devices, "devices_present": info["devices"],
        "scale": chosen, "scale_reason": reason, "compile_time": compiled, "runtime": runtime,
    }  # fmt: skip


def collect(
    cases: Sequence[str] | None = None,
    *,
    scales: Sequence[str] | None = None,
    allow_cpu: bool = False,
    time_limit: float = TIME_LIMIT,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every case on this machine's GPU: provenance at the top level, then ``cases``.

    Args:
        cases: only these cases (default: all).
        scales: only these scales (default: every scale of each case).
        allow_cpu: run on a CPU backend too (for testing the pipeline; not GPU evidence).
        time_limit: seconds per program.
        progress: called with a line per measured program.
    """
    import jax

    if jax.default_backend() == "cpu" and not allow_cpu:
        raise RunbookError(
            "no GPU: JAX's default backend is 'cpu'. Run `nox -s gpu` with a Python that has "
            'a CUDA build of JAX (pip install "jax[cuda12]").'
        )
    info = device_info()
    p = Provenance.current()
    return {
        **info, "backend": p.backend, "jax": p.jax, "jaxlib": p.jaxlib, "generated": p.date,
        "machine": p.machine, "host": _provenance.host(), "runbook": __version__, "safety": SAFETY,
        "cases": {
            n: run_case(n, info, scales=scales, time_limit=time_limit, progress=progress)
            for n in (cases or case_names())
        },
    }  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runbook.site.producers.gpu", description=__doc__
    )
    parser.add_argument("--out-dir", required=True, help="writes <device-kind>.json here")
    parser.add_argument("--case", action="append", help="only this case (repeatable)")
    parser.add_argument("--scale", action="append", help="only this scale (repeatable)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per program")
    args = parser.parse_args(argv)
    try:
        data = collect(
            args.case, scales=args.scale, time_limit=args.time_limit,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )  # fmt: skip
    except RunbookError as e:
        print(f"runbook: error: {e}", file=sys.stderr)
        return 2
    print(_matrix.write_json(data, f"{args.out_dir}/{slug(data['device_kind'])}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
