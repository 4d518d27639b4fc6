"""Real peaks in fresh processes, and the refusal to run what would not fit."""

from __future__ import annotations

import pytest

import runbook


def test_refuses_what_would_not_fit():
    with pytest.raises(
        runbook.WontFitError, match="refusing to run gather-grad/grad at scale 'seed'"
    ):
        runbook.runtime_peak(
            "gather-grad", "grad", scale="seed", params={"index_dtype": "int32", "chunk": 2**22}
        )


def test_reproduction_peak_matches_prediction():
    peak = runbook.runtime_peak(
        "gather-grad", "grad", params={"index_dtype": "int32", "chunk": 2**20}
    )
    assert peak.predicted > 256 * 2**20
    assert peak.agrees, (peak.measured, peak.predicted)
    assert peak.seconds > 0


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(
        runbook.UnknownNameError,
        match="unknown variant 'nope' of case 'gather-grad'; valid: forward",
    ):
        runbook.runtime_peak("gather-grad", "nope")


def test_disagreement_is_flagged():
    fine = runbook.RuntimePeak(
        "v", {}, predicted=2**30, measured=2**30 + 2**20, seconds=0.0, method="m"
    )
    hidden = runbook.RuntimePeak("v", {}, predicted=2**20, measured=2**30, seconds=0.0, method="m")
    assert fine.agrees
    assert not hidden.agrees
    assert hidden.ratio == 1024
