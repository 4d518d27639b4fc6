"""The version matrix: unmeasurable programs become data, and the committed files are complete."""

from __future__ import annotations

import datetime
import importlib
import json
import time

import jax
import jax.numpy as jnp
import pytest

import runbook
import runbook.site
from runbook._case_types import Case, Variant
from runbook._errors import RunbookError
from runbook._releases import RELEASES
from runbook.site._history import PROBLEM_RATIO, history, load_versions, release_key
from runbook.site.producers import matrix as _matrix


def _fake_case(*variants: Variant) -> Case:
    return Case(
        name="fake", title="fake", symptom="fake", devices=1, scales={"seed": {"n": 8}},
        variants=variants,
        args=lambda scale, params, concrete: (jax.ShapeDtypeStruct((scale["n"],), jnp.float32),),
        grid=lambda scale: [{"k": 1}, {"k": 2}],
    )  # fmt: skip


def _in_process_call(target, /, *, devices=1, timeout=0, **kwargs):
    """Stands in for a child process: same target, same JSON round trip."""
    module, _, name = target.partition(":")
    return json.loads(json.dumps(getattr(importlib.import_module(module), name)(**kwargs)))


@pytest.fixture
def fake(monkeypatch):
    def install(case: Case, call=_in_process_call):
        monkeypatch.setattr(_matrix, "get_case", lambda name: case)
        monkeypatch.setattr(_matrix._subprocess, "call", call)
        return case

    return install


def _boom(params):
    def fn(x):
        raise ValueError("no such primitive in this release")

    return fn


def test_missing_api_is_not_applicable_and_nothing_runs(fake):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a variant whose API is missing was compiled")

    fake(_fake_case(Variant("new", "fix", "needs a future API", lambda p: lambda x: jnp.sin(x),
                            since="jax.api_from_the_future")), call=must_not_run)  # fmt: skip
    result = _matrix.run_case("fake")
    assert result["variants"] == []
    assert [e["status"] for e in result["skipped"]] == ["not applicable"] * 2
    assert result["skipped"][0]["reason"] == "needs jax.api_from_the_future"


def test_missing_keyword_is_not_applicable():
    case = _fake_case(
        Variant("a", "fix", "", lambda p: lambda x: jnp.sin(x), since="jax.lax.map(batch_size=)"),
        Variant(
            "b", "fix", "", lambda p: lambda x: jnp.sin(x), since="jax.lax.map(no_such_keyword=)"
        ),
    )
    assert case.available(case.variants[0])
    assert not case.available(case.variants[1])


def test_failing_variant_is_failed_with_its_reason(fake):
    fake(_fake_case(
        Variant("ok", "reproduction", "", lambda p: lambda x: jnp.sin(x)),
        Variant("broken", "fix", "", _boom),
    ))  # fmt: skip
    result = _matrix.run_case("fake")
    assert [(e["name"], e["status"]) for e in result["variants"]] == [("ok", "ok")] * 2
    assert result["variants"][0]["bytes"]["argument"] == 8 * 4
    broken = result["skipped"]
    assert [e["status"] for e in broken] == ["failed", "failed"]
    assert broken[0]["reason"].endswith("no such primitive in this release")


def test_child_that_dies_is_failed_with_its_last_words(fake):
    def crash(*args, **kwargs):
        raise RunbookError("child process for x failed (exit -11):\nFatal Python error: Segfault")

    fake(_fake_case(Variant("ok", "reproduction", "", lambda p: lambda x: jnp.sin(x))), call=crash)
    entry = _matrix.run_case("fake")["skipped"][0]
    assert (entry["status"], entry["reason"]) == ("failed", "Fatal Python error: Segfault")


def test_xla_instruction_dump_is_cut_from_the_reason():
    reason = "XLA could not compile `f`: UNIMPLEMENTED: too big. This error occurred for %s = f32[]"
    assert _matrix.one_line(reason) == "XLA could not compile `f`: UNIMPLEMENTED: too big."
    assert len(_matrix.one_line("x" * 1000)) == 300


def test_timeout_is_recorded_and_larger_points_not_attempted():
    # A real child, killed: no process starts and imports JAX in 50 ms.
    result = _matrix.run_case("gather-grad", "tiny", time_limit=0.05)
    assert result["variants"] == []
    statuses = {(e["name"], e["params"]["index_dtype"]): e["status"] for e in result["skipped"]}
    assert statuses[("grad", "int32")] == "timeout"
    assert statuses[("grad", "int16")] == "not attempted"
    timeout = next(e for e in result["skipped"] if e["status"] == "timeout")
    assert timeout["seconds"] == 0.05
    assert "0.05 s" in timeout["reason"]


