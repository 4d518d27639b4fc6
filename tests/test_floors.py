"""Every case's floor is a lower bound where it is shown: total >= floor for every variant at
every grid point, on this machine's CPU and for each compile target, at seed scale.

A case's floor may differ by compiler (`Case.floor` taking ``platform``): what each check
compares is the floor the case gives for the compiler that built the program, the one shown
beside its figures. Cases added later are covered: the parameters come from
`runbook.case_names()`.

Measuring every case for three compilers takes minutes: the results go through the run's
measurement cache (tests/conftest.py), shared with the other tests that measure the same
programs.
"""

from __future__ import annotations

import pytest

import runbook
from runbook._case import CaseResult

TARGETS = (None, "h100", "v5e")
_measured: dict[tuple[str, str | None], CaseResult] = {}


def _points() -> list[tuple[str, str | None, str]]:
    return [
        (name, target, variant.name)
        for name in runbook.case_names()
        for target in TARGETS
        for variant in runbook.get_case(name).variants
    ]


def _result(name: str, target: str | None) -> CaseResult:
    if (name, target) not in _measured:
        _measured[name, target] = runbook.measure_case(name, "seed", target=target)
    return _measured[name, target]


@pytest.mark.parametrize(
    ("name", "target", "variant"),
    _points(),
    ids=[f"{n}-{t or 'cpu'}-{v}" for n, t, v in _points()],
)
def test_total_is_at_least_the_floor_shown(name: str, target: str | None, variant: str) -> None:
    result = _result(name, target)
    reports = result.select(variant)
    if not reports:
        reasons = {s["reason"] for s in result.skipped if s["name"] == variant}
        pytest.skip(f"{variant} not measured here: {'; '.join(sorted(reasons))}")
    below = [(dict(r.params), r.total, r.lower_bound) for r in reports if r.total < r.lower_bound]
    assert not below, f"total < floor (params, total, floor): {below}"


def test_pmap_loops_tpu_floor_leaves_out_the_product_the_tpu_compiler_fuses() -> None:
    # The reason the floor differs by compiler, read off the buffers: XLA's GPU compiler
    # writes one iteration's (rows, rows) product to a buffer of its own, XLA's TPU compiler
    # fuses it into its consumers and has no buffer of that size. The floor one compiler
    # needs would fail the check above on the other.
    from runbook.cases._setup import pmap_loop

    scale = runbook.get_case("pmap-loop").scales["seed"]
    product = pmap_loop.product_bytes(scale)
    found = {}
    for target in ("h100", "v5e"):
        report = runbook.measure_case(
            "pmap-loop", "seed", target=target, variants=["shard_map-fori"],
            at={"iterations": 4}, buffers=True,
        ).reports[0]  # fmt: skip
        found[target] = report
    assert any(b.size >= product for b in found["h100"].buffers if b.kind == "temp")
    assert not any(b.size >= product for b in found["v5e"].buffers if b.kind == "temp")
    v5e = found["v5e"]
    assert v5e.lower_bound == pmap_loop.floor_bytes("shard_map-fori", scale, 4, "tpu")
    assert v5e.total < pmap_loop.floor_bytes("shard_map-fori", scale, 4, "cuda")
    assert v5e.lower_bound <= v5e.total


@pytest.mark.parametrize("target", [None, "v5e"])
def test_captions_name_the_devices_each_program_ran_on(target: str | None) -> None:
    # pmap-loop's baseline runs on one device, its pmap-ed programs on four: the caption
    # names both, and the per-device count it gives first is the four.
    result = runbook.measure_case("pmap-loop", "tiny", target=target)
    devices = {r.name: r.provenance.devices for r in result.reports}
    assert devices.pop("serial") == 1
    assert set(devices.values()) == {4}
    caption = runbook.report_table(result.reports).caption
    assert "4 devices (serial on 1 device)" in caption
    assert "per device" in caption
    if target:
        assert "4 devices (serial on 1 device) of a TPU v5e target" in caption
    alone = runbook.report_table(result.select("serial")).caption
    assert "1 device" in alone
    assert "4 devices" not in alone
