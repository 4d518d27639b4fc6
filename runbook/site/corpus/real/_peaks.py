"""Real peaks of the real-program corpus on this machine's GPU, beside each compile-time
prediction: does a model's step, and each fix, use what the compiler said it would?

``nox -s gpu-corpus`` runs, with the Python that has a CUDA build of JAX (and flax, equinox
and optax)::

    python -m runbook.site.corpus.real._peaks --out-dir docs/_data/corpus [--jobs 5]

Each one-device program, as written and with each fix, is built on its own seeded inputs
at its authors' scale (on the host, then put on the GPU), then compiled on the GPU and run
once, in a fresh process (the allocator's peak cannot be reset; its peak once the inputs
were made, and once compiled, are kept apart). Where the compile's peak (XLA's autotuning
tries kernels on the device) hides the step's, a second process runs the step from the
executable the first kept in JAX's compilation cache. A program that needs more devices than
the machine has is recorded as not applicable; one whose prediction is over the share of
the GPU a real run may take (`runbook._runtime.SAFETY`) is refused before it runs. Writes
``gpu-<device kind>.json``, whose rows the diagnose page shows (`peaks_summary`,
`peaks_table`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import unittest.mock
from collections.abc import Callable, Sequence
from typing import Any

from runbook import _forkserver, _subprocess
from runbook._errors import RunbookError, WontFitError
from runbook._targets import _version

from . import get, programs

DATA = pathlib.Path(__file__).resolve().parents[4] / "docs" / "_data" / "corpus"
TIME_LIMIT = 300.0  # seconds per program, process start and compile included


def _peak_json(name: str, fix: str | None, scale: str, cache: str) -> dict[str, Any]:
    import jax

    from runbook._inputs import as_jax
    from runbook._measure import compile_fn
    from runbook._runtime import run_compiled

    # A compiled executable kept in `cache`: a second child loads it, and XLA's autotuning
    # (which tries kernels on the device, each with its own scratch) does not run again.
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    program = get(name)
    build = program.fixes[fix] if fix else program.build
    device = jax.local_devices()[0]
    # One build, made real first: a second build is a different pytree (a train state's
    # optimizer functions, a module's own arrays), which the compiled step would not take.
    # Made on the host and then put on the device, so that an initialiser's temporaries
    # leave no peak there: the device then holds the inputs alone.
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        fn, args = as_jax(*build(scale, True))
    args = jax.tree.map(
        lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, args
    )
    made = device.memory_stats()["peak_bytes_in_use"] if device.platform != "cpu" else None
    kept = set(pathlib.Path(cache).iterdir())
    compiled = compile_fn(fn, *args)
    loaded = not set(pathlib.Path(cache).iterdir()) - kept  # an earlier child kept this one
    what = f"{name}" + (f" with the {fix} fix" if fix else "")
    figures, _, seconds = run_compiled(
        compiled, lambda: _dynamic(compiled, args), devices_needed=program.devices, what=what
    )
    # The inputs were made before the compile here: the peak then is theirs.
    return {**figures, "inputs_peak": made, "seconds": seconds, "loaded": loaded}


def _dynamic(compiled: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` less a jit's static arguments (an NNX GraphDef): what the compiled step takes.
    The static ones are those holding no array."""
    import jax

    wanted = len(compiled.in_tree.children()[0].children())
    if len(args) == wanted:
        return args
    dynamic = tuple(a for a in args if any(hasattr(x, "dtype") for x in jax.tree.leaves(a)))
    if len(dynamic) != wanted:
        raise RunbookError(f"the compiled step takes {wanted} arguments, not {len(args)}")
    return dynamic


def measure(
    name: str,
    fix: str | None,
    *,
    devices: int,
    scale: str = "authors",
    time_limit: float = TIME_LIMIT,
) -> dict[str, Any]:
    """One program (with `fix` applied, or as written) in a fresh process: its row."""
    row: dict[str, Any] = {"program": name, "fix": fix, "scale": scale}
    needed = get(name).devices
    if needed > devices:
        return {
            **row,
            "status": "not applicable",
            "reason": f"needs {needed} devices, {devices} present",
        }
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="runbook-peaks-") as cache:

            def child() -> Any:
                return _subprocess.call(
                    "runbook.site.corpus.real._peaks:_peak_json",
                    timeout=time_limit, name=name, fix=fix, scale=scale, cache=cache,
                )  # fmt: skip

            found = child()
            if _compiling(found):
                # The step's own peak is hidden under the compile's: run it again from
                # the executable the first child kept, with no compile to peak.
                first, found = found, child()
                found["first_compile_peak"] = first["compile_peak"]
    except WontFitError as e:
        return {**row, "status": "won't fit", "reason": _subprocess.one_line(str(e))}
    except RunbookError as e:
        return {**row, "status": "failed", "reason": _subprocess.failure(e)}
    except subprocess.TimeoutExpired as e:
        return {**row, "status": "failed", "reason": _subprocess.one_line(str(e))}
    ratio = found["measured"] / found["predicted"] if found["predicted"] else None
    return {
        **row, "status": "ok", **found, "ratio": ratio,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }  # fmt: skip


