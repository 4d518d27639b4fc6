"""Fixtures shared by the case tests."""

from __future__ import annotations

from collections.abc import Callable

import jax
import pytest

from runbook._history import recorded_verdicts


@pytest.fixture
def recorded() -> Callable[[str], dict[str, str]]:
    """``recorded(case)``: the verdicts this JAX release gave the case's claims when
    ``nox -s versions`` measured it; the test is skipped for a release with none recorded."""

    def get(case: str) -> dict[str, str]:
        found = recorded_verdicts(case, jax.__version__)
        if found is None:
            pytest.skip(f"no claims recorded for jax {jax.__version__}: run "
                        f'nox -s "versions({jax.__version__})"')  # fmt: skip
        return found

    return get
