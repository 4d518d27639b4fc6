"""Real peaks in fresh processes, and the refusal to run what would not fit."""

from __future__ import annotations

import subprocess
import sys

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


def test_real_runs_take_turns_across_processes_and_a_holders_children_share_its_turn(tmp_path):
    # Two processes each hold the turn for a while and log when; their holds must not overlap.
    script = tmp_path / "hold.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from runbook._host import one_real_run_at_a_time\n"
        "with one_real_run_at_a_time():\n"
        "    began = time.monotonic()\n"
        "    time.sleep(0.5)\n"
        "    # a child started inside the turn takes it at once instead of waiting forever\n"
        "    subprocess.run([sys.executable, '-c', 'from runbook._host import "
        "one_real_run_at_a_time as t\\nwith t(): pass'], check=True, timeout=30)\n"
        "    print(began, time.monotonic())\n"
    )
    runs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]  # fmt: skip
    spans = sorted(tuple(map(float, run.communicate(timeout=60)[0].split())) for run in runs)
    assert all(run.returncode == 0 for run in runs)
    assert spans[0][1] <= spans[1][0], spans
