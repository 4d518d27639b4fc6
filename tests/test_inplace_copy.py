"""inplace-copy: every verdict, the bars on every target shown, the same-result check, the
detector on programs written differently, and the loop timing of jax-ml/jax#40101."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runbook
import runbook.site
from runbook import _targets
from runbook.cases import inplace_copy as ic
from runbook.cases.inplace_copy import CASE
from runbook.site import inplace_copy as page

TARGETS = [None, "h100", "v5e"]  # the ones the page shows
S, f32 = jax.ShapeDtypeStruct, jnp.float32


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: t or "cpu")
def seed(request, measured_here):
    if request.param and _targets.unavailable(request.param):
        pytest.skip(_targets.unavailable(request.param))
    return measured_here("inplace-copy", request.param)


def test_verdicts_are_the_ones_this_release_recorded(recorded):
    assert {c.key: c.verdict for c in page.claims()} == recorded("inplace-copy")


def test_measured_within_a_minute_per_target(seed):
    result, seconds = seed
    assert {r.name for r in result.reports} == {v.name for v in CASE.variants}
    assert seconds < 60


def test_every_variant_is_at_or_above_its_floor_and_the_fix_near_it(seed):
    result = seed[0]
    for report in result.reports:
        assert report.lower_bound == ic.floor_bytes(CASE.scales["seed"])
        assert report.total >= report.lower_bound, report.name
    fix = result.one(CASE.recommended)
    assert fix.total <= 1.25 * fix.lower_bound


def test_the_reproduction_copies_the_buffer_and_the_fix_does_not(seed):
    result = seed[0]
    assert page.copies(result, "read-after")
    assert page.in_place(result, CASE.recommended)
    assert page.in_place(result, "update-only")
    assert result.one("read-after").total >= 1.5 * result.one(CASE.recommended).total


def test_the_same_result_check_passes_for_the_fixes_and_can_fail():
    checks = runbook.verify("inplace-copy")
    assert {c["name"] for c in checks} == {"read-first", "barrier", "from-read"}
    assert all(c["same"] for c in checks), checks
    # An update that writes the rows one place off is told apart.
    buf, rows = CASE.args(CASE.scales["small"], {}, True)
    want = [np.asarray(x) for x in ic.update_then_read(buf, rows)]
    shifted = buf.at[1 : rows.shape[0] + 1].set(rows)
    got = [np.asarray(shifted), np.asarray(jnp.sum(shifted - buf))]
    err = max(
        float(np.max(np.abs(a - b) / (np.abs(b) + 1))) for a, b in zip(got, want, strict=True)
    )
    assert err > CASE.tolerance


def test_the_fix_writes_the_rows_to_within_rounding():
    buf, rows = CASE.args(CASE.scales["tiny"], {}, True)
    new, change = ic.update_from_read(buf, rows)
    np.testing.assert_allclose(new[: rows.shape[0]], rows, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new[rows.shape[0] :], buf[rows.shape[0] :])
    np.testing.assert_allclose(change, jnp.sum(rows - buf[: rows.shape[0]]), rtol=1e-5)


def test_the_loop_timing_gives_a_ratio_of_its_two_lengths():
    loop = page.loop_timing()
    assert loop["steps"][1] == 4 * loop["steps"][0]
    assert loop["ratio"] == loop["seconds"][1] / loop["seconds"][0]
    (claim,) = [c for c in page.claims() if c.key == "loop-rewrites-40101"]
    assert claim.verdict == ("confirmed" if loop["ratio"] >= page.QUADRATIC else "refuted")


def test_the_loop_claim_is_not_decided_for_a_compile_target():
    if _targets.unavailable("v5e"):
        pytest.skip(_targets.unavailable("v5e"))
    found = {c.key: c for c in page.claims(target="v5e")}
    assert found["loop-rewrites-40101"].verdict == "not reproducible here"
    assert found["read-after-copies"].verdict == "confirmed"


def test_release_changes_are_read_from_the_data():
    def release(version, temp):
        variants = [{"name": n, "status": "ok", "lower_bound": 100, "bytes": {"temp": temp}}
                    for n in ("read-first", "barrier", "from-read")]  # fmt: skip
        return {"jax": version, "cases": {"inplace-copy": {"variants": variants}},
                "claims": {"cases": {}}}  # fmt: skip

    releases = [release("0.10.2", 0), release("0.12.0.1", 100)]
    note = str(page.changes(releases))
    assert "read-first on CPU: in place in 0.10.2, copy in 0.12.0.1" in note
    table = page.by_release(releases=releases)
    assert [row[:2] for row in table.rows] == [["0.10.2", "in place"], ["0.12.0.1", "copy"]]


# Written unlike the case: a dict of 2-D caches with a dynamic position, a scatter with an
# index array, a bf16 column update; and clean programs that update or copy for good reasons.
CACHE = {"k": S((8192, 4096), f32), "v": S((8192, 4096), f32)}
ROW = S((4096,), f32)
POS = S((), jnp.int32)


def _kv_step(cache, row, pos):
    new = {n: jax.lax.dynamic_update_slice(c, row[None], (pos, 0)) for n, c in cache.items()}
    drift = sum(jnp.abs(new[n] - cache[n]).max() for n in cache)
    return new, drift


def _scatter(buf, idx, vals):
    return buf.at[idx].set(vals), jnp.mean(buf)


def _column(buf, col):
    new = buf.at[:, 3].set(col)
    return new, jnp.linalg.norm((new - buf).astype(f32))


OTHERS = {
    "kv-dict": (jax.jit(_kv_step, donate_argnums=0), CACHE, ROW, POS),
    "scatter": (
        jax.jit(_scatter, donate_argnums=0),
        S((2**24,), f32),
        S((512,), jnp.int32),
        S((512,), f32),
    ),
    "bf16-column": (
        jax.jit(_column, donate_argnums=0),
        S((16384, 2048), jnp.bfloat16),
        S((16384,), jnp.bfloat16),
    ),
}


def _mine(found):
    return [f for f in found.findings if f.case == "inplace-copy"]


@pytest.mark.parametrize("name", OTHERS)
def test_the_detector_finds_the_copy_in_programs_written_otherwise(name):
    fn, *args = OTHERS[name]
    (f,) = _mine(runbook.diagnose(fn, *args, measure_fixes=False))
    assert f.bytes >= max(a.size * a.dtype.itemsize for a in jax.tree.leaves(args)) // 2


def _scan_stack(x):
    return jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(x.shape[1]), x)


CLEAN = {
    "update-only": (jax.jit(ic.update_only, donate_argnums=0), S((2**24,), f32), S((64,), f32)),
    "undonated": (
        jax.jit(lambda b, r: (b.at[:64].set(r), b.sum())),
        S((2**24,), f32),
        S((64,), f32),
    ),
    "scan-stack": (jax.jit(_scan_stack), S((1024, 4096), f32)),
    "mlp-grad": (
        jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)),
        S((2048, 2048), f32),
        S((512, 2048), f32),
    ),
    "cumsum": (jax.jit(lambda x: jnp.cumsum(x, axis=0)), S((4096, 4096), f32)),
}


@pytest.mark.parametrize("name", CLEAN)
def test_the_detector_is_silent_on_clean_programs(name):
    fn, *args = CLEAN[name]
    assert not _mine(runbook.diagnose(fn, *args, measure_fixes=False))


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t or "cpu")
def test_the_detector_follows_the_copy_on_every_target(target):
    if target and _targets.unavailable(target):
        pytest.skip(_targets.unavailable(target))
    result = runbook.measure_case("inplace-copy", "seed", target=target)
    for variant in CASE.variants:
        found = _mine(runbook.site.diagnose_case("inplace-copy", variant.name, target=target))
        assert bool(found) == page.copies(result, variant.name), variant.name
    fixed = runbook.site.diagnose_case("inplace-copy", CASE.recommended, target=target)
    assert sum(f.bytes for f in fixed.findings) <= 0.05 * fixed.report.total
