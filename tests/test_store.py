"""docs/_store: the site's compiles for GPU and TPU targets, read by builds instead of compiling
again (runbook/_cache.py), made by `nox -s store` and kept as current as the code."""

from __future__ import annotations

import json
import pathlib

import pytest

from runbook import _cache, _case
from runbook._targets import unavailable
from runbook.site.producers import store

STORE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "_store"
STALE = "docs/_store is older than the code: run `nox -s store` and commit docs/_store"


def _files() -> list[pathlib.Path]:
    return sorted(STORE.glob("*.jsonl"))


def _header(path: pathlib.Path) -> dict:
    with path.open() as f:
        return json.loads(f.readline())


def _this_release(path: pathlib.Path) -> None:
    """Skip where the installed compilers are not the store's (the oldest tested end)."""
    if _header(path)["versions"] != _cache._versions():
        pytest.skip(f"docs/_store was made with {_header(path)['versions']}")


def test_the_store_holds_the_targets_every_case_page_compiles_for():
    assert {"h100", "v5e"} <= {p.stem for p in _files()}
    for path in _files():
        header = _header(path)
        assert header["made_by"] == "nox -s store"
        assert header["date"]
        assert header["versions"]["jax"]
        assert header["versions"]["jaxlib"]


def test_the_store_is_as_current_as_the_code():
    """The measurement core it was made with, and each entry's case module, are today's."""
    for path in _files():
        _this_release(path)
        assert _header(path)["core"] == _cache.core_hash(), STALE
        lines = path.read_text().splitlines()[1:]
        assert lines
        for line in lines:
            entry = json.loads(line)
            assert entry["request"]["target"] == path.stem
            if entry["module"]:
                assert entry["source"] == _cache.module_hash(entry["module"]), (
                    f"{entry['module']} changed since: {STALE}"
                )


def test_the_test_suites_store_is_as_current_as_the_code():
    """The suite's own store at this release (conftest.py reads it): made with today's
    measurement core, else the suite compiles every program for a target again."""
    import jax

    command = store.tests_command(jax.__version__)
    if command is None:
        pytest.skip(f"jax {jax.__version__} is neither tested end: no store of its own")
    stale = f"tests/_store is older than the code: run `{command}` and commit tests/_store"
    files = sorted(store.tests_store(jax.__version__).glob("*.jsonl"))
    assert {"h100", "v5e"} <= {p.stem for p in files}, stale
    for path in files:
        header = _header(path)
        assert header["made_by"] == command
        assert header["versions"] == _cache._versions()
        assert header["core"] == _cache.core_hash(), stale


def test_a_stored_compile_is_what_compiling_here_gives(monkeypatch):
    """A case's programs for the H100, read from the store, against compiling them on this
    machine: the store answers for every machine only if these agree."""
    path = STORE / "h100.jsonl"
    _this_release(path)
    if unavailable("h100"):
        pytest.skip(unavailable("h100"))
    monkeypatch.delenv(_cache.ENV_VAR, raising=False)
    monkeypatch.setenv(_cache.STORE_VAR, str(STORE))
    found = []
    lookup = _cache.stored
    monkeypatch.setattr(
        _cache, "stored", lambda *a, **k: found.append(lookup(*a, **k)) or found[-1]
    )
    read = _case.measure_case("inplace-copy", "seed", target="h100")
    assert any(hit for hit, _ in found), "no program of inplace-copy was read from the store"
    monkeypatch.setenv(_cache.STORE_VAR, "")
    compiled = _case.measure_case("inplace-copy", "seed", target="h100")
    assert [_figures(r) for r in read.reports] == [_figures(r) for r in compiled.reports]


def _figures(report) -> dict:
    """A report less when, where and how long it was compiled: the store's record names the
    machine that compiled it, not this one."""
    record = report.to_record()
    record.pop("compile_seconds")
    for made in ("date", "machine"):
        record["provenance"].pop(made)
    return record


