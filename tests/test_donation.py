"""donation: every verdict, every fix's result, the checks and the issue's targets."""

from __future__ import annotations

import dataclasses
import json
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runbook
from runbook._cli import main
from runbook.cases import donation
from runbook.cases.donation import CASE
from runbook.site import donation as page


@pytest.fixture(scope="module")
def seed(timed):
    return timed("donation")


@pytest.fixture(scope="module")
def found():
    return {c.name: c for c in page.checks()}


@pytest.fixture(scope="module")
def verdicts(seed, found):
    runs = {"peaks": page.peaks(), "eager": page.eager_peak(), "reuse": page.reuse()}
    return {c.key: c.verdict for c in page.claims(seed[0], list(found.values()), runs=runs)}


@pytest.mark.slow
def test_verdicts_are_the_ones_this_release_recorded(verdicts, recorded):
    # Per release: the running JAX's verdicts, as `nox -s versions` recorded them in its file.
    assert verdicts == recorded("donation")


def test_whole_case_measured_within_a_minute(seed):
    result, seconds = seed
    assert len(result.reports) == len(CASE.variants)
    assert seconds < 60


def test_recommended_fix_saves_and_sits_near_its_floor(seed):
    result = seed[0]
    repro = result.one("no-donation")
    fix = result.one(page.RECOMMENDED)
    assert fix.total == min(r.total for r in result.select(role="fix"))
    assert repro.total / fix.total >= 1.5
    assert fix.overhead <= 1.25


def test_without_donation_the_new_state_sits_beside_the_old(seed):
    result = seed[0]
    state = donation._sizes(CASE.scales["seed"])["state"]
    repro, fix = result.one("no-donation"), result.one("donated")
    assert repro.alias == 0
    assert repro.output >= state
    assert fix.alias >= state
    # The misnumbered step saves the parameters only: a third of the state.
    mis = result.one("misnumbered")
    assert mis.alias == pytest.approx(state / 3, rel=0.01)


def test_checks_tell_donated_from_aliased(found):
    assert found["donated_step"].unused <= 0
    assert not found["donated_step"].warnings
    mis = found["misnumbered_step"]
    assert mis.unused == CASE.scales["seed"]["tokens"] * CASE.scales["seed"]["width"] * 4
    assert len(mis.warnings) == 1
    assert not mis.silent
    mixed = found["mixed_dtype_update"]
    assert mixed.silent
    assert mixed.unused == donation._sizes(CASE.scales["seed"])["params"]


def test_loop_reading_a_donated_array_costs_a_copy_where_the_release_has_it(found, recorded):
    # openxla/xla#45912's copy is a release's: the running one's recorded verdict says
    # whether it copies, and the check must agree exactly either way.
    loop, once = found["update_read_update"], found["update_read_once"]
    assert loop.aliased == loop.donated == once.donated
    if recorded("donation")["loop-copy"] == "confirmed":
        assert loop.temp >= loop.donated
    else:
        assert loop.temp < 0.01 * loop.donated
    assert once.temp < 0.01 * once.donated


def test_donation_check_catches_a_silent_failure():
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    ok = page.donation_check(jax.jit(lambda a: a * 2, donate_argnums=0), x)
    assert (ok.donated, ok.aliased, ok.silent) == (256 * 256 * 4, 256 * 256 * 4, False)
    halved = page.donation_check(
        jax.jit(lambda a: (a * 2).astype(jnp.bfloat16), donate_argnums=0), x
    )
    assert halved.aliased == 0
    assert halved.silent


def test_jax_warns_once_per_program_and_process():
    assert page.warnings_per_lowering(3) == [1, 0, 0]


def test_loop_and_strided_reads_give_the_same_result():
    x = jnp.linspace(-1.0, 1.0, 1024, dtype=jnp.float32)
    np.testing.assert_allclose(
        donation.update_read_update(x), donation.update_read_once(x), rtol=1e-6
    )


def test_fixes_give_the_same_step():
    checks = runbook.verify("donation", "tiny")
    fixes = {v.name for v in CASE.variants if v.role == "fix"}
    assert {c["name"] for c in checks} == fixes
    assert all(c["same"] for c in checks), checks


