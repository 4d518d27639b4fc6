"""What holds an array that accumulates: a chain of containers up to a variable.

JAX does not record where an array was made; what `runbook.watch` can name is what keeps it
alive. Starting from one array, `holder` follows `gc.get_referrers` through lists, dicts,
tuples and objects until a container is a variable of one of the frames around the loop.
"""

from __future__ import annotations

import gc
import pathlib
import sys
import types


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


def _named(target: object, frames: list[types.FrameType]) -> str:
    for f in frames:
        file = pathlib.Path(f.f_code.co_filename).name
        top = f.f_code.co_name == "<module>"  # a script's or a notebook's top level
        for k, v in f.f_locals.items():
            if v is target:
                what = "a top-level variable" if top else f"a local of {f.f_code.co_name}, {file}"
                return f"the {type(v).__name__} `{k}` ({what})"
        for k, v in f.f_globals.items():
            if v is target:
                return f"the {type(v).__name__} `{k}` (a global of {file})"
    return ""


def holder(obj: object, exclude: set[int], depth: int = 4) -> str:
    """What holds `obj`: a chain of containers up to a variable of a frame, e.g.
    ``a dict (key 'loss') in a list `history` (a local of main, train.py:12)``."""
    frames = _frames()
    mine = {id(frames), *exclude}
    path: list[str] = []
    target = obj
    for _ in range(depth):
        if named := _named(target, frames):
            return " in ".join([*path, named])
        refs = [
            r
            for r in gc.get_referrers(target)
            if id(r) not in mine
            and r is not frames
            and not isinstance(r, (types.FrameType, types.CellType, types.FunctionType))
        ]
        mine.add(id(refs))
        if not refs:
            break
        for r in refs:  # a container that a variable names ends the chain
            if named := _named(r, frames):
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