def test_a_build_reads_a_compile_for_a_target_from_the_store_and_never_one_for_this_machine(
    tmp_path, monkeypatch
):
    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return value

        return run

    target, here = {"kind": "t", "target": "h100"}, {"kind": "t", "target": None}
    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path / "first"))
    monkeypatch.delenv(_cache.STORE_VAR, raising=False)
    assert _cache.cached(target, compute(1)) == 1
    assert _cache.cached(here, compute(2)) == 2
    entries, counts = store.collect(tmp_path / "first", tmp_path / "store")
    assert counts == {_cache.MADE: 1}
    assert len(entries) == 1
    assert store.write(entries, tmp_path / "store") == {"h100": 1}

    _cache._store.cache_clear()
    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path / "second"))  # another machine's cache
    monkeypatch.setenv(_cache.STORE_VAR, str(tmp_path / "store"))
    assert _cache.cached(target, compute(3)) == 1  # read, not compiled
    assert _cache.cached(here, compute(4)) == 4  # this machine's figures are its own
    assert calls == [1, 2, 4]
    assert store.collect(tmp_path / "second", tmp_path / "store")[1] == {_cache.STORED: 1}

    # Another measurement core: the store no longer answers.
    _cache._store.cache_clear()
    monkeypatch.setattr(_cache, "core_hash", lambda: "another core")
    assert _cache.cached(target, compute(5)) == 5
    _cache._store.cache_clear()


def test_a_compile_for_a_target_is_keyed_without_the_machine(monkeypatch):
    target, here = {"kind": "t", "target": "v5e"}, {"kind": "t", "target": None}
    before = _cache.key(target), _cache.key(here)
    monkeypatch.setattr(_cache, "_machine", lambda: "another machine")
    assert _cache.key(target) == before[0]
    assert _cache.key(here) != before[1]


def test_a_detector_is_keyed_into_diagnoses_made_here_never_into_a_compile_for_a_target(
    monkeypatch,
):
    # A detector reads compiled programs: changing one must re-make a diagnosis cached here,
    # and no stored compile, except through the case whose detector it is (its page may call
    # it while measuring).
    assert not any(p.parts[-2] == "detectors" for p in _cache.PACKAGE.rglob("*.py")
                   if not _cache._per_case(p))  # fmt: skip
    target, here = {"kind": "t", "target": "v5e"}, {"kind": "t", "target": None}
    before = _cache.key(target), _cache.key(here)
    _cache.module_hash.cache_clear()
    monkeypatch.setattr(_cache, "detectors_hash", lambda: "another detector")
    monkeypatch.setattr(_cache, "_hash_files", lambda paths: repr(sorted(p.name for p in paths)))
    assert _cache.key(target) == before[0]
    assert _cache.key(here) != before[1]
    donation = _cache.module_hash("runbook.site.donation")
    assert donation == repr(sorted(["donation.py"] * 3))  # page, case and detector
    _cache.module_hash.cache_clear()


def test_the_code_of_real_runs_is_keyed_into_entries_made_here_never_into_a_compile_for_a_target(
    monkeypatch,
):
    # A real run's code (its peak, the host's memory, the turns runs take) changes what a
    # run measures here, never what a compiler made of a program for a target.
    monkeypatch.setattr(_cache, "_hash_files", lambda paths: repr(sorted(p.name for p in paths)))
    core = _cache.core_hash.__wrapped__()
    assert "_measure.py" in core
    assert "_runtime.py" not in core
    assert "_host.py" not in core
    # Nor the producers that run builds or read one, never inside one.
    assert "bench.py" not in core
    assert "store.py" not in core
    assert "real_corpus.py" not in core  # writes a data file the page reads
    assert "matrix.py" in core
    target, here = {"kind": "t", "target": "v5e"}, {"kind": "t", "target": None}
    before = _cache.key(target), _cache.key(here)
    monkeypatch.setattr(_cache, "run_hash", lambda: "another real run")
    assert _cache.key(target) == before[0]
    assert _cache.key(here) != before[1]