def test_children_measure_what_measure_case_measures():
    result = _matrix.run_case("gather-grad", "tiny")
    expected = runbook.measure_case("gather-grad", "tiny")
    got = {(v["name"], v["params"]["index_dtype"]): v["bytes"]["total"] for v in result["variants"]}
    assert got == {(r.name, r.params["index_dtype"]): r.total for r in expected.reports}
    assert result["skipped"] == []
    assert all(v["compile_seconds"] > 0 for v in result["variants"])


# The committed matrix.

REQUIRED = ("jax", "jaxlib", "backend", "generated", "machine", "host", "elapsed_seconds",
            "session_seconds", "cases")  # fmt: skip
CASE_KEYS = ("case", "scale", "backend", "jax", "jaxlib", "device_kind", "devices", "machine",
             "generated", "variants", "skipped")  # fmt: skip


def test_committed_matrix_covers_the_release_list():
    releases = [r["jax"] for r in load_versions()]
    assert len(releases) >= 6
    assert releases == sorted(RELEASES, key=release_key)
    assert release_key(releases[0]) <= release_key("0.4.30")


@pytest.mark.parametrize("release", load_versions(), ids=lambda r: r["jax"])
def test_committed_file_has_provenance_and_cli_shape(release):
    for key in REQUIRED:
        assert release[key], f"{release['jax']}: missing {key}"
    assert release["jax"] == release["jaxlib"]
    datetime.date.fromisoformat(release["generated"])
    assert set(release["cases"]) == set(runbook.case_names())
    for name, case in release["cases"].items():
        assert all(key in case for key in CASE_KEYS), name
        assert case["jax"] == release["jax"]
        for entry in case["variants"]:
            assert entry["status"] == "ok"
            b = entry["bytes"]
            assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]
        for entry in case["skipped"]:
            assert entry["status"] in _matrix.STATUSES[1:]
            assert entry["reason"]


# What the case pages say, from synthetic files.


def _release(version: str, repro: int | str, fix: int | str) -> dict:
    def entry(name, role, total):
        if isinstance(total, int):
            b = {"argument": total, "output": 0, "temp": 0, "alias": 0, "total": total}
            return {"name": name, "role": role, "params": {"k": 1}, "bytes": b,
                    "compile_seconds": 0.5, "status": "ok"}  # fmt: skip
        return {"name": name, "role": role, "params": {"k": 1}, "status": total,
                "reason": "because", "seconds": 3.0}  # fmt: skip

    entries = [entry("repro", "reproduction", repro), entry("fix", "fix", fix)]
    case = {"case": "c", "devices": 1, "variants": [e for e in entries if e["status"] == "ok"],
            "skipped": [e for e in entries if e["status"] != "ok"]}  # fmt: skip
    return {"jax": version, "jaxlib": version, "backend": "cpu", "generated": "2026-01-01",
            "host": {"cpu": "test"}, "cases": {"c": case}}  # fmt: skip


def _history(tmp_path, *releases):
    (tmp_path / "versions").mkdir()
    for r in releases:
        (tmp_path / "versions" / f"{r['jax']}.json").write_text(json.dumps(r))
    return history("c", data_dir=tmp_path)


def test_statement_present_everywhere(tmp_path):
    h = _history(tmp_path, _release("0.10.0", 300, 100), _release("0.9.0", 300, 100))
    assert [r.jax for r in h.releases] == ["0.9.0", "0.10.0"]
    assert "present in jax 0.9.0 (the oldest release measured)" in h.statement()
    assert "no release fixed it" in h.statement()


def test_statement_fixed_and_unmeasurable(tmp_path):
    h = _history(
        tmp_path, _release("0.4.30", "failed", 100), _release("0.5.0", 300, 100),
        _release("0.6.0", int(100 * PROBLEM_RATIO) - 1, 100),
    )  # fmt: skip
    assert h.releases[0].present is None
    assert "present from jax 0.5.0 to 0.5.0; fixed in 0.6.0" in h.statement()
    assert "not measurable in 0.4.30" in h.statement()
    assert "failed" in str(h.table())


def test_statement_since_the_first_release_that_compiles(tmp_path):
    h = _history(tmp_path, _release("0.5.0", "failed", 100), _release("0.6.0", 300, 100))
    assert "present in jax 0.6.0 (the first release that could compile both)" in h.statement()
    assert h.statement().endswith("no release fixed it (not measurable in 0.5.0: see the table).")


def test_statement_absent(tmp_path):
    h = _history(tmp_path, _release("0.5.0", 100, 100))
    assert "absent from every measured release" in h.statement()


def test_a_target_measured_without_the_case_says_so(tmp_path):
    # A later `--case` run compiled other cases for the H100: this case is not measured there.
    older = {**_release("0.6.0", 300, 100), "targets": {"h100": {"status": "ok", "cases": {}}}}
    (tmp_path / "versions").mkdir()
    (tmp_path / "versions" / "0.6.0.json").write_text(json.dumps(older))
    h = history("c", target="h100", data_dir=tmp_path)
    assert h.releases[0].present is None
    assert "not measured" in str(h.table())
    assert "measured without this case" in h.releases[0].notes["repro"]


def test_no_files_is_a_clear_error(tmp_path):
    with pytest.raises(RunbookError, match="nox -s versions"):
        load_versions(tmp_path)


def test_merging_a_cases_run_into_a_release_file_keeps_the_others():
    old = {"jax": "1", "elapsed_seconds": 10.0, "cases": {"a": 1, "b": 2},
           "targets": {"h100": {"status": "ok", "cases": {"a": 1, "b": 2}}}}  # fmt: skip
    new = {"jax": "1", "elapsed_seconds": 5.0, "cases": {"b": 3, "c": 4},
           "targets": {"h100": {"status": "ok", "cases": {"b": 3, "c": 4}}}}  # fmt: skip
    merged = _matrix.merge(old, new)
    assert merged["cases"] == {"a": 1, "b": 3, "c": 4}
    assert merged["targets"]["h100"]["cases"] == {"a": 1, "b": 3, "c": 4}
    assert merged["elapsed_seconds"] == 15.0
    assert "session_seconds" not in merged  # neither run recorded one
    timed = _matrix.merge({**old, "session_seconds": 40.0}, {**new, "session_seconds": 20.0})
    assert timed["session_seconds"] == 60.0
    # A run outside nox has no session time: the sum would be short, so the file has none.
    assert "session_seconds" not in _matrix.merge(old, {**new, "session_seconds": 20.0})
    with pytest.raises(RunbookError, match="cannot merge"):
        _matrix.merge(old, {**new, "jax": "2"})


def test_main_records_the_session_time_that_nox_started(tmp_path, monkeypatch):
    monkeypatch.setattr(_matrix, "run_matrix", lambda *a, **k: {"jax": "1", "cases": {}})
    out = tmp_path / "1.json"
    monkeypatch.delenv("RUNBOOK_SESSION_STARTED", raising=False)
    assert _matrix.main(["--out", str(out)]) == 0
    assert "session_seconds" not in json.loads(out.read_text())
    monkeypatch.setenv("RUNBOOK_SESSION_STARTED", repr(time.time() - 30))
    assert _matrix.main(["--out", str(out)]) == 0
    assert 30 <= json.loads(out.read_text())["session_seconds"] < 60


def test_matrix_time_adds_up_what_the_files_recorded():
    a = {"elapsed_seconds": 60.0, "session_seconds": 90.0}
    b = {"elapsed_seconds": 120.0, "session_seconds": 150.0}
    assert runbook.site.matrix_time([a, b]) == (
        "Measuring took 3.0 min over 2 releases; the sessions, installing each environment, "
        "took 4.0 min."
    )
    partial = runbook.site.matrix_time([a, {"elapsed_seconds": 120.0}])
    assert partial.startswith("Measuring took 3.0 min over 2 releases, plus installing")


@pytest.mark.parametrize(
    "release", [r for r in load_versions() if "claims" in r], ids=lambda r: r["jax"]
)
def test_recorded_claims_have_a_verdict_each(release):
    from runbook.site._claims import VERDICTS

    claims = release["claims"]
    datetime.date.fromisoformat(claims["generated"])
    assert set(claims["cases"]) <= set(runbook.case_names())
    for name, found in claims["cases"].items():
        assert found["status"] == "ok", (name, found.get("reason"))
        assert found["claims"], name
        assert all(c["verdict"] in VERDICTS and c["evidence"] for c in found["claims"]), name


def test_the_newest_release_has_every_case_s_claims():
    newest = load_versions()[-1]
    assert set(newest.get("claims", {}).get("cases", {})) == set(runbook.case_names())


def test_claims_by_release_shows_each_release_s_verdicts_and_says_where_none():
    def release(jax, verdict):
        claims = {"cases": {"c": {"status": "ok", "claims": [
            {"key": "k", "claim": "It holds.", "verdict": verdict, "evidence": "e"}]}}}  # fmt: skip
        return {"jax": jax, "claims": claims} if verdict else {"jax": jax}

    from runbook.site._history import claims_by_release

    table = claims_by_release("c", [release("0.4.30", None), release("0.10.2", "confirmed"),
                                    release("0.12.0.1", "refuted")])  # fmt: skip
    assert table.columns == ["claim", "0.10.2", "0.12.0.1"]
    assert table.rows == [["It holds.", "confirmed", "refuted"]]
    assert "0.4.30: not recorded" in table.caption
