"""Fixtures shared by the case tests, and the test suite's store of compiles for targets."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Iterator
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


# The folder `pytest_configure` made for this run, where it made one.
_RUN_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """One measurement cache for the whole run, made empty here and shared by the xdist
    workers (they inherit this environment): a program several tests measure is compiled
    once per run, never carried over from an earlier one. A RUNBOOK_CACHE_DIR already set
    is used as it is; a test that times a measurement starts from an empty one (`timed`)."""
    if hasattr(config, "workerinput") or os.environ.get(_cache.ENV_VAR):
        return
    folder = tempfile.mkdtemp(prefix="runbook-tests-")
    os.environ[_cache.ENV_VAR] = folder
    config.stash[_RUN_CACHE] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_RUN_CACHE, None)
    if folder is not None:
        os.environ.pop(_cache.ENV_VAR, None)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def child_json() -> Callable[..., Any]:
    """``child_json(script, devices, timeout=None, xla_flags="")``: run `script` in a fresh
    Python with `devices` forced host devices (and `xla_flags` added to XLA's) and return
    the JSON its last line of output prints."""

    def run(script: str, devices: int, timeout: float | None = None, xla_flags: str = "") -> Any:
        env = child_env(devices)
        env["XLA_FLAGS"] = f"{env['XLA_FLAGS']} {xla_flags}".strip()
        proc = subprocess.run(
            [sys.executable, "-c", script],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run


def _merge(fresh: str, into: str | None) -> None:
    """Give the run's cache `into` the entries a cold measurement made in `fresh`, so that
    the tests after it find them (an entry already there is left as it is)."""
    if not into:
        return
    for path in pathlib.Path(fresh).glob("*/*.json"):
        target = pathlib.Path(into) / path.parent.name / path.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # copied beside, then renamed: a worker reading it never sees half a file
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(path, partial)
            partial.replace(target)


@contextlib.contextmanager
def one_timing_at_a_time() -> Iterator[None]:
    """Hold the run's timing lock: no two of the xdist workers time a measurement at once.

    A compile for a GPU or TPU target runs on several threads; two at once on CI's two cores
    each took about twice their time alone (sharding-replicated for the v5e: 20 s alone,
    36 s beside another), so a bar on seconds measured the neighbour. Waiting for the lock
    is not timed; the other worker's untimed tests still run meanwhile.
    """
    folder = os.environ.get(_cache.ENV_VAR) or tempfile.gettempdir()
    with (pathlib.Path(folder) / ".timing.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def timed() -> Callable[..., tuple[Any, float]]:
    """``timed(case, **options)``: the case measured at seed scale from an empty cache (a
    compile for a target is still read from the store), and the seconds it took, timed
    while no other worker times one (`one_timing_at_a_time`); what it computed then joins
    the run's cache."""

    def measure(case: str, **options: Any) -> tuple[Any, float]:
        shared = os.environ.get(_cache.ENV_VAR)
        with (
            pytest.MonkeyPatch.context() as mp,
            tempfile.TemporaryDirectory(prefix="runbook-timed-") as fresh,
            one_timing_at_a_time(),
        ):
            mp.setenv(_cache.ENV_VAR, fresh)
            start = time.perf_counter()
            result = runbook.measure_case(case, "seed", **options)
            seconds = time.perf_counter() - start
            _merge(fresh, shared)
            return result, seconds

    return measure


@pytest.fixture(scope="session")
def measured_here(
    timed: Callable[..., tuple[Any, float]],
) -> Callable[[str, str | None], tuple[Any, float]]:
    """``measured_here(case, target)``: the case measured at seed scale, compiled on this
    machine, read from neither a store nor the run's cache, and the seconds that took."""

    def measure(case: str, target: str | None) -> tuple[Any, float]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(_cache.STORE_VAR, "")
            return timed(case, target=target)

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
