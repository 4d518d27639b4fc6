"""Check `runbook.timeline` against real runs on CPU: docs/_data/timeline/cpu.json.

    nox -s timeline-check    (python -m runbook.site.producers.timeline_check [--out FILE])

For every variant of every single-device case that compiles one program (the run-time
cases' problems lie between programs), at the case's runnable scale: the timeline's peak,
the compiled total, and the peak a real execution reaches in a fresh process
(`runbook.runtime_peak`: the resident set's high-water mark less what the process held
before its inputs). Both compiles use the same options, XLA:CPU's YNNPACK fusion off as
`runbook.timeline` has it, so that the run executes the program the timeline describes.
The measuring page shows the file; the tests run `check` afresh on a few variants.

The same run decides which memory number to trust. For each variant compiled as
`runbook.measure` compiles it (the case's own options), three numbers: the runbook's sum
(arguments + outputs + temporaries - aliased), XLA's own ``peak_memory_in_bytes``, and the
real peak of that program run in a fresh process. The same programs compiled for a GPU and
a TPU target (`TARGETS`, without the device) give the sum and XLA's peak there too; their
real peaks need the devices (`--targets-only` adds these to the committed file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from runbook._case import case_names, get_case
from runbook._errors import RunbookError
from runbook._measure import compile_fn
from runbook._program import Program, cpu_accounting_options
from runbook._provenance import Provenance
from runbook._render import Table, fmt_bytes
from runbook._runtime import ABS_TOLERANCE, REL_TOLERANCE, agreement, runtime_peak
from runbook._timeline import of_program

OUT = pathlib.Path(__file__).resolve().parents[3] / "docs" / "_data" / "timeline" / "cpu.json"
TARGETS = ("h100", "v5e")  # compiled for without the device: the sum against XLA's peak


def variants() -> Iterator[tuple[str, str]]:
    """(case, variant): every non-baseline variant of the single-device compile-time cases
    that this machine's CPU compiler can build."""
    for name in case_names():
        case = get_case(name)
        if case.devices > 1 or case.runtime:
            continue
        for v in case.variants:
            unusable = v.unavailable is not None and v.unavailable("cpu")
            if v.role != "baseline" and case.available(v) and not unusable:
                yield name, v.name


def check(name: str, variant: str) -> dict[str, Any]:
    """One variant at its case's runnable scale: timeline peak, compiled total, real peak
    (bytes per device), and whether the real peak agrees with the timeline's."""
    case = get_case(name)
    v = case.variant(variant)
    options = {**cpu_accounting_options(), **case.options()}
    real = runtime_peak(name, variant, compiler_options=options, repeats=0)
    size = case.scale(case.runnable_scale)
    with warnings.catch_warnings():  # a fix donating what no output can reuse
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        program = Program.compile(
            v.program(real.params),
            *case.inputs(v, size, real.params, False),
            compiler_options=options,
            name=variant,
            measure_fixes=False,
        )
    line = of_program(program)
    if line.total != real.predicted:
        raise AssertionError(f"{name}/{variant}: the run compiled another program")
    default = runtime_peak(name, variant, params=real.params, repeats=0)  # as measure compiles
    inputs = case.inputs(v, size, real.params, False)
    stats = compile_fn(v.program(real.params), *inputs, compiler_options=case.options())
    xla_peak = getattr(stats.memory_analysis(), "peak_memory_in_bytes", None)
    return {
        "case": name,
        "variant": variant,
        "role": v.role,
        "scale": case.runnable_scale,
        "params": dict(real.params),
        "peak": line.peak,
        "total": line.total,
        "measured": real.measured,
        "agrees": agrees(real.measured, line.peak),
        # which number to trust, for the program `measure` compiles:
        "sum": default.predicted,
        "xla_peak": int(xla_peak) if xla_peak is not None else None,
        "real": default.measured,
    }


