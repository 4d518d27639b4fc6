"""Fixtures shared by the case tests, and the test suite's store of compiles for targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from typing import Any

import jax
import pytest

import runbook
from runbook import _cache
from runbook._subprocess import child_env
from runbook.site._history import recorded_verdicts
from runbook.site.producers import store

# A compile for a GPU or TPU target runs that target's compiler and no device: the suite
# reads the ones its tests ask for from its own store, made at this release by
# `nox -s "store_tests(oldest)"` and `"store_tests(newest)"` (tests/test_store.py fails
# while it is older than the code). A test that times a measurement compiles here
# (`measured_here`); RUNBOOK_STORE_DIR="" compiles everything here.
os.environ.setdefault(_cache.STORE_VAR, str(store.tests_store(jax.__version__)))


@pytest.fixture(scope="session")
def child_json() -> Callable[..., Any]:
    """``child_json(script, devices, timeout=None)``: run `script` in a fresh Python with
    `devices` forced host devices and return the JSON its last line of output prints."""

    def run(script: str, devices: int, timeout: float | None = None) -> Any:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            env=child_env(devices),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(scope="session")
def measured_here() -> Callable[[str, str | None], tuple[Any, float]]:
    """``measured_here(case, target)``: the case measured at seed scale, compiled on this
    machine and not read from a store, and the seconds that took (what a reader waits)."""

    def measure(case: str, target: str | None) -> tuple[Any, float]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(_cache.STORE_VAR, "")
            start = time.perf_counter()
            result = runbook.measure_case(case, "seed", target=target)
            return result, time.perf_counter() - start

    return measure


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
