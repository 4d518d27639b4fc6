"""GPU evidence: the scale choice, the writer and the loader, checked on CPU."""

from __future__ import annotations

import json

import pytest

import runbook
import runbook._subprocess
import runbook.site
from runbook._errors import RunbookError
from runbook.site.producers import gpu as _gpu

GIB = 2**30


def test_choose_scale_takes_the_largest_that_fits():
    predictions = {"seed": 224 * GIB, "small": 2 * GIB, "tiny": GIB // 1000}
    scale, reason = _gpu.choose_scale(predictions, 80 * GIB, safety=0.7)
    assert scale == "small"
    assert "too large: seed" in reason


def test_choose_scale_respects_the_safety_margin():
    predictions = {"seed": 60 * GIB, "small": 50 * GIB}
    assert _gpu.choose_scale(predictions, 80 * GIB, safety=0.7)[0] == "small"  # 56 GiB allowed
    assert _gpu.choose_scale(predictions, 80 * GIB, safety=0.8)[0] == "seed"  # 64 GiB allowed


def test_choose_scale_refuses_when_nothing_fits():
    scale, reason = _gpu.choose_scale({"seed": 100 * GIB, "small": 40 * GIB, "x": None}, 16 * GIB)
    assert scale is None
    assert reason.startswith("no scale fits: the smallest scale needs 42,949,672,960 bytes")


def test_slug_is_a_file_name():
    assert _gpu.slug("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert _gpu.slug("Tesla V100-SXM2-16GB") == "Tesla-V100-SXM2-16GB"


def test_collect_refuses_a_cpu_backend():
    with pytest.raises(RunbookError, match="no GPU"):
        _gpu.collect(["gather-grad"])


def test_committed_gpu_files_are_real_gpu_runs():
    for record in runbook.site.gpu_evidence("gather-grad") or []:
        assert record.device_kind != "cpu"
        assert record.bytes_limit > 0


def test_no_evidence_says_so_in_plain_words(tmp_path):
    assert runbook.site.gpu_evidence("pmap-loop", data_dir=tmp_path) is None
    note = runbook.site.gpu_summary("pmap-loop", data_dir=tmp_path)
    assert note.startswith("No GPU evidence has been recorded yet for `pmap-loop`")
    assert "nox -s gpu" in note._repr_markdown_()
    with pytest.raises(RunbookError, match="unknown case"):
        runbook.site.gpu_evidence("no-such-case", data_dir=tmp_path)


def _record(runtime, devices_present=1):
    case = {"case": "pmap-loop", "devices_needed": 4, "devices_present": devices_present,
            "scale": "small", "scale_reason": "it fits", "compile_time": {}, "runtime": runtime}  # fmt: skip
    return {"device_kind": "Test GPU", "devices": devices_present, "bytes_limit": 16 * GIB,
            "driver": "555.1", "platform_version": "cuda 12", "jax": "0.10.2", "jaxlib": "0.10.2",
            "generated": "2026-01-01", "cases": {"pmap-loop": case}}  # fmt: skip


def test_loader_and_renderers(tmp_path):
    serial = {"name": "serial", "role": "baseline", "params": {"iterations": 1}, "status": "ok",
              "predicted": 100 * 2**20, "measured": 110 * 2**20, "ratio": 1.1, "agrees": True}  # fmt: skip
    refused = {"name": "pmap-loop", "role": "reproduction", "params": {"iterations": 1},
               "status": "won't fit", "reason": "refusing"}  # fmt: skip
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "Test-GPU.json").write_text(json.dumps(_record([serial, refused])))
    [record] = runbook.site.gpu_evidence("pmap-loop", data_dir=tmp_path)
    assert runbook.site.gpu_evidence("gather-grad", data_dir=tmp_path) is None
    assert "Test GPU x1, driver 555.1, cuda 12" in record.label()
    table = str(runbook.site.gpu_table(record))
    assert "110.00 MiB" in table
    assert "1.10x" in table
    assert "won't fit: refusing" in table
    cpu = runbook.measure_case("pmap-loop", "tiny")  # serial and pmap-loop: same per device
    note = runbook.site.per_device_note(record, cpu)
    assert "each of their 4 devices would hold about 110.00 MiB, 440.00 MiB in all" in note
    assert "pmap-loop" in note.split("same bytes per device as")[1]


@pytest.mark.slow
def test_pipeline_end_to_end_on_cpu(tmp_path):
    # Not GPU evidence: the same code path, on the CPU backend, into a temporary folder; for
    # a case of three variants at one grid point (the pipeline is under test, not the case).
    data = _gpu.collect(["donation"], scales=["tiny"], allow_cpu=True)
    out = _gpu._matrix.write_json(data, tmp_path / "gpu" / f"{_gpu.slug(data['device_kind'])}.json")
    [record] = runbook.site.gpu_evidence("donation", data_dir=tmp_path)
    assert out.exists()
    assert record.scale == "tiny"
    assert {p["status"] for p in record.runtime} == {"ok"}
    assert len(record.runtime) == len(runbook.get_case("donation").variants)
    for peak in record.runtime:
        assert peak["predicted"] == next(
            v["bytes"]["total"] for v in record.compile_time["tiny"]["variants"]
            if v["name"] == peak["name"] and v["params"] == peak["params"]
        )  # fmt: skip


def test_no_case_is_recorded_twice_for_one_gpu():
    # Runs on different days sit in files of their own; a case in two of them for the same
    # device kind would show twice, with two dates.
    for case in runbook.case_names():
        kinds = [r.device_kind for r in runbook.site.gpu_evidence(case) or []]
        assert len(kinds) == len(set(kinds)), case


def test_corpus_peaks_refuse_a_cpu_backend_and_an_unknown_program():
    from runbook.site.corpus.real import _peaks

    with pytest.raises(RunbookError, match="no GPU"):
        _peaks.collect(["kv-cache-decode"])
    with pytest.raises(RunbookError, match="no real-corpus program 'gpt3'"):
        _peaks.collect(["gpt3"], allow_cpu=True)


def test_corpus_peaks_run_a_program_in_a_fresh_process():
    from runbook.site.corpus.real import _peaks

    row = _peaks.measure("kv-cache-decode", None, devices=1, scale="tiny")
    assert row["status"] == "ok", row
    assert row["predicted"] > 0
    assert row["measured"] > 0
    assert row["ratio"] == row["measured"] / row["predicted"]
    row = _peaks.measure("gpt2-pmap", "donation", devices=1)
    assert row["status"] == "not applicable"
    assert row["reason"] == "needs 8 devices, 1 present"


def test_corpus_peaks_keep_the_compiled_step_for_a_second_child(tmp_path):
    from runbook.site.corpus.real import _peaks

    def child():
        return runbook._subprocess.call(
            "runbook.site.corpus.real._peaks:_peak_json",
            timeout=300, name="kv-cache-decode", fix=None, scale="tiny", cache=str(tmp_path),
        )  # fmt: skip

    first, second = child(), child()
    assert (first["loaded"], second["loaded"]) == (False, True)
    assert first["predicted"] == second["predicted"]
    # A peak is the compile's when the compile reached it after the inputs were made.
    peaks = {"measured": 10, "inputs_peak": 4}
    assert _peaks._compiling({**peaks, "compile_peak": 10})
    assert not _peaks._compiling({**peaks, "compile_peak": 9})
    assert not _peaks._compiling({**peaks, "compile_peak": None})
    assert not _peaks._compiling({"measured": 10, "inputs_peak": 10, "compile_peak": 10})


@pytest.mark.parametrize("jobs", [1, 2])
def test_corpus_peaks_list_programs_as_written_first_and_keep_each_row(tmp_path, monkeypatch, jobs):
    from runbook.site.corpus.real import _peaks

    def fake(name, fix, *, devices, scale, time_limit):
        if name == "gpt2-pmap":
            return {"program": name, "fix": fix, "status": "not applicable", "reason": "8 devices"}
        return {"program": name, "fix": fix, "status": "ok", "predicted": 100 * 2**20,
                "measured": 150 * 2**20, "ratio": 1.5, "compile_peak": 150 * 2**20,
                "inputs_peak": 10 * 2**20}  # fmt: skip

    monkeypatch.setattr(_peaks, "measure", fake)
    out = tmp_path / "gpu-cpu.json"
    data = _peaks.collect(["kv-cache-decode", "gpt2-pmap"], allow_cpu=True, out=out, jobs=jobs)
    assert data["jobs"] == jobs
    assert [(r["program"], r["fix"]) for r in data["rows"]] == [
        ("gpt2-pmap", None), ("kv-cache-decode", None),
        ("gpt2-pmap", "donation"), ("gpt2-pmap", "vocab-logits"),
        ("gpt2-pmap", "attention-scores"), ("gpt2-pmap", "scan-residuals"),
        ("kv-cache-decode", "donation"),
    ]  # fmt: skip
    assert json.loads(out.read_text())["rows"] == data["rows"]
    assert _peaks.load(tmp_path)[0]["rows"] == data["rows"]
    table = _peaks.peaks_table(data)
    # A program none of whose steps ran is one row.
    assert [r[:2] for r in table.rows] == [
        ["gpt2-pmap", "as written"], ["kv-cache-decode", "as written"],
        ["kv-cache-decode", "donation"],
    ]  # fmt: skip
    assert table.rows[0][3] == "not applicable: 8 devices"
    assert table.rows[1][2:] == [
        "100.00 MiB", "150.00 MiB (reached while compiling)", "1.50x", "no", "-"
    ]  # fmt: skip
    assert table.rows[2][-1] == "0.0% (0.0%)"
    assert _peaks.peaks_summary(data) == (
        f"On the {data['device_kind']}, 2 steps ran (programs as written and with their "
        "fixes); 0 used what their compile predicted. Used more than predicted: "
        "kv-cache-decode as written (1.50x); kv-cache-decode with the donation fix (1.50x)."
    )


def test_the_recorded_corpus_peaks_follow_from_their_figures():
    from runbook._runtime import agrees
    from runbook.site.corpus.real import _peaks, programs

    names = [q.name for q in programs()]
    for data in _peaks.load():
        assert {"device_kind", "jax", "jaxlib", "generated", "libraries"} <= set(data)
        assert sorted(r["program"] for r in data["rows"] if r["fix"] is None) == sorted(names)
        for r in data["rows"]:
            if r["status"] != "ok":
                assert r["reason"]
                continue
            assert r["ratio"] == r["measured"] / r["predicted"]
            if r.get("first_compile_peak") is not None:
                # Run again only when the compile's peak hid the step's, and then loaded.
                assert r["first_compile_peak"] >= r["measured"]
                assert r["loaded"]
        table = _peaks.peaks_table(data)
        ran = [r for r in table.rows if r[5] in ("yes", "no")]
        assert len(ran) == sum(r["status"] == "ok" for r in data["rows"])
        assert sum(r[5] == "yes" for r in ran) == sum(
            agrees(r["measured"], r["predicted"]) for r in data["rows"] if r["status"] == "ok"
        )