def test_a_program_hashes_alike_wherever_its_sources_lie():
    from runbook._measure import _CHECKOUT, portable

    here = f'loc("{_CHECKOUT}runbook/cases/x.py":3:4) "/venv/lib/python3.13/site-packages/o.py"'
    there = 'loc("/home/docs/runbook/cases/x.py":3:4) "/usr/lib/python3.13/site-packages/o.py"'
    assert portable(here) == 'loc("runbook/cases/x.py":3:4) "lib/python3.13/site-packages/o.py"'
    assert portable(there) != portable(here)  # a checkout elsewhere is made relative there
    cell = 'loc("/tmp/ipykernel_4711/2160394545.py":3:4)'
    assert portable(cell) == 'loc("ipykernel/2160394545.py":3:4)'  # a cell, in any kernel
    # nox's environments lie inside the checkout: their packages are the library's still.
    inside = f'loc("{_CHECKOUT}.nox/docs/lib/python3.13/site-packages/flax/core.py":7:1)'
    assert portable(inside) == 'loc("lib/python3.13/site-packages/flax/core.py":7:1)'
    # The kernel's and the standard library's frames under a cell keep their files, not
    # their lines, which each release moves; a package's own lines are kept.
    kernel = (
        'loc("/venv/lib/python3.13/site-packages/IPython/core/interactiveshell.py":3823:20 to '
        ':69) loc("/usr/lib/python3.13/asyncio/events.py":89:12 to 90:4)'
    )
    assert portable(kernel) == (
        'loc("lib/python3.13/site-packages/IPython/core/interactiveshell.py") '
        'loc("lib/python3.13/asyncio/events.py")'
    )


def test_the_suites_producer_writes_down_the_compiles_for_targets_the_package_asked_for(
    tmp_path, monkeypatch
):
    monkeypatch.delenv(_cache.ENV_VAR, raising=False)
    monkeypatch.setenv(_cache.STORE_VAR, str(tmp_path / "store"))
    monkeypatch.setattr(_cache, "cached", store.collecting(_cache.cached, tmp_path))
    _case.measure_case("inplace-copy", "tiny", target="h100", variants=["update-only"])
    _case.measure_case("inplace-copy", "tiny", variants=["update-only"])  # this machine's own
    assert _cache.cached({"kind": "made-up", "target": "v5e"}, lambda: 1) == 1  # a test's own
    monkeypatch.setenv(_cache.STORE_VAR, "")  # a test that compiles here: not its store's
    _case.measure_case("inplace-copy", "tiny", target="v5e", variants=["update-only"])
    lines = [json.loads(x) for f in tmp_path.glob("*.jsonl") for x in f.read_text().splitlines()]
    assert lines
    assert {line["request"]["target"] for line in lines} == {"h100"}
    for line in lines:
        assert line["store_key"] == _cache.store_key(line["request"], module=line["module"])


def test_the_suites_store_leaves_out_diagnoses_made_by_earlier_detectors():
    # A diagnosis for a target keys the detectors' hash into its request: one made before a
    # detector changed is never asked for again, so a run of the suite does not keep it.
    request = {"corpus": "ema-update", "source": "s", "target": "h100"}
    today = {"module": None, "request": {**request, "detectors": _cache.detectors_hash()}}
    earlier = {"module": None, "request": {**request, "detectors": "0" * 64}}
    assert store._current(today)
    assert not store._current(earlier)
    assert store._current({"module": None, "request": {"kind": "program", "target": "h100"}})


def test_a_program_hashes_alike_whichever_frames_called_the_code_that_traced_it():
    # A page's program is traced under a cell, a kernel and whichever function of the
    # package measured it first: none of those frames may reach its hash.
    import jax
    import jax.numpy as jnp

    from runbook._measure import program_hash

    def step(x):
        return (jnp.sin(x) * 2).sum()

    def lowered():
        return jax.jit(jax.grad(step)).lower(jnp.ones(3))

    def deeper():
        return lowered()

    near, far = lowered(), deeper()
    assert near.as_text(debug_info=True) != far.as_text(debug_info=True)
    assert program_hash(near) == program_hash(far)
    # The line that made each operation still counts.
    other = jax.jit(jax.grad(lambda x: (jnp.sin(x) * 2).sum())).lower(jnp.ones(3))
    assert program_hash(other) != program_hash(near)
