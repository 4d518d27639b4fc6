"""`runbook.watch` on real training loops (`runbook.site.corpus.watched`): the real
corpus's single-device steps, run for real at their tiny scale. A steady loop draws no
finding, its first compile included; a loop that keeps each step's batch, or each step's
model, is named at the rate the live arrays grow; and once the `with` block ends the watch
holds none of the loop's arrays."""

from __future__ import annotations

import json

import pytest

from runbook import _releases
from runbook.site.corpus import watched

# flax's lm1b models call nn.SelfAttention, which flax marks as deprecated: their code, as
# their authors wrote it.
pytestmark = pytest.mark.filterwarnings(
    "ignore:SelfAttention will be deprecated:DeprecationWarning"
)

STEADY = [loop for loop in watched.LOOPS if loop.keeps == "nothing"]
LEAKS = [loop for loop in watched.LOOPS if loop.keeps != "nothing"]


def test_the_loops_cover_a_steady_state_and_two_leaks():
    assert {loop.program for loop in STEADY} >= {"lm1b", "resnet50-imagenet", "eqx-mamba"}
    assert {loop.keeps for loop in LEAKS} == {"batch", "model"}


@pytest.mark.parametrize("loop", STEADY, ids=lambda loop: loop.program)
def test_a_steady_real_loop_is_silent(loop):
    """flax.linen with dropout (lm1b, its state donated), batch norm (ResNet-50) and an
    equinox scan (Mamba): no finding, though the first step compiles the whole model."""
    w = watched.run(loop).watch
    assert w is not None
    assert w.findings == (), w
    assert max(w.compiles, key=lambda c: c.seconds).step == 1  # the model's compile
    assert w.steps == watched.STEPS


@pytest.mark.parametrize("loop", LEAKS, ids=lambda loop: f"{loop.program}-{loop.keeps}")
def test_a_leaking_real_loop_is_named_at_its_rate_and_left_alone(loop):
    seen = watched.run(loop)
    assert seen.watch is not None
    (f,) = seen.watch.findings
    assert f.case == "live-references"
    truth = seen.truth_per_step()
    assert truth > 0
    assert seen.reported_per_step() == pytest.approx(truth, rel=0.1), f.detail
    # The same loop unwatched leaves as many arrays alive after it: the watch keeps none.
    bare = watched.run(loop, watched=False)
    assert seen.after - seen.before == bare.after - bare.before


def test_the_committed_loops_cover_both_ends_and_follow_from_their_figures():
    """docs/_data/corpus/watched.json, the watch page's table: each loop at each tested
    release, and each row's verdict the one its own figures give."""
    data = json.loads(watched.OUT.read_text())
    ends = {jax for _, jax in _releases.TESTED.values()}
    assert set(data["releases"]) == ends
    loops = {(loop.program, loop.keeps) for loop in watched.LOOPS}
    for end in ends:
        assert {(r["program"], r["keeps"]) for r in data["rows"] if r["jax"] == end} == loops
    for r in data["rows"]:
        assert r["longest_compile"]["step"] == 1, r
        assert r["left_watched"] == r["left_unwatched"], r
        if r["keeps"] == "nothing":
            assert r["cases"] == [], r
        else:
            assert r["cases"] == ["live-references"], r
            assert r["reported_per_step"] == pytest.approx(r["truth_per_step"], rel=0.1), r
    assert "watched.json" in watched.table(data).caption
