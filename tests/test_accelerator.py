"""The "On your accelerator" renderers, on the gather-grad case at its tiny scale."""

from __future__ import annotations

import pytest

import runbook
import runbook.site
from runbook.site import _accelerator
from runbook.site._claims import Claim

GIB = 2**30


def test_fit_against_a_gpu_uses_the_allocators_share():
    h100 = runbook.get_target("h100")
    assert runbook.site.fit(int(0.5 * h100.memory), h100) == _accelerator.FITS
    assert runbook.site.fit(int(0.9 * h100.memory), h100) == _accelerator.OVER_SHARE
    assert runbook.site.fit(2 * h100.memory, h100) == _accelerator.TOO_BIG


def test_on_targets_measures_the_same_point_everywhere():
    results = runbook.site.on_targets("gather-grad", scale="tiny", names=["h100", "v5e"])
    assert list(results) == ["cpu", "h100", "v5e"]
    points = {tuple(sorted(r.params.items())) for res in results.values() for r in res.reports}
    assert len(points) == 1
    assert results["h100"].provenance.target == "h100"
    assert results["v5e"].target is not None
    assert results["v5e"].target.platform == "tpu"


def test_target_table_has_a_column_per_compiler_and_marks_fit():
    results = runbook.site.on_targets("gather-grad", scale="tiny", names=["h100", "v5e"])
    table = runbook.site.target_table(results)
    assert len(table.columns) == 2 + 3
    assert all(len(row) == 5 for row in table.rows)
    assert any("✓" in cell for row in table.rows for cell in row)  # tiny programs fit
    assert "prediction" in table.caption


def test_targets_outside_the_contrast_get_the_reproduction_and_the_recommended_fix():
    results = runbook.site.on_targets("gather-grad", scale="tiny", names=["h100", "a100"])
    every = {r.name for r in results["cpu"].reports}
    assert {r.name for r in results["h100"].reports} == every
    assert {r.name for r in results["a100"].reports} == {"grad", "grad-chunked"} < every
    table = runbook.site.target_table(results)
    assert "For a100, the page compiles the reproduction and the recommended fix" in table.caption
    forward = next(row for row in table.rows if row[0] == "forward")
    assert forward[-1] == "-"
    assert forward[-2] != "-"
    full = runbook.site.on_targets("gather-grad", scale="tiny", names=["a100"], every_variant=None)
    assert {r.name for r in full["a100"].reports} == every


def test_a_program_too_big_for_a_chip_shows_the_compilers_count():
    results = runbook.site.on_targets("gather-grad", names=["v5e"], at={"index_dtype": "int32"})
    cells = [row[-1] for row in runbook.site.target_table(results).rows]
    assert all("does not fit: needs" in c for c in cells)


def test_target_summary_compares_the_reproduction_and_the_fix():
    note = runbook.site.target_summary("gather-grad", "h100", scale="tiny")
    assert "NVIDIA H100" in note
    assert "grad-chunked" in note


def test_claims_matrix_shows_where_verdicts_differ():
    a = [Claim("k", "a claim", "confirmed", "cpu evidence")]
    b = [Claim("k", "a claim", "refuted", "gpu evidence")]
    table = runbook.site.claims_matrix({"cpu": a, "h100": b, "v5e": "cannot compile"})
    assert table.columns == ["claim", "CPU", "h100", "v5e", "evidence"]
    assert table.rows[0][1:4] == ["CONFIRMED", "REFUTED", "n/a"]
    assert "h100: gpu evidence" in table.rows[0][4]
    assert "v5e: cannot compile" in table.caption


def test_gather_grads_copy_is_a_cpu_fusion_decision():
    # The evidence the page shows: on CPU the concatenate is a kernel of its own; on an
    # H100 it sits inside the scatter's kernel.
    import jax
    import jax.numpy as jnp

    from runbook.cases.gather_grad import loss

    args = (
        jax.ShapeDtypeStruct((8, 8, 8), jnp.float32),
        jax.ShapeDtypeStruct((1024, 3), jnp.int32),
    )
    rows = runbook.site.fusion_table(jax.grad(loss), *args, where=[None, "h100"]).rows
    cpu = [r for r in rows if r[0] == "cpu"]
    gpu = [r for r in rows if r[0] == "h100"]
    assert any("concatenate" in r[4] and "scatter" not in r[4] for r in cpu)
    assert any("concatenate" in r[4] and "scatter" in r[4] for r in gpu)


@pytest.mark.parametrize("name", ["h100", "v5e"])
def test_devices_to_fit_grows_until_each_share_fits(name):
    n, tried = runbook.site.devices_to_fit("gather-grad", "grad", name, at={"index_dtype": "int32"})
    assert n is not None
    assert n > 1
    assert [c for c, _ in tried] == list(_accelerator.COUNTS[: len(tried)])


_FUSED = """HloModule fused, entry_computation_layout={(f32[4]{0}, f32[4]{0})->(f32[4]{0}, f32[])}

%fused_exp (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %exponential.1 = f32[4]{0} exponential(%p)
}

%max_reducer (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %maximum.1 = f32[] maximum(%a, %b)
}

%fused_outer (p0: f32[4], p1: f32[4]) -> (f32[4], f32[]) {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %inner = f32[4]{0} fusion(%p0), kind=kLoop, calls=%fused_exp
  %add.1 = f32[4]{0} add(%inner, %p1)
  %constant.1 = f32[] constant(0)
  %reduce.1 = f32[] reduce(%add.1, %constant.1), dimensions={0}, to_apply=%max_reducer
  ROOT %tuple.1 = (f32[4]{0}, f32[]) tuple(%add.1, %reduce.1)
}

ENTRY %main (x: f32[4], y: f32[4]) -> (f32[4], f32[]) {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  %negate.1 = f32[4]{0} negate(%x)
  ROOT %fusion = (f32[4]{0}, f32[]) fusion(%negate.1, /*index=1*/%y), kind=kLoop, calls=%fused_outer
}
"""


def test_a_fusion_lists_what_it_reads_and_every_operation_inside():
    # A multi-output fusion counts, an operand printed after an index comment is read by its
    # name, a nested fusion's operations are the kernel's, and a reducer's are not listed.
    from runbook._hlo import Fusion, fusions

    assert fusions(_FUSED) == [
        Fusion(
            "fusion",
            "(f32[4], f32[])",
            ("negate.1", "y"),
            ("fusion", "exponential", "add", "reduce"),
        )
    ]
