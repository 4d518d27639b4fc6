"""The JAX releases the runbook is measured and tested on: the one list, read by noxfile.py too.

This module imports nothing but the standard library, so that nox (and the package's import
guard) can read it without JAX installed. Each release must have jax and jaxlib wheels of
the same version on PyPI for the Python that `python_for` names.
"""

from __future__ import annotations

RELEASES = (
    "0.4.30", "0.4.35", "0.4.38", "0.5.3", "0.6.2", "0.7.2", "0.8.3", "0.9.2", "0.10.2",
    "0.11.1", "0.11.2", "0.12.0.1",
)  # fmt: skip
# 0.11.1 is measured beside 0.11.2: its jaxlib made XLA:CPU rewrite a whole buffer for each
# small update in a loop (jax-ml/jax#40101), which the inplace-copy page decides per release.

# JAX 0.11 and newer publish wheels for Python 3.12 and newer only; the releases before it
# all have wheels for 3.11 (0.4.30's newest is 3.12), the oldest Python the package supports.
_FIRST_NEEDING_312 = "0.11"
OLDEST_PYTHON = "3.11"
NEWEST_PYTHON = "3.13"

# The two ends `nox -s tests` runs and `.ci/run` checks: (Python, JAX). The docs build, and
# the hosted build, use the newest end.
TESTED = {"oldest": (OLDEST_PYTHON, "0.10.2"), "newest": (NEWEST_PYTHON, RELEASES[-1])}


def release_key(version: str) -> tuple[int, ...]:
    """Sort key for release strings: ``release_key("0.10.2") > release_key("0.9.2")``."""
    return tuple(int(p) if p.isdigit() else -1 for p in version.split("."))


def python_for(release: str) -> str:
    """The Python version `nox -s versions` measures `release` on."""
    needs_312 = release_key(release) >= release_key(_FIRST_NEEDING_312)
    return NEWEST_PYTHON if needs_312 else OLDEST_PYTHON


def too_old(jax_version: str) -> str | None:
    """One line saying why `jax_version` is too old for the runbook, or None."""
    first = RELEASES[0]
    if release_key(jax_version) < release_key(first):
        return (
            f"jax {jax_version} is older than the oldest release the runbook measures "
            f"({first}): upgrade with `pip install -U 'jax>={first}'`."
        )
    return None


def too_new(jax_version: str) -> str | None:
    """One line saying that `jax_version` is newer than any measured release, or None.

    A newer patch of the newest minor release counts as measured; a newer minor does not.
    """
    last = RELEASES[-1]
    if release_key(jax_version)[:2] > release_key(last)[:2]:
        return (
            f"jax {jax_version} is newer than the newest release the runbook measures "
            f"({last}): its figures and verdicts may differ from the pages'."
        )
    return None