def _compiling(found: dict[str, Any]) -> bool:
    """Whether a child's peak was reached while it compiled, after its inputs were made."""
    peak = found["compile_peak"]
    return peak is not None and peak >= found["measured"] > (found["inputs_peak"] or 0)


def _libraries() -> dict[str, str | None]:
    """The model libraries' versions (the corpus's programs are written with them)."""
    return {name: _version(name) for name in ("flax", "equinox", "optax")}


def collect(
    names: Sequence[str] | None = None,
    *,
    scale: str = "authors",
    allow_cpu: bool = False,
    time_limit: float = TIME_LIMIT,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
    out: pathlib.Path | None = None,
) -> dict[str, Any]:
    """Every program, as written then with each fix, on this machine's GPU.

    Args:
        names: only these programs (default: all), started in this order.
        scale: "authors" (the evidence) or "tiny" (to test the pipeline).
        allow_cpu: run on a CPU backend too (to test the pipeline; not GPU evidence).
        time_limit: seconds per program.
        jobs: programs measured at once, each in its own processes, one step at a time.
            Above 1, JAX must not preallocate (``XLA_PYTHON_CLIENT_PREALLOCATE=false``):
            each process's peak is its own allocator's, so the others do not change it.
        progress: called with a line per row.
        out: a JSON file written again after each row, so a run cut short keeps its rows.
    """
    import jax

    from runbook._provenance import Provenance
    from runbook.site.producers.gpu import device_info
    from runbook.site.producers.matrix import write_json

    if jax.default_backend() == "cpu" and not allow_cpu:
        raise RunbookError("no GPU: JAX's default backend is 'cpu'. Run `nox -s gpu-corpus` "
                           "with a Python that has a CUDA build of JAX.")  # fmt: skip
    preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in (
        "false", "0"
    )  # fmt: skip
    if jobs > 1 and preallocate and jax.default_backend() != "cpu":
        raise RunbookError("jobs > 1 needs XLA_PYTHON_CLIENT_PREALLOCATE=false: a process "
                           "that preallocates takes the memory the others need.")  # fmt: skip
    info = device_info()
    p = Provenance.current()
    rows: list[dict[str, Any]] = []
    data = {**info, "backend": p.backend, "jax": p.jax, "jaxlib": p.jaxlib,
            "generated": p.date, "machine": p.machine, "jobs": jobs,
            "preallocate": preallocate, "libraries": _libraries(), "rows": rows}  # fmt: skip
    known = {prog.name: prog for prog in programs()}
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise RunbookError(f"no real-corpus program {unknown[0]!r}; known: {sorted(known)}")
    chosen = [known[n] for n in dict.fromkeys(names)] if names else list(known.values())
    # Rows list every program as written first, then the fixes, in the corpus's order.
    order = {(q.name, f): (f is not None, i, j)
             for i, q in enumerate(known.values()) for j, f in enumerate([None, *q.fixes])}  # fmt: skip
    lock = threading.Lock()

    def program(q: Any) -> None:
        # One program's steps one after another: at most one of its peaks on the GPU at once.
        for fix in [None, *q.fixes]:
            row = measure(q.name, fix, devices=info["devices"], scale=scale,
                          time_limit=time_limit)  # fmt: skip
            with lock:
                rows.append(row)
                rows.sort(key=lambda r: order[r["program"], r["fix"]])
                if out is not None:
                    write_json(data, out)
            if progress:
                got = row["status"]
                if got == "ok":
                    got = f"{row['measured']:,} of {row['predicted']:,} predicted"
                progress(f"{q.name} {fix or 'as written'}: {got}")

    # The fork server answers one caller at a time: programs measured at once each start a
    # fresh Python instead.
    switch = {_forkserver.SWITCH: "0"} if jobs > 1 else {}
    with (
        unittest.mock.patch.dict(os.environ, switch),
        concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool,
    ):
        for done in [pool.submit(program, q) for q in chosen]:
            done.result()
    return data


def load(data_dir: str | pathlib.Path | None = None) -> list[dict[str, Any]]:
    """Every GPU's recorded corpus peaks (``gpu-*.json``), one dict per device kind."""
    return [
        json.loads(p.read_text()) for p in sorted(pathlib.Path(data_dir or DATA).glob("gpu-*.json"))
    ]


