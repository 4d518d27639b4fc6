"""One real program: a public model's training (or inference) step, rewritten at its authors'
scale, with the fixes that decide by measurement which mechanisms it shows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# (fn, args): args are `jax.ShapeDtypeStruct`s, or real arrays when built concrete.
Built = tuple[Callable[..., Any], tuple[Any, ...]]
# build(scale, concrete): scale is "authors" (the public code's own sizes) or "tiny" (the
# same program, small enough to run in a test); concrete gives real, seeded arrays.
Builder = Callable[[str, bool], Built]

SCALES = ("authors", "tiny")


@dataclasses.dataclass(frozen=True)
class RealProgram:
    """A public model's step, rewritten in our own code, keeping its structure, libraries,
    dtypes and shapes.

    Attributes:
        name: a short label, dashed.
        model: what it is, in a few words ("GPT-2 small, flax linen, pmap").
        source: the public file it was rewritten from, at a commit (a URL).
        libraries: the libraries it uses, as a user's code would ("flax.linen", "optax").
        build: the step and its inputs at a scale (`Builder`).
        fixes: case name -> the same step with that case's fix applied, built the same way.
            A mechanism is expected where its fix, measured, saves memory (the producer
            decides per target); the fix computes the same result (the tests check it).
        devices: the devices its mesh or pmap spans; it takes them from
            `runbook._case_types.devices(n)`, so that a compile target's devices serve too.
        compared: case -> (step, fix) that the same-result check compares in place of
            `build` and the fix, where the fix draws its random numbers otherwise by design
            (dropout masks drawn per micro-batch): both built without that randomness.
        tolerance: relative tolerance when comparing a fix's result with the step's.
        notes: what differs from the source, if anything (a sentence).
    """

    name: str
    model: str
    source: str
    libraries: tuple[str, ...]
    build: Builder
    fixes: Mapping[str, Builder] = dataclasses.field(default_factory=dict)
    devices: int = 1
    compared: Mapping[str, tuple[Builder, Builder]] = dataclasses.field(default_factory=dict)
    tolerance: float = 1e-4
    notes: str = ""


REGISTRY: list[RealProgram] = []


def register(program: RealProgram) -> RealProgram:
    """Add `program` to the real corpus (each module registers its own at import)."""
    if any(p.name == program.name for p in REGISTRY):
        raise ValueError(f"two real programs named {program.name!r}")
    REGISTRY.append(program)
    return program
