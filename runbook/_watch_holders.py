"""What holds an array that accumulates: a chain of containers up to a variable.

JAX does not record where an array was made; what `runbook.watch` can name is what keeps it
alive. Starting from one array, `holder` follows `gc.get_referrers` through lists, dicts,
tuples and objects until a container is a variable of one of the frames around the loop.

Reading a frame's variables must leave nothing behind. Before Python 3.13 (PEP 667), a
function frame's ``f_locals`` is a dict snapshot that the frame keeps until it returns: it
would keep the step's arrays alive (the model and optimizer state of the step it was read
at) after the loop rebinds or deletes them. `frame_names` and `frame_value` read the
variables and empty that snapshot again; `holder` keeps no frame, snapshot or referrer list
once it returns.
"""

from __future__ import annotations

import gc
import inspect
import pathlib
import sys
import types
from collections.abc import Callable
from typing import Any

# Before 3.13 a function frame's f_locals is a snapshot dict cached on the frame (a module's
# or a class body's frame gives its namespace itself, never emptied: they are not CO_OPTIMIZED).
_SNAPSHOTS: bool = sys.version_info[:2] < (3, 13)


def _read(f: types.FrameType, visit: Callable[[str, object], bool]) -> None:
    """Call `visit(name, value)` on the variables of `f` until it returns True; then empty
    the frame's snapshot of its variables where Python keeps one (a function's frame before
    3.13: the dict is refilled whenever it is read again, by `locals()`, a debugger or
    us)."""
    local = f.f_locals
    try:
        for k, v in local.items():
            if visit(k, v):
                return
    finally:
        if _SNAPSHOTS and f.f_code.co_flags & inspect.CO_OPTIMIZED:  # a function's snapshot
            snapshot: Any = local
            snapshot.clear()
        del local


def frame_value(f: types.FrameType, wanted: Callable[[object], bool]) -> object | None:
    """The first variable of frame `f` that is `wanted`, read without a trace left behind."""
    found: list[object] = []

    def visit(k: str, v: object) -> bool:
        if wanted(v):
            found.append(v)
            return True
        return False

    _read(f, visit)
    return found[0] if found else None


def _frames() -> list[types.FrameType]:
    """The frames outside the watch's modules, innermost first (the loop, then its
    callers)."""
    out = []
    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        if not str(f.f_globals.get("__name__", "")).startswith("runbook._watch"):
            out.append(f)
        f = f.f_back
    return out


def frame_names(frames: list[types.FrameType]) -> dict[int, str]:
    """Each object a variable of `frames` names, by id, with how the report names it: the
    innermost frame first, its locals before its globals. Ids only: the objects stay alive
    through the frames' own variables while `holder` runs, and nothing is kept after."""
    names: dict[int, str] = {}
    for f in frames:
        file = pathlib.Path(f.f_code.co_filename).name
        top = f.f_code.co_name == "<module>"  # a script's or a notebook's top level
        what = "a top-level variable" if top else f"a local of {f.f_code.co_name}, {file}"

        def local(k: str, v: object, what: str = what) -> bool:
            if id(v) not in names:
                names[id(v)] = f"the {type(v).__name__} `{k}` ({what})"
            return False

        _read(f, local)
        for k, v in list(f.f_globals.items()):
            if id(v) not in names:
                names[id(v)] = f"the {type(v).__name__} `{k}` (a global of {file})"
    return names


def holder(obj: object, exclude: set[int], depth: int = 4) -> str:
    """What holds `obj`: a chain of containers up to a variable of a frame, e.g.
    ``a dict (key 'loss') in a list `history` (a local of main, train.py:12)``."""
    frames = _frames()
    try:
        names = frame_names(frames)
        mine = {id(frames), id(names), *exclude}
        return _chain(obj, names, mine, depth)
    finally:
        del frames


def _chain(obj: object, names: dict[int, str], mine: set[int], depth: int) -> str:
    path: list[str] = []
    target = obj
    for _ in range(depth):
        if named := names.get(id(target)):
            return " in ".join([*path, named])
        refs = [
            r
            for r in gc.get_referrers(target)
            if id(r) not in mine
            and not isinstance(r, (types.FrameType, types.CellType, types.FunctionType))
        ]
        mine.add(id(refs))
        if not refs:
            break
        for r in refs:  # a container that a variable names ends the chain
            if named := names.get(id(r)):
                return " in ".join([*path, named])
        r = next((r for r in refs if isinstance(r, (list, dict, tuple, set))), refs[0])
        if isinstance(r, dict):
            key = next((k for k, v in r.items() if v is target), None)
            owner = next(
                (o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r), None
            )
            if owner is not None:
                path.append(f"attribute {key!r} of a {type(owner).__name__}")
                r = owner
            else:
                path.append(f"a dict (key {key!r})")
        else:
            path.append(_container(r, target))
        target = r
    return " in ".join(path)


def _container(r: object, target: object) -> str:
    if isinstance(r, dict):
        key = next((k for k, v in r.items() if v is target), None)
        return f"a dict (key {key!r})"
    return f"a {type(r).__name__}"