def _saving(fixed: int, written: int) -> str:
    return f"{(written - fixed) / written:.1%}"


def peaks_table(data: dict[str, Any]) -> Any:
    """One GPU's recorded corpus peaks: per program and fix, predicted beside measured, and
    each fix's saving on the GPU beside the saving its compile predicted."""
    from runbook._render import Table, fmt_bytes
    from runbook._runtime import agreement, agrees

    written = {r["program"]: r for r in data["rows"] if r["fix"] is None}
    rows = []
    for r in data["rows"]:
        what = [r["program"], r["fix"] or "as written"]
        if r["status"] != "ok":
            if r["fix"] is None or r["status"] != written[r["program"]]["status"]:
                rows.append([*what, "-", f"{r['status']}: {r['reason']}", "-", "-", "-"])
            continue  # a program none of whose steps ran is one row
        measured = fmt_bytes(r["measured"])
        if r.get("first_compile_peak") is not None:
            measured += (
                f" (from the cached executable: compiling, autotuning included, peaked at "
                f"{fmt_bytes(r['first_compile_peak'])})"
            )
        elif r["inputs_peak"] is not None and r["inputs_peak"] >= r["measured"]:
            measured += " (reached while making the inputs)"
        elif r["compile_peak"] is not None and r["compile_peak"] >= r["measured"]:
            measured += " (reached while compiling)"
        same = "yes" if agrees(r["measured"], r["predicted"]) else "no"
        base = written[r["program"]]
        saving = "-"
        if r["fix"] is not None and base["status"] == "ok":
            saving = (
                f"{_saving(r['measured'], base['measured'])} "
                f"({_saving(r['predicted'], base['predicted'])})"
            )
        rows.append(
            [*what, fmt_bytes(r["predicted"]), measured, f"{r['ratio']:.2f}x", same, saving]
        )
    libraries = ", ".join(f"{k} {v}" for k, v in data.get("libraries", {}).items() if v)
    caption = (
        f"{data['device_kind']} x{data['devices']}, jax {data['jax']} / jaxlib {data['jaxlib']}"
        f"{', ' + libraries if libraries else ''}, measured {data['generated']} "
        f"(`nox -s gpu-corpus`). Bytes per device at the authors' scale; they agree "
        f"{agreement()}. A fix's saving is against the program as written: on the GPU, and "
        f"(in brackets) as its compile predicted."
    )
    columns = [
        "program",
        "fix",
        "GPU compile-time",
        "GPU measured peak",
        "measured / predicted",
        "agree",
        "fix saves on the GPU (predicted)",
    ]
    return Table(columns, rows, caption)


def peaks_summary(data: dict[str, Any]) -> str:
    """One GPU's recorded corpus peaks in a sentence: how many steps ran, how many agree
    with their prediction, and which used more than it."""
    from runbook._runtime import SAFETY, agrees

    ran = [r for r in data["rows"] if r["status"] == "ok"]
    off = [r for r in ran if not agrees(r["measured"], r["predicted"])]
    refused = [r for r in data["rows"] if r["status"] == "won't fit"]
    text = (
        f"On the {data['device_kind']}, {len(ran)} steps ran (programs as written and with "
        f"their fixes); {len(ran) - len(off)} used what their compile predicted."
    )
    if off:
        named = "; ".join(
            f"{r['program']} {'with the ' + r['fix'] + ' fix' if r['fix'] else 'as written'} "
            f"({r['ratio']:.2f}x)"
            for r in off
        )
        text += f" Used more than predicted: {named}."
    if refused:
        text += (
            f" {len(refused)} were not run: their prediction was over {SAFETY:.0%} of what "
            f"JAX may use there, the most the runbook lets a real run take."
        )
    return text


def main(argv: Sequence[str] | None = None) -> int:
    # Before JAX starts: this process only reads the device, and a preallocating one would
    # hold the memory its children's steps need.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from runbook.site.producers.gpu import slug

    parser = argparse.ArgumentParser(
        prog="python -m runbook.site.corpus.real._peaks", description=__doc__
    )
    parser.add_argument("--out-dir", default=str(DATA), help="writes gpu-<device-kind>.json here")
    parser.add_argument("--program", action="append", help="only this program (repeatable)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per program")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="programs measured at once (needs XLA_PYTHON_CLIENT_PREALLOCATE=false)",
    )
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out_dir) / f"gpu-{slug(jax.local_devices()[0].device_kind)}.json"
    try:
        collect(args.program, time_limit=args.time_limit, jobs=args.jobs, out=out,
                progress=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
    except RunbookError as e:
        print(f"runbook: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
