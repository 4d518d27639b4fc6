"""The real-program corpus: public models' steps at their authors' scale (issue: diagnose on
the programs users run). One module per program; `programs()` imports them all."""

from __future__ import annotations

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np

from ._program import SCALES, Builder, Built, RealProgram, register

__all__ = [
    "SCALES", "Builder", "Built", "RealProgram", "get", "programs", "register", "same_results",
]  # fmt: skip


def programs() -> list[RealProgram]:
    """Every real program, in module order."""
    from . import _program

    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    return sorted(_program.REGISTRY, key=lambda p: p.name)


def get(name: str) -> RealProgram:
    found = {p.name: p for p in programs()}
    if name not in found:
        raise KeyError(f"no real program {name!r}; known: {sorted(found)}")
    return found[name]


def _numbers(out: object) -> list[np.ndarray]:
    """The numeric array leaves of a step's result, as float64 (keys and static leaves out)."""
    return [
        np.asarray(x, np.float64)
        for x in jax.tree.leaves(out)
        if hasattr(x, "shape")
        and hasattr(x, "dtype")
        and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]


def same_results(name: str) -> dict[str, float]:
    """Each fix's largest difference from the program's own result at tiny scale, relative
    to the result's magnitude plus one (inf where the results differ in shape). A fix in
    `RealProgram.compared` is compared as the pair given there."""
    program = get(name)
    fn, args = program.build("tiny", True)
    own = _numbers(fn(*args))
    found = {}
    for case, build in program.fixes.items():
        want = own
        if case in program.compared:
            reference, build = program.compared[case]
            step, step_args = reference("tiny", True)
            want = _numbers(step(*step_args))
        fixed, fixed_args = build("tiny", True)
        got = _numbers(fixed(*fixed_args))
        if [g.shape for g in got] != [w.shape for w in want]:
            found[case] = float("inf")
            continue
        found[case] = max(
            (
                float(np.max(np.abs(g - w) / (np.abs(w) + 1.0), initial=0.0))
                for g, w in zip(got, want, strict=True)
            ),
            default=0.0,
        )
    return found
