"""A case's reproduction against its recommended fix over program order (the case pages'
timelines): `runbook.site.case_timelines`, and the record a cache or a child keeps."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import matplotlib
import pytest

import runbook
from runbook._timeline import Timeline
from runbook.site import _timelines
from runbook.site._timelines import case_timelines

matplotlib.use("Agg")


def chain(a, b):
    return jnp.tanh(a @ b) @ b


MAT = jax.ShapeDtypeStruct((256, 256), jnp.float32)


def test_record_round_trip():
    t = runbook.timeline(chain, MAT, MAT)
    back = Timeline.from_record(json.loads(json.dumps(t.to_record())))
    assert back.peak == t.peak
    assert back.position == t.position
    assert dict(back.live) == dict(t.live)
    assert back.at_peak == t.at_peak
    assert back.report == t.report
    assert back == t
    assert back.peak + sum(back.idle.values()) == back.total


def _check(found, case):
    import matplotlib.pyplot as plt

    c = runbook.get_case(case)
    assert [role for role, _ in found.programs] == ["reproduction", "fix"]
    repro, fix = found.reproduction, found.fix
    assert fix is not None
    assert fix.name == c.recommended
    assert c.variant(repro.name).role == "reproduction"
    for _, t in found.programs:  # every allocation counted: the peak and the idle bytes
        assert t.peak + sum(t.idle.values()) == t.total
        assert t.provenance.devices == c.devices
    fig = found.figure()
    try:
        axes = fig.get_axes()
        assert len(axes) == 2
        assert axes[0].get_ylim() == axes[1].get_ylim()  # one scale: heights compare
        assert all("CPU" in ax.get_title() and jax.__version__ in ax.get_title() for ax in axes)
    finally:
        plt.close(fig)
    table = found.table()
    assert [row[0] for row in table.rows] == [repro.name, fix.name]
    assert runbook.fmt_bytes(repro.peak) in table.rows[0]
    assert f"{c.devices} device" in table.caption
    assert "CPU" in table.caption
    note = str(found.note())
    assert all(x in note for x in (repro.name, fix.name, repr(found.scale)))


def test_a_single_device_case(tmp_path, monkeypatch):
    monkeypatch.setenv("RUNBOOK_CACHE_DIR", str(tmp_path))
    found = case_timelines("inplace-copy", "tiny")
    _check(found, "inplace-copy")
    assert found.params == runbook.site.worst_point(runbook.measure_case("inplace-copy", "tiny"))

    def fail(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(_timelines, "_records", fail)  # cached: nothing is compiled again
    again = case_timelines("inplace-copy", "tiny")
    assert again == found


def test_a_multi_device_case_compiles_in_a_child():
    if jax.device_count() >= 4:
        pytest.skip("this process has the devices: no child")
    found = case_timelines("pmap-loop", "tiny")
    _check(found, "pmap-loop")
    assert "4 devices, per device" in found.label()


def test_a_grid_point_can_be_chosen():
    c = runbook.get_case("gather-grad")
    worst = runbook.site.worst_point(runbook.measure_case("gather-grad", "tiny"))
    other = next(p for p in c.grid(c.scales["tiny"]) if p != worst)
    found = case_timelines("gather-grad", "tiny", at=other)
    assert found.params == other


def test_a_case_shown_on_a_target_is_drawn_for_it():
    from runbook import _targets

    if why := _targets.unavailable("v5e"):
        pytest.skip(why)
    found = case_timelines("tpu-padding", "tiny", target="v5e")
    assert not found.elsewhere
    assert [t.name for _, t in found.programs] == ["ndhwc-conv", "depthwise-width"]
    assert all("v5e" in t.provenance.label() for _, t in found.programs)
    assert "v5e" in found.table().caption
    here = case_timelines("tpu-padding", "tiny")
    assert found.reproduction.peak > here.reproduction.peak  # the tiles' padding


def test_an_unavailable_target_is_drawn_here_and_says_why(monkeypatch):
    from runbook import _targets

    monkeypatch.setattr(_targets, "unavailable", lambda name: "no compiler for it here")
    found = case_timelines("tpu-padding", "tiny", target="v5e")
    assert found.elsewhere == "Compiled here, not for the v5e: no compiler for it here."
    assert found.elsewhere in found.table().caption
    assert found.elsewhere in str(found.note())
    assert "CPU" in found.label()


@pytest.mark.parametrize("case", runbook.case_names())
def test_every_case_page_draws_its_timelines(case):
    # The browser check fails a case page without its chart; this catches it before a build.
    page = (pathlib.Path(__file__).parents[1] / "docs" / "cases" / f"{case}.md").read_text()
    assert f'runbook.site.case_timelines("{case}"' in page
    assert "```{glue:figure} timelines" in page