def test_same_result_check_catches_a_wrong_update(monkeypatch):
    monkeypatch.delenv("RUNBOOK_CACHE_DIR", raising=False)  # the patched case is not in a key

    def wrong_step(params, opt_state, x, y):
        new, state, value = donation.train_step(params, opt_state, x, y)
        return [1.01 * p for p in new], state, value

    wrong = dataclasses.replace(
        CASE.variant("donated"),
        name="wrong",
        program=lambda p: jax.jit(wrong_step, donate_argnums=(0, 1)),
    )
    monkeypatch.setattr(
        donation, "CASE", dataclasses.replace(CASE, variants=(*CASE.variants, wrong))
    )
    checks = runbook.verify("donation", "tiny")
    assert [c["same"] for c in checks if c["name"] == "wrong"] == [False]


def test_tables_cover_every_report_and_check(seed, found):
    table = page.reports_table(seed[0], list(found.values()))
    assert [row[0] for row in table.rows] == list(page.REPORTS)
    assert len(page.check_table(list(found.values())).rows) == len(found)


def test_cli_json(capsys):
    assert main(["run", "donation", "--json", "--quiet"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["case"] == "donation"
    assert {v["role"] for v in data["variants"]} == {"reproduction", "fix"}
    for v in data["variants"]:
        b = v["bytes"]
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert v["lower_bound"] > 0


@pytest.fixture
def debug_nans():
    before = jax.config.values["jax_debug_nans"]
    jax.config.update("jax_debug_nans", True)
    yield
    jax.config.update("jax_debug_nans", before)


def test_debug_nans_drops_the_donation_asked_for_and_diagnose_says_so(debug_nans):
    def step(state, grad):
        return state - 0.1 * grad

    x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    (found,) = runbook.diagnose(jax.jit(step, donate_argnums=0), x, x, measure_fixes=True).findings
    assert found.pattern == "donation turned off by jax_debug_nans"
    assert found.saving == found.bytes == 1024 * 1024 * 4
    assert "jax_debug_nans" in found.fix
    # Without a donation asked for, the usual advice: donate.
    (plain,) = runbook.diagnose(jax.jit(step), x, x).findings
    assert plain.pattern == "state outputs not donated"


def test_measuring_the_donated_step_leaves_other_threads_flag_alone(debug_nans, monkeypatch):
    # diagnose(measure_fixes=True) compiles the step again donated, with jax_debug_nans off
    # while it traces; a thread tracing beside it (diagnoses per target in threads) must
    # still see the flag on, or its donation is silently turned off.
    from runbook.detectors import donation as detector

    seen = {}

    def compile_fn(fn, *args, **kwargs):
        seen["here"] = jax.config.values["jax_debug_nans"]
        beside = threading.Thread(target=lambda: seen.update(beside=jax.config.jax_debug_nans))
        beside.start()
        beside.join()
        return real(fn, *args, **kwargs)

    real = detector.compile_fn
    monkeypatch.setattr(detector, "compile_fn", compile_fn)
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    # what measure_donated reads of a diagnosed program
    program = types.SimpleNamespace(
        fn=lambda s, g: s - 0.1 * g, args=(x, x), options={}, target=None
    )
    assert detector.measure_donated(program, (0,)) is not None
    assert seen == {"here": False, "beside": True}
    assert jax.config.values["jax_debug_nans"]  # on again here, as the fixture set it


def test_the_debug_nans_claim_is_measured_on_fresh_traces():
    found = page.debug_nans_aliases("tiny")
    assert found["off"] > 0
    assert found["kept"] == found["off"]  # traced before the flag: its donation stays
    assert found["on"] == 0
    assert not jax.config.values["jax_debug_nans"]  # the flag is restored


def test_diagnose_compiles_once_and_measures_donating_only_when_asked():
    # The corpus's dropout: its output, computed from the activation, beside it. Compiled
    # once, diagnose names donating the activation (a false alarm on CPU, pinned in
    # runbook/site/corpus/known.py); compiled again with it donated, XLA:CPU saves nothing,
    # its output's buffer having held the random bits first, and no finding is made.
    from runbook.site import corpus

    fn, args = corpus.get("dropout-mask").build()
    (once,) = [f for f in runbook.diagnose(fn, *args).findings if f.case == "donation"]
    assert once.saving is None
    assert once.bytes == args[1].size * args[1].dtype.itemsize
    assert not [f for f in runbook.diagnose(fn, *args, measure_fixes=True).findings
                if f.case == "donation"]  # fmt: skip
    donated = jax.jit(fn, donate_argnums=1)
    assert runbook.measure(donated, *args).total == runbook.measure(fn, *args).total
    # For the H100 and the v5e, donating it frees the whole activation.
    for target in ("h100", "v5e"):
        saved = (
            runbook.measure(fn, *args, target=target).total
            - runbook.measure(donated, *args, target=target).total
        )
        assert saved == once.bytes, target
