"""The CLI's JSON contract and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runbook._cli import main

ROLES = {"baseline", "reproduction", "fix"}


def run_json(capsys, *argv):
    assert main(["run", *argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def check_contract(data, case):
    assert data["case"] == case
    for key in ("backend", "jax", "jaxlib", "device_kind"):
        assert isinstance(data[key], str)
        assert data[key]
    assert isinstance(data["devices"], int)
    assert data["variants"]
    for v in data["variants"]:
        assert v["role"] in ROLES
        assert isinstance(v["params"], dict)
        b = v["bytes"]
        assert set(b) == {"argument", "output", "temp", "alias", "total"}
        assert all(isinstance(x, int) and x >= 0 for x in b.values())
        assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        assert isinstance(v["lower_bound"], int)
        assert v["lower_bound"] > 0
    assert {v["role"] for v in data["variants"]} == ROLES


def test_gather_grad_json_at_seed_scale(capsys):
    data = run_json(capsys, "gather-grad")
    check_contract(data, "gather-grad")
    assert data["devices"] == 1
    idx = next(
        v
        for v in data["variants"]
        if v["name"] == "forward" and v["params"]["index_dtype"] == "int32"
    )
    assert idx["bytes"]["argument"] >= 2048**3 * 3 * 4  # the seed's index array, never allocated


def test_pmap_loop_json_is_per_device_and_a_sweep(capsys):
    data = run_json(capsys, "pmap-loop", "--scale", "tiny")
    check_contract(data, "pmap-loop")
    assert data["devices"] == 4
    by_name = {}
    for v in data["variants"]:
        by_name.setdefault(v["name"], []).append(v["params"]["iterations"])
    assert len(by_name) >= 6
    sweeps = {tuple(sorted(k)) for k in by_name.values()}
    assert len(sweeps) == 1  # every variant measured at the same points


def test_list_names_every_case(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "gather-grad" in out
    assert "pmap-loop" in out


def test_table_output_names_provenance(capsys):
    assert main(["run", "gather-grad", "--scale", "tiny", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "grad-chunked" in out
    assert "jax" in out
    assert "per device" in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["run", "nope"], "unknown case 'nope'; valid: attention-scores, closure-constant"),
        (
            ["run", "gather-grad", "--scale", "huge"],
            "unknown scale 'huge' for case 'gather-grad'; valid: seed",
        ),
        (["run", "gather-grad", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, expected):
    proc = subprocess.run(
        [sys.executable, "-m", "runbook", *argv], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr
