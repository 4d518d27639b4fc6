"""Root-cause evidence: the largest buffers of a compiled program.

XLA writes its buffer assignment (which value lives in which allocation) and the optimised
HLO (which instruction made each value, with its Python source line) when asked to dump a
compilation; `runbook._hlo` reads both back and joins them into `Buffer`s.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

_ALLOC = re.compile(r"^allocation \d+: size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ ([^ >]+)(?: @[^>]*)?> \(size=(\d+),offset=\d+\): (\S+)")
_FILE_NAME = re.compile(r'^(\d+) "(.*)"$')
_FILE_LOC = re.compile(r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)")
_FRAME = re.compile(r"^(\d+) \{file_location_id=(\d+)")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One value in the compiled program's memory, with what made it."""

    size: int
    shape: str
    kind: str  # argument, output, temp, constant or thread-local
    instruction: str
    op: str
    source: str  # "file.py:LINE (function)" or "" when XLA recorded none


def _allocation_kind(header: str) -> str:
    if "parameter" in header:
        return "argument"
    if "output" in header or "live-out" in header:
        return "output"
    if "constant" in header:
        return "constant"
    if "thread-local" in header:
        return "thread-local"
    return "temp"


def _short_path(path: str) -> str:
    parts = pathlib.PurePath(path).parts
    if "runbook" in parts:
        return "/".join(parts[len(parts) - 1 - parts[::-1].index("runbook") :])
    return "/".join(parts[-2:])


_TABLES = {"FileNames", "FunctionNames", "FileLocations", "StackFrames"}


def source_frames(text: str) -> dict[str, str]:
    """Stack frame ids of an optimised HLO module, each as ``"file.py:LINE (function)"``.

    The module's text ends with tables (file names, function names, locations, frames) that
    instructions point into with ``stack_frame_id``.
    """
    files: dict[str, str] = {}
    functions: dict[str, str] = {}
    locations: dict[str, str] = {}
    frames: dict[str, str] = {}
    table = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped in _TABLES:
            table = stripped
        elif not (table and re.match(r"^\d+ ", stripped)):
            table = ""
        elif table == "FileNames" and (f := _FILE_NAME.match(stripped)):
            files[f[1]] = f[2]
        elif table == "FunctionNames" and (f := _FILE_NAME.match(stripped)):
            functions[f[1]] = f[2]
        elif table == "FileLocations" and (f := _FILE_LOC.match(stripped)):
            path = _short_path(files.get(f[2], "?"))
            locations[f[1]] = f"{path}:{f[4]} ({functions.get(f[3], '?')})"
        elif table == "StackFrames" and (f := _FRAME.match(stripped)):
            frames[f[1]] = locations.get(f[2], "")
    return frames


_COLOR = re.compile(r"\bcolor (\d+)")


def _allocations(directory: pathlib.Path) -> list[tuple[int, str, int, bool]]:
    """(size, kind, colour, whether it may be live out) of each allocation in the dumped
    buffer assignment (the largest module's, where XLA dumped several); empty if none."""
    assignments = sorted(directory.glob("*after_optimizations-buffer-assignment.txt"))
    if not assignments:
        return []
    assignment = max(assignments, key=lambda p: p.stat().st_size)
    out = []
    for line in assignment.read_text().splitlines():
        if (a := _ALLOC.match(line)) is not None:
            color = _COLOR.search(a[2])
            live_out = "live-out" in a[2]
            out.append((int(a[1]), _allocation_kind(a[2]), int(color[1]) if color else 0, live_out))
    return out


def allocation_sizes(directory: pathlib.Path) -> dict[str, int]:
    """Bytes per kind of allocation in the dumped buffer assignment, with its memory space.

    XLA gives each allocation a colour: 0 is the device's main memory; TPU compilers put
    on-chip scratch (VMEM) in colour 1 and scalar memory in 2. A key is the kind
    ("temp", "argument", ...) plus `` (memory space N)`` when N is not 0.
    """
    sizes: dict[str, int] = {}
    for size, kind, color, _ in _allocations(directory):
        key = kind + (f" (memory space {color})" if color else "")
        sizes[key] = sizes.get(key, 0) + size
    return sizes


def assignment_bytes(directory: pathlib.Path) -> dict[str, int]:
    """``memory_analysis()``'s device bytes by kind (argument, output, temp, alias), added up
    from the dumped buffer assignment's allocations in main memory (colour 0).

    For a program a target's compiler refused, which leaves no compiled program to ask: XLA
    writes its buffer assignment before it refuses. An input whose allocation may be live
    out is an output aliased to it. The compiler's own temp figure can differ from this
    sum by a little (XLA's TPU compiler: tens of KiB on small programs).
    """
    out = dict.fromkeys(("argument", "output", "temp", "alias"), 0)
    for size, kind, color, live_out in _allocations(directory):
        if color:
            continue
        if kind == "argument":
            out["argument"] += size
            if live_out:  # an output written into this input's memory
                out["output"] += size
                out["alias"] += size
        elif kind in ("output", "temp"):
            out[kind] += size
    return out
