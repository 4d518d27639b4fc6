"""The site's build command: a lost page kernel is built again once, and a death explained."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def build_site(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("build_site", ROOT / "docs/_tools/build_site.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "STDERR_DIR", tmp_path / "stderr")
    monkeypatch.setattr(module, "CACHE", tmp_path / "cache")
    return module


def test_the_build_says_where_its_compiles_for_targets_came_from(build_site):
    from runbook import _cache

    assert build_site.USED == _cache.USED
    build_site.CACHE.mkdir()
    (build_site.CACHE / build_site.USED).write_text(
        "a\tstored\nb\tmade\na\tcached\nc\tcached\nd\tstored\n"
    )
    assert build_site.target_compiles().endswith(
        "2 read from docs/_store, 1 from this machine's cache, 1 compiled now"
    )


@pytest.mark.parametrize(
    ("first", "builds"),
    [("PORT_TAKEN", 2), ("KERNEL_DIED", 2), (None, 1)],
)
def test_a_lost_kernel_builds_again_once_and_nothing_else_does(
    build_site, monkeypatch, first, builds
):
    calls = []

    def fake(output):
        calls.append(output)
        return (1, getattr(build_site, first) if first else None) if len(calls) == 1 else (0, None)

    monkeypatch.setattr(build_site, "build", fake)
    assert build_site.main(["out"]) == (0 if builds == 2 else 1)
    assert len(calls) == builds


def test_a_kernel_that_dies_twice_fails_with_its_last_words(build_site, monkeypatch, capsys):
    monkeypatch.setattr(build_site, "build", lambda output: (1, build_site.KERNEL_DIED))
    assert build_site.main(["out"]) == 1
    out = capsys.readouterr().out
    assert out.count("no process died inside a capture") == 2
    assert "MemAvailable" in out


def _die_inside_a_capture(folder: Path, abort: bool) -> None:
    code = (
        "import os\n"
        "from runbook._quiet import plugin_chatter\n"
        "with plugin_chatter():\n"
        "    os.write(2, b'F1125 check failed: the last words\\n')\n"
        f"    {'os.abort()' if abort else 'pass'}\n"
    )
    env = {**os.environ, "RUNBOOK_STDERR_DIR": str(folder), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=120, check=False)  # fmt: skip
    assert (done.returncode < 0) == abort, done.stderr


def test_the_last_words_of_a_process_that_died_in_a_capture_are_shown(build_site):
    _die_inside_a_capture(build_site.STDERR_DIR, abort=True)
    words = build_site.last_words()
    assert "F1125 check failed: the last words" in words
    assert words.startswith("--- stderr-")


def test_a_capture_that_ends_leaves_no_file(build_site):
    _die_inside_a_capture(build_site.STDERR_DIR, abort=False)
    assert list(build_site.STDERR_DIR.glob("*")) == []
    assert build_site.last_words() == "no process died inside a capture of its C++ log"


@pytest.mark.parametrize(("given", "expected"), [(None, "1"), ("0", "0")])
def test_the_build_runs_the_pre_pass_unless_told_not_to(build_site, monkeypatch, given, expected):
    # The pre-pass (docs/_ext/runbook_prepare.py) runs in every build: nox -s docs and Read
    # the Docs both build with build_site.py.
    seen = {}

    class Sphinx:
        def __init__(self, command, **kwargs):
            seen.update(kwargs["env"])
            self.stdout, self.returncode = iter(["build succeeded.\n"]), 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    if given is None:
        monkeypatch.delenv("RUNBOOK_PREPARE", raising=False)
    else:
        monkeypatch.setenv("RUNBOOK_PREPARE", given)
    monkeypatch.setattr(build_site.subprocess, "Popen", Sphinx)
    assert build_site.build("out") == (0, None)
    assert seen["RUNBOOK_PREPARE"] == expected
