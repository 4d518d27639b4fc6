"""tpu-padding: the padding on each compiler, the floor, the same-result check, the claims and
the detector on programs written differently."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import runbook
from runbook import _targets
from runbook._buffers import Buffer
from runbook.cases import tpu_padding as tp
from runbook.cases.tpu_padding import CASE
from runbook.site import tpu_padding as page

TARGETS = [None, "h100", "v5e"]
S, f32 = jax.ShapeDtypeStruct, jnp.float32
SEED = CASE.scales["seed"]
VOLUME = tp.logical_bytes(SEED, SEED["channels"])[0]


def _need(target):
    if target and _targets.unavailable(target):
        pytest.skip(_targets.unavailable(target))


@pytest.fixture(scope="module", params=TARGETS, ids=lambda t: t or "cpu")
def seed(request, timed):
    _need(request.param)
    return timed("tpu-padding", target=request.param, buffers=True)


@pytest.fixture(scope="module")
def v5e():
    _need("v5e")
    return runbook.measure_case("tpu-padding", "seed", target="v5e", buffers=True)


def test_verdicts_are_the_ones_this_release_recorded(recorded):
    assert {c.key: c.verdict for c in page.claims()} == recorded("tpu-padding")


def test_measured_within_a_minute_per_target(seed):
    result, seconds = seed
    assert {r.name for r in result.reports} == {v.name for v in CASE.variants}
    assert seconds < 60


def test_every_variant_is_at_or_above_its_floor(seed):
    for report in seed[0].reports:
        assert report.lower_bound == tp.floor_bytes(SEED, SEED["channels"])
        assert report.total >= report.lower_bound, report.name


def test_only_a_tpu_pads_the_reproduction(seed):
    result = seed[0]
    padded = page.padded_bytes(result.one("ndhwc-conv"))
    if result.provenance.backend == "tpu":
        assert padded >= page.PADDED * VOLUME
    else:
        assert padded == 0


def test_on_a_tpu_the_fix_is_far_smaller_and_naming_channels_first_is_not(v5e):
    repro, fix = v5e.one("ndhwc-conv"), v5e.one(CASE.recommended)
    assert repro.total >= 1.5 * fix.total
    assert page.padded_bytes(fix) < 0.1 * page.padded_bytes(repro)
    assert v5e.one("channels-first").total == repro.total
    worst = page.most_padded(repro)
    assert worst is not None
    assert page.expansion(worst) >= 64


def test_padding_counts_what_a_buffer_holds_beyond_its_shape():
    shape = "f32[8,2176,8,132,1]"
    logical = 8 * 2176 * 8 * 132 * 4
    assert page.padding(Buffer(128 * logical, shape, "temp", "fusion", "", "")) == 127 * logical
    assert page.padding(Buffer(logical, shape, "temp", "fusion", "", "")) == 0
    # The allocator's rounding of a scalar is not padding.
    assert page.padding(Buffer(512, "s32[]", "temp", "fusion", "", "")) == 0


def test_the_same_result_check_passes_for_the_fixes_and_can_fail():
    checks = runbook.verify("tpu-padding")
    assert {c["name"] for c in checks} == {"channels-first", "depthwise-width"}
    assert all(c["same"] for c in checks), checks
    # A kernel flipped along the height is told apart.
    x, k = CASE.args(CASE.scales["small"], {"channels": 2}, True)
    want = np.asarray(tp.conv_few_channels(x, k))
    got = np.asarray(tp.conv_depthwise_over_width(x, k[:, ::-1]))
    assert float(np.max(np.abs(got - want) / (np.abs(want) + 1))) > CASE.tolerance


def test_the_claims_on_a_tpu():
    _need("v5e")
    found = {c.key: c.verdict for c in page.claims(target="v5e")}
    assert found["few-channels-padded"] == "confirmed"
    assert found["tiles-128"] == "confirmed"
    assert found["channels-first"] == "refuted"
    # The advice's arrays, each a program's input and output, as the compiler stores them.
    stored = page.stored_layout("points f32[N, 3]", "v5e")
    growth = stored["stored"] / stored["logical"]
    assert found["small-last-dim"] == ("confirmed" if growth >= 8 else "refuted")


def test_the_claims_of_tiles_are_not_decided_on_a_cpu():
    found = {c.key: c.verdict for c in page.claims()}
    assert found["tiles-128"] == "not reproducible here"
    assert set(found.values()) == {"not reproducible here"}


# Written unlike the case: 2-D convolutions of grayscale and RGB images, whose few channels
# or features the compiler pads too; and a clean program of large dimensions.
def _conv2d(x, k):
    return jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _matmul(a, b):
    return jnp.tanh(a @ b)


def _cases(result):
    return [f.case for f in result.findings]


def test_the_detector_names_the_padding_on_a_tpu_only():
    _need("v5e")
    x, k = CASE.args(SEED, {"channels": 2}, False)
    repro = jax.jit(tp.conv_few_channels)
    assert _cases(runbook.diagnose(repro, x, k, target="v5e")) == ["tpu-padding"]
    assert "tpu-padding" not in _cases(runbook.diagnose(repro, x, k))
    fixed = runbook.diagnose(jax.jit(tp.conv_depthwise_over_width), x, k, target="v5e")
    assert "tpu-padding" not in _cases(fixed)


@pytest.mark.parametrize(
    ("image", "kernel"),
    [((64, 512, 512, 1), (3, 3, 1, 8)), ((16, 256, 256, 3), (3, 3, 3, 16))],
    ids=["gray-to-8", "rgb-to-16"],
)
def test_the_detector_on_convolutions_written_otherwise(image, kernel):
    _need("v5e")
    args = S(image, f32), S(kernel, f32)
    found = runbook.diagnose(jax.jit(_conv2d), *args, target="v5e").findings
    (named,) = [f for f in found if f.case == "tpu-padding"]
    report = runbook.measure(jax.jit(_conv2d), *args, target="v5e", buffers=True)
    # What it names is padding the compiler really stored, and no more than there is.
    assert 0.1 * report.total <= named.bytes <= page.padded_bytes(report)
    assert "tpu-padding" not in _cases(runbook.diagnose(jax.jit(_conv2d), *args))


def test_the_detector_is_silent_on_large_dimensions():
    _need("v5e")
    args = S((4096, 4096), f32), S((4096, 4096), f32)
    assert "tpu-padding" not in _cases(runbook.diagnose(jax.jit(_matmul), *args, target="v5e"))
