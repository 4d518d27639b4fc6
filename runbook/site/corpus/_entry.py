"""One program of the evaluation corpus: how to build it, and what `diagnose` should name."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

Built = tuple[Callable[..., Any], tuple[Any, ...]]


@dataclasses.dataclass(frozen=True)
class Entry:
    """A program written the way a user might, with the cases it exhibits.

    Attributes:
        name: a short label (the build function's name, dashed).
        build: returns ``(fn, args)``; args are `jax.ShapeDtypeStruct`s where possible.
        expected: the cases a diagnosis should name (empty: a clean program).
        source: the public report the program was drawn from (written our own way).
        shape: how it is written differently from the case's own program, in a few words.
        devices: host devices it needs (several: evaluated in a child process).
        target: the compile target it is diagnosed for, where only that kind of compiler
            makes its mechanism (a TPU's tiles); None: this machine's backend.
    """

    name: str
    build: Callable[[], Built]
    expected: frozenset[str]
    source: str
    shape: str
    devices: int = 1
    target: str | None = None

    @property
    def clean(self) -> bool:
        return not self.expected


REGISTRY: list[Entry] = []


def program(
    *expected: str, source: str, shape: str, devices: int = 1, target: str | None = None
) -> Callable[[Callable[[], Built]], Callable[[], Built]]:
    """Register the decorated build function as a corpus program expecting `expected`."""

    def register(build: Callable[[], Built]) -> Callable[[], Built]:
        name = build.__name__.strip("_").replace("_", "-")
        if any(e.name == name for e in REGISTRY):
            raise ValueError(f"two corpus programs named {name!r}")
        REGISTRY.append(Entry(name, build, frozenset(expected), source, shape, devices, target))
        return build

    return register
