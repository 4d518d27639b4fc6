"""Save, then compare, what `python -m runbook run CASE --scale S --json` prints for every case.

A change that should not move a figure (a refactor) is checked by saving a snapshot before
it and comparing after:

    python docs/_tools/cli_snapshot.py save /tmp/before      # on the old commit
    python docs/_tools/cli_snapshot.py save /tmp/after       # on the new one
    python docs/_tools/cli_snapshot.py compare /tmp/before /tmp/after

Some fields change from run to run whatever the code does, and are dropped: the date the
result was generated, each program's compile time, and the resident-set figures of real
runs (closure-constant's ``rss_*``, measured in a fresh process each time). Everything else
must match byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VOLATILE_TOP = ("generated",)
VOLATILE_VARIANT = ("compile_seconds",)
VOLATILE_FIGURE_PREFIX = "rss_"  # a real run's resident set: never the same twice


def _stable(text: str) -> str:
    data = json.loads(text)
    for key in VOLATILE_TOP:
        data.pop(key, None)
    for entry in data["variants"]:
        for key in VOLATILE_VARIANT:
            entry.pop(key, None)
        figures = entry.get("figures", {})
        for key in [k for k in figures if k.startswith(VOLATILE_FIGURE_PREFIX)]:
            figures.pop(key)
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _cases_and_scales() -> list[tuple[str, str]]:
    code = (
        "import json, runbook\n"
        "print(json.dumps([(n, s) for n in runbook.case_names() "
        "for s in runbook.get_case(n).scales]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [tuple(pair) for pair in json.loads(out.stdout.strip().splitlines()[-1])]


def save(folder: Path, only: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for case, scale in _cases_and_scales():
        if only and case not in only:
            continue
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "runbook", "run", case, "--scale", scale, "--json", "--quiet"],
            capture_output=True, text=True, env=env, check=True,
        )  # fmt: skip
        (folder / f"{case}.{scale}.json").write_text(_stable(out.stdout))
        print(f"{case:>18} {scale:>6}: {time.perf_counter() - start:6.1f} s", flush=True)


def compare(before: Path, after: Path) -> int:
    names = sorted({p.name for p in before.glob("*.json")} | {p.name for p in after.glob("*.json")})
    differ = [n for n in names
              if not (before / n).exists() or not (after / n).exists()
              or (before / n).read_bytes() != (after / n).read_bytes()]  # fmt: skip
    for name in names:
        print(f"{'DIFFERS' if name in differ else 'same':>8}  {name}")
    print(f"{len(names) - len(differ)} of {len(names)} identical")
    return 1 if differ or not names else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("save")
    s.add_argument("folder", type=Path)
    s.add_argument("--case", action="append", default=[], help="only this case (repeatable)")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "save":
        save(args.folder, args.case)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
