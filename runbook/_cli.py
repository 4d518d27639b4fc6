"""``python -m runbook``: list the cases, measure one, print a table or JSON."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ._case import case_names, get_case, measure_case
from ._errors import RunbookError
from ._render import report_table


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        self.exit(2, f"runbook: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m runbook", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="list the cases")
    run = sub.add_parser("run", help="measure every variant of a case")
    run.add_argument("case", help=f"one of: {', '.join(case_names())}")
    run.add_argument(
        "--scale", default="seed", help="seed (default, abstract shapes) or a smaller one"
    )
    run.add_argument("--json", action="store_true", help="print one JSON object")
    run.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "list":
            for name in case_names():
                case = get_case(name)
                print(f"{name:<12} {case.symptom} (scales: {', '.join(case.scales)})")
            return 0

        def progress(line: str) -> None:
            if not args.quiet:
                print(line, file=sys.stderr, flush=True)

        result = measure_case(args.case, args.scale, progress=progress)
    except RunbookError as e:
        print(f"runbook: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        print(report_table(result.reports))
        print(f"\n{result.provenance.label()}; bytes per device; scale {args.scale!r}")
    return 0