def target_numbers(row: dict[str, Any], target: str) -> dict[str, int | None]:
    """The program of `row` (a `check` row) compiled for `target` as `runbook.measure`
    compiles for it: the runbook's sum, its temporaries and XLA's peak, per device."""
    from runbook._targets import require

    case = get_case(row["case"])
    v = case.variant(row["variant"])
    inputs = case.inputs(v, case.scale(row["scale"]), row["params"], False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        stats = compile_fn(v.program(row["params"]), *inputs, target=require(target))
    m = stats.memory_analysis()
    peak = getattr(m, "peak_memory_in_bytes", None)
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return {
        "sum": int(total - m.alias_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "xla_peak": int(peak) if peak is not None else None,
    }


def add_targets(data: dict[str, Any], targets: tuple[str, ...] = TARGETS) -> dict[str, Any]:
    """`data` with each row's numbers on each available target, and their provenance."""
    from runbook._targets import require, unavailable

    usable = [t for t in targets if unavailable(t) is None]
    for row in data["rows"]:
        if "real" not in row:
            continue
        row["targets"] = {}
        v = get_case(row["case"]).variant(row["variant"])
        for t in usable:
            why = v.unavailable(require(t).platform) if v.unavailable else None
            try:  # a variant for another device (cuDNN on a TPU) is skipped, with its reason
                row["targets"][t] = {"skipped": why} if why else target_numbers(row, t)
            except RunbookError as e:  # too large for the device, say
                row["targets"][t] = {"skipped": str(e)[:200]}
            print(f"{row['case']}/{row['variant']} on {t}: {row['targets'][t]}", file=sys.stderr)
    data["target_provenance"] = {
        t: dataclasses.asdict(Provenance.for_target(require(t), 1)) for t in usable
    }
    return data


def target_summary(data: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Per target: how many variants' XLA peak equals the runbook's sum (to 1%), how many
    it passes (`runbook._measure.peak_exceeds`, the rule of the TPU caveat), and its ratios
    to the sum (lowest, highest)."""
    from runbook._measure import peak_exceeds

    data = data or load()
    out: dict[str, dict[str, Any]] = {}
    for target in data.get("target_provenance", {}):
        have = [
            r["targets"][target]
            for r in _with_numbers(data)
            if "sum" in r.get("targets", {}).get(target, {}) and r["targets"][target]["xla_peak"]
        ]
        ratios = sorted(n["xla_peak"] / n["sum"] for n in have if n["sum"])
        out[target] = {
            "of": len(have),
            "equal": sum(abs(n["xla_peak"] - n["sum"]) <= 0.01 * n["sum"] for n in have),
            "above": sum(peak_exceeds(n["xla_peak"], n["sum"]) for n in have),
            "low": ratios[0] if ratios else None,
            "high": ratios[-1] if ratios else None,
            "label": Provenance(**data["target_provenance"][target]).label(),
        }
    return out


def agrees(measured: int, predicted: int) -> bool:
    """The runtime rule (`runbook._runtime.agreement`), against the timeline's peak."""
    return abs(measured - predicted) <= REL_TOLERANCE * predicted + ABS_TOLERANCE


def load(path: str | pathlib.Path = OUT) -> dict[str, Any]:
    """The committed check: ``provenance`` and ``rows``."""
    data: dict[str, Any] = json.loads(pathlib.Path(path).read_text())
    return data


def table(data: dict[str, Any] | None = None) -> Table:
    """The check as the measuring page shows it, its provenance in the caption."""
    data = data or load()
    p = Provenance(**data["provenance"])
    rows = [
        [
            f"{r['case']} / {r['variant']}",
            fmt_bytes(r["peak"]),
            fmt_bytes(r["total"]),
            fmt_bytes(r["measured"]),
            f"{r['measured'] / r['peak']:.2f}",
            "agrees"
            if r["agrees"]
            else "real run higher"
            if r["measured"] > r["peak"]
            else "lower",
        ]
        for r in data["rows"]
    ]
    agreeing = sum(r["agrees"] for r in data["rows"])
    return Table(
        [
            "case / variant",
            "timeline peak",
            "compiled total",
            "real peak",
            "real / peak",
            "verdict",
        ],
        rows,
        f"{agreeing} of {len(rows)} agree ({data['rule']}). Each case at its runnable scale, "
        f"{p.label()}, {p.date}; made by `nox -s timeline-check` (docs/_data/timeline/).",
    )


NUMBERS = ("sum", "xla_peak")
NUMBER_NAMES = {"sum": "runbook's sum", "xla_peak": "XLA's peak_memory_in_bytes"}


def numbers_table(data: dict[str, Any] | None = None) -> Table:
    """Per variant: the runbook's sum, XLA's ``peak_memory_in_bytes`` and the real peak of
    the program `runbook.measure` compiles, each number's ratio to the real peak."""
    data = data or load()
    p = Provenance(**data["provenance"])
    rows = []
    for r in _with_numbers(data):
        ratios = [f"{r[k] / r['real']:.2f}x" if r[k] and r["real"] else "-" for k in NUMBERS]
        verdicts = ["agrees" if agrees(r["real"], r[k]) else "off" for k in NUMBERS if r[k]]
        rows.append([
            f"{r['case']} / {r['variant']}", fmt_bytes(r["sum"]),
            fmt_bytes(r["xla_peak"]) if r["xla_peak"] else "-", fmt_bytes(r["real"]),
            *ratios, " / ".join(verdicts),
        ])  # fmt: skip
    return Table(
        ["case / variant", "runbook's sum", "XLA peak_memory_in_bytes", "real peak",
         "sum / real", "XLA peak / real", "verdict (sum / XLA peak)"],
        rows,
        f"Each program compiled as runbook.measure compiles it (the case's own options) and "
        f"run in a fresh process at its case's runnable scale; a number agrees when the real "
        f"peak is {agreement()} of it. {p.label()}, {p.date}; made by `nox -s timeline-check` "
        "(docs/_data/timeline/).",
    )  # fmt: skip


def _with_numbers(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in data["rows"] if "real" in r]


def numbers_summary(data: dict[str, Any] | None = None) -> dict[str, Any]:
    """For each number (and for ``ynn_off``, the total with XLA:CPU's YNNPACK fusion off):
    how many variants it agrees on, and its ratios to the real peak (lowest, median,
    highest)."""
    import statistics

    data = data or load()
    rows = _with_numbers(data)
    out: dict[str, Any] = {"variants": len(rows)}
    # The third, "ynn_off": the total of the program compiled with XLA:CPU's YNNPACK fusion
    # off (what the CPU caveat suggests to count its working memory) against the real peak
    # of the program as compiled by default.
    for k in (*NUMBERS, "total"):
        have = [r for r in rows if r[k] and r["real"]]
        ratios = sorted(r[k] / r["real"] for r in have)
        out["ynn_off" if k == "total" else k] = {
            "agree": sum(agrees(r["real"], r[k]) for r in have),
            "of": len(have),
            "low": ratios[0] if ratios else None,
            "median": statistics.median(ratios) if ratios else None,
            "high": ratios[-1] if ratios else None,
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    parser.add_argument(
        "--targets-only", action="store_true", help="add the target numbers to the file at --out"
    )
    parser.add_argument(
        "--case", action="append",
        help="only this case (repeatable): its rows replace its rows in the file at --out",
    )  # fmt: skip
    args = parser.parse_args(argv)
    out = args.out
    if args.targets_only:
        out.write_text(json.dumps(add_targets(load(out)), indent=1) + "\n")
        return
    rows = []
    for name, variant in variants():
        if args.case and name not in args.case:
            continue
        rows.append(check(name, variant))
        r = rows[-1]
        print(f"{name}/{variant}: peak {r['peak']:,} real {r['measured']:,}", file=sys.stderr)
    here = dataclasses.asdict(Provenance.current())
    data = {
        "provenance": here,
        "rule": f"real peak {agreement()} of the timeline's peak",
        **add_targets({"rows": rows}),
    }
    if args.case:  # the other cases' rows (and their target numbers) stay as they were
        old = load(out)
        if old["provenance"]["jax"] != here["jax"]:
            parser.error(f"--case adds to a file of jax {old['provenance']['jax']}: run all")
        rows = [r for r in old["rows"] if r["case"] not in args.case] + data["rows"]
        data = {**old, "rows": rows, "updated": {**old.get("updated", {}),
                                                 **dict.fromkeys(args.case, here["date"])}}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
