"""``python -m runbook``: list the cases, measure one, diagnose or watch your own code, draw
its memory over its schedule, explain an out-of-memory message."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from ._case import CaseResult, case_names, get_case, measure_case
from ._diagnose import diagnose_locator
from ._errors import RunbookError
from ._explain import explain
from ._quiet import start_backend
from ._render import figures_table, fmt_bytes, provenance_label, report_table
from ._targets import get_target, target_names, targets, unavailable


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        self.exit(2, f"runbook: error: {message}\n")


def _program_arguments(command: argparse.ArgumentParser, target_help: str) -> None:
    """The arguments of a command that compiles the user's own function: the function, its
    arguments, a target, JSON."""
    command.add_argument(
        "function", help="locator path/to/file.py:function (a function, a jax.jit, a module)"
    )
    command.add_argument(
        "--args",
        help="locator path/to/file.py:make_args, a function returning the arguments as a tuple "
        "(jax.ShapeDtypeStruct allocates nothing)",
    )
    command.add_argument(
        "--target",
        help=f"{target_help}: {', '.join(target_names())}, or a slice (v5e-16, v5p-32, h100x8)",
    )
    command.add_argument("--json", action="store_true", help="print one JSON object")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m runbook", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="list the cases")
    sub.add_parser("targets", help="list the GPU and TPU targets to compile for")
    run = sub.add_parser("run", help="measure every variant of a case")
    run.add_argument("case", help=f"one of: {', '.join(case_names())}")
    run.add_argument(
        "--scale", default="seed", help="seed (default, abstract shapes) or a smaller one"
    )
    run.add_argument(
        "--target",
        help=f"compile for this device instead of this machine's backend: {', '.join(target_names())}",
    )
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    diag = sub.add_parser(
        "diagnose", help="name the known memory problems of your own function, and their fixes"
    )
    _program_arguments(diag, "compile for this device and say whether it fits")
    diag.add_argument(
        "--measure-fixes",
        action="store_true",
        help="also compile the mechanical fixes it names (donating arguments) and measure "
        "what each saves: one more compile each",
    )
    watch = sub.add_parser(
        "watch",
        help="run your own training loop under runbook.watch: what grows, what recompiles",
        description="Run path/to/file.py:main under runbook.watch and print what grew, what "
        "compiled, and the fixes. A step is marked by a callback: when main takes a "
        "parameter, it is called as main(mark_step) and calls mark_step() once per step; "
        "otherwise --step-on NAME wraps the module-level function NAME of that file (e.g. "
        "your jitted train step) so that each call marks a step.",
    )
    watch.add_argument("function", help="locator path/to/file.py:main")
    watch.add_argument("--steps", type=int, help="stop after this many steps")
    watch.add_argument(
        "--step-on",
        metavar="NAME",
        help="a module-level function of the file, called once per step (main then takes "
        "no parameter); main must look it up by name when it calls it",
    )
    watch.add_argument("--json", action="store_true", help="print one JSON object")
    expl = sub.add_parser(
        "explain",
        help="explain an XLA out-of-memory message: needed against available, the buffers, "
        "the case",
    )
    expl.add_argument(
        "file", help="a file holding the message (a pasted log is fine), or - for standard input"
    )
    line = sub.add_parser(
        "timeline",
        help="the bytes your own function holds over its compiled schedule, and the buffers "
        "live at its peak",
    )
    _program_arguments(line, "compile for this device instead of this machine's backend")
    line.add_argument("--png", metavar="FILE", help="also draw the chart into this PNG file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            for name in case_names():
                case = get_case(name)
                print(f"{name:<12} {case.symptom} (scales: {', '.join(case.scales)})")
            return 0

        if args.command == "targets":
            _print_targets()
            return 0

        if args.command == "diagnose":
            if args.target is not None:
                get_target(args.target)
            diagnosis = diagnose_locator(
                args.function, args.args, target=args.target, measure_fixes=args.measure_fixes
            )
            print(json.dumps(diagnosis.to_json(), indent=1) if args.json else diagnosis)
            return 0

        if args.command == "watch":
            return _watch(args.function, args.steps, args.step_on, args.json)

        if args.command == "explain":
            print(explain(sys.stdin.read() if args.file == "-" else pathlib.Path(args.file)))
            return 0

        if args.command == "timeline":
            return _timeline(args.function, args.args, args.target, args.png, args.json)

        def progress(line: str) -> None:
            if not args.quiet:
                print(line, file=sys.stderr, flush=True)

        if args.target is not None:
            get_target(args.target)  # an unknown name fails before the case is loaded
        start_backend()  # before anything asks JAX for devices: the plugins' chatter filtered
        result = measure_case(args.case, args.scale, target=args.target, progress=progress)
    except RunbookError as e:
        print(f"runbook: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        _print_result(result, args.scale)
    return 0


def _watch(locator: str, steps: int | None, step_on: str | None, as_json: bool) -> int:
    from ._watch_run import run_locator

    w, error = run_locator(locator, steps=steps, step_on=step_on)
    print(json.dumps(w.to_json(), indent=1) if as_json else w)  # what was recorded, always
    if error:
        print(f"runbook: error: {error}", file=sys.stderr)
        return 2
    return 0


def _timeline(
    locator: str, args_locator: str | None, target: str | None, png: str | None, as_json: bool
) -> int:
    from ._timeline import timeline_locator, write_png

    if target is not None:
        get_target(target)  # an unknown name fails before the user's file is loaded
    found = timeline_locator(locator, args_locator, target=target)
    if png:
        write_png(found, png)
    print(json.dumps(found.to_json(), indent=1) if as_json else found)
    return 0


def _print_targets() -> None:
    print(f"{'name':<7} {'device':<34} {'memory':>11}  {'usable by default':<24} compiler here")
    for t in targets():
        reason = unavailable(t)
        usable = "75% (JAX's allocator)" if t.platform == "cuda" else "XLA's usable HBM"
        here = "yes" if reason is None else f"no: {reason}"
        print(f"{t.name:<7} {t.label:<34} {fmt_bytes(t.memory):>11}  {usable:<24} {here}")


def _print_result(result: CaseResult, scale: str) -> None:
    if result.reports:
        print(report_table(result.reports))
    measured = [r for r in result.reports if r.figures]
    if measured:
        print("\nMeasured beyond the compiler's analysis (a real run on this machine):")
        print(figures_table(measured))
    for entry in result.skipped:
        params = ", ".join(f"{k}={v}" for k, v in entry["params"].items())
        if entry["status"] == "does not fit":
            print(
                f"{entry['name']} ({params}): DOES NOT FIT one device: the compiler needs "
                f"{fmt_bytes(entry['needed'])} of {entry['what']}, the device allows "
                f"{fmt_bytes(entry['limit'])}"
            )
        else:
            print(f"{entry['name']} ({params}): {entry['status']}: {entry['reason']}")
    target = result.target
    if target is not None:
        print(
            f"\n{target.label}: {fmt_bytes(target.memory)} per device; "
            f"{target.usable_rule()}: {fmt_bytes(target.usable())}"
        )
    label = provenance_label(result.reports) if result.reports else result.provenance.label()
    print(f"\n{label}; bytes per device; scale {scale!r}")
