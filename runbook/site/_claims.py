"""Claims from a write-up, each with the verdict a measurement gives."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .._render import Table

VERDICTS = ("confirmed", "refuted", "not reproducible here")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A claim, our verdict and the measured evidence behind it."""

    key: str
    claim: str
    verdict: str
    evidence: str

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"`verdict` must be one of {VERDICTS}, got {self.verdict!r}")


def verdict(condition: bool, *, then: str = "confirmed", otherwise: str = "refuted") -> str:
    """The verdict a measured condition gives."""
    return then if condition else otherwise


def claims_table(claims: Sequence[Claim], caption: str = "") -> Table:
    rows = [[c.claim, c.verdict.upper(), c.evidence] for c in claims]
    return Table(
        ["claim in the write-up", "verdict", "evidence (measured at build time)"], rows, caption
    )
