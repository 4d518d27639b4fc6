"""Fixtures shared by the case tests."""

from __future__ import annotations

from collections.abc import Callable, Collection

import jax
import pytest

from runbook.site._history import recorded_verdicts


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


@pytest.fixture
def check_recorded(recorded: Callable[[str], dict[str, str]]) -> Callable[..., None]:
    """``check_recorded(case, verdicts, unsteady=(), allowed=...)``: the running JAX's
    verdicts are the ones recorded for it, except the claims in `unsteady`, whose line this
    machine's speed can cross from run to run: each of those need only be one of `allowed`."""

    def check(
        case: str,
        verdicts: dict[str, str],
        unsteady: Collection[str] = (),
        allowed: tuple[str, ...] = ("confirmed", "refuted"),
    ) -> None:
        expected = recorded(case)
        assert set(verdicts) == set(expected)
        assert {k: v for k, v in verdicts.items() if k not in unsteady} == {
            k: v for k, v in expected.items() if k not in unsteady
        }
        assert all(verdicts[k] in allowed for k in unsteady)

    return check
