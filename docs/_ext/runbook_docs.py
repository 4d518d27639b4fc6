"""The site's own Sphinx extension: per-page fingerprints, the case-list check, docstrings.

Sphinx re-reads (and so re-executes) only the pages whose source changed. A page's numbers
also depend on code and data outside it, which each page names in its front matter::

    runbook:
      cases: [gather-grad]     # the case modules it measures ("all": every case)
      data: [versions, gpu]    # the folders of docs/_data it reads ("all": every one)

A case is two files, ``runbook/cases/<case>.py`` and its page module
``runbook/site/<case>.py``. Every page also depends on the measurement core (the rest of
the package) and the environment (JAX versions, backend, compiler plugins, XLA/JAX
variables). A page with no ``runbook`` key depends on everything. Before reading, the
extension compares each page's fingerprint of those inputs with the one it was last built
from and re-reads the pages whose inputs changed: editing one case's files re-executes that
case's page and the pages that show every case; editing the core re-executes every page.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Environment variables that change what XLA compiles (and so the bytes it reports).
ENV_PREFIXES = ("XLA_", "JAX_", "TPU_", "TF_CPP_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
PLUGINS = ("jax-cuda12-plugin", "libtpu", "nvidia-cuda-nvcc-cu12")
ALL = "all"


def backend() -> dict[str, Any]:
    """JAX's versions and default backend, asked of a child process.

    A child, because initialising a GPU backend in the Sphinx process would hold device
    memory that the executing pages need.
    """
    probe = (
        "import json, jax, jaxlib, numpy; d = jax.devices()[0]; print(json.dumps({"
        "'jax': jax.__version__, 'jaxlib': jaxlib.__version__, 'numpy': numpy.__version__,"
        "'backend': jax.default_backend(), 'device_kind': d.device_kind,"
        "'devices': jax.device_count()}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def environment(probe: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything outside the repository that a page's numbers depend on."""
    plugins = {}
    for dist in PLUGINS:
        try:
            plugins[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            plugins[dist] = None
    return {
        **(probe if probe is not None else backend()),
        "plugins": plugins,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}",
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
    }


def _digest(paths: Iterable[pathlib.Path], base: pathlib.Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.relative_to(base).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def case_modules(root: pathlib.Path) -> dict[str, list[pathlib.Path]]:
    """Each case's own files, by case name (every module of ``runbook/cases/`` is a case named
    for its file, as `runbook.case_names()` finds them): the case module, its page module, and
    its measurement setup and real runs where it has them
    (``runbook/{cases,cases/_setup,site,runs}/<case>.py``)."""
    package = root / "runbook"
    return {
        path.stem.replace("_", "-"): [
            package / folder / path.name for folder in ("cases", "cases/_setup", "site", "runs")
        ]
        for path in sorted((package / "cases").glob("*.py"))
        if not path.stem.startswith("_")
    }


def input_hashes(root: pathlib.Path, docs: pathlib.Path, env: Mapping[str, Any]) -> dict[str, str]:
    """A short hash per input a page may depend on: ``core``, ``env``, ``case:<name>``,
    ``data:<folder>``. A case module no registered case names counts as core."""
    package = root / "runbook"
    cases = case_modules(root)
    per_case = {p for paths in cases.values() for p in paths}
    hashes = {
        "core": _digest((p for p in package.rglob("*.py") if p not in per_case), root),
        "env": hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16],
    }
    for name, paths in cases.items():
        present = [p for p in paths if p.exists()]
        hashes[f"case:{name}"] = _digest(present, root) if present else "missing"
    data = docs / "_data"
    for folder in sorted(p for p in data.iterdir() if p.is_dir()) if data.exists() else []:
        hashes[f"data:{folder.name}"] = _digest((p for p in folder.rglob("*") if p.is_file()), docs)
    return hashes


_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.DOTALL)


def front_block(page: pathlib.Path) -> dict[str, Any]:
    """The ``runbook:`` block of a page's YAML front matter, or {}."""
    import yaml  # MyST's own dependency: it reads the same front matter

    match = _FRONT.match(page.read_text())
    front = yaml.safe_load(match[1]) if match else None
    return (front or {}).get("runbook") or {}


def declared(page: pathlib.Path) -> dict[str, list[str] | str]:
    """The ``runbook:`` block of a page's front matter: its cases and data folders."""
    block = front_block(page)
    return {"cases": block.get("cases", ALL), "data": block.get("data", ALL)}


def dependencies(page: pathlib.Path, hashes: Mapping[str, str]) -> list[str]:
    """The inputs (keys of `hashes`) a page depends on."""
    wanted = declared(page)
    keys = ["core", "env"]
    for kind in ("case", "data"):
        names = wanted["cases" if kind == "case" else "data"]
        available = [k for k in hashes if k.startswith(f"{kind}:")]
        if names == ALL:
            keys += available
        else:
            for name in names:
                if kind == "case" and f"case:{name}" not in hashes:
                    raise ValueError(f"{page.name}: unknown case {name!r} in its runbook: block")
                keys.append(f"{kind}:{name}")  # a data folder not yet recorded counts too
    return keys


def page_fingerprint(page: pathlib.Path, hashes: Mapping[str, str]) -> str:
    """A hash of the inputs `page` depends on."""
    parts = {k: hashes.get(k, "absent") for k in dependencies(page, hashes)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def dependency_rows(docs: pathlib.Path, hashes: Mapping[str, str]) -> list[list[str]]:
    """Per page: what its numbers depend on, and its fingerprint (for the status page)."""
    rows = []
    for page in sorted(docs.rglob("*.md")):
        rel = page.relative_to(docs)
        if rel.parts[0].startswith("_") or rel.name == "README.md":
            continue
        deps = dependencies(page, hashes)
        rows.append(
            [rel.with_suffix("").as_posix(), ", ".join(deps), page_fingerprint(page, hashes)]
        )
    return rows


# --- Sphinx --------------------------------------------------------------------------------


def _hashes(app: Any) -> dict[str, str]:
    if not hasattr(app, "_runbook_hashes"):
        root = pathlib.Path(app.srcdir).parent
        env = environment()
        app._runbook_hashes = input_hashes(root, pathlib.Path(app.srcdir), env)
        # The pages' kernels inherit these: the status page shows what the build hashed.
        os.environ["RUNBOOK_DOCS_INPUTS"] = json.dumps(app._runbook_hashes, sort_keys=True)
        os.environ["RUNBOOK_DOCS_ENVIRONMENT"] = json.dumps(env, sort_keys=True)
    return app._runbook_hashes


def _outdated(app: Any, env: Any, added: set[str], changed: set[str], removed: set[str]):
    hashes = _hashes(app)
    stored = getattr(env, "runbook_fingerprints", {})
    stale = []
    for docname in env.found_docs:
        if docname in added or docname in changed:
            continue
        page = pathlib.Path(env.doc2path(docname))
        if stored.get(docname) != page_fingerprint(page, hashes):
            stale.append(docname)
    return stale


def _record(app: Any, doctree: Any) -> None:
    env = app.env
    page = pathlib.Path(env.doc2path(env.docname))
    if not hasattr(env, "runbook_fingerprints"):
        env.runbook_fingerprints = {}
    env.runbook_fingerprints[env.docname] = page_fingerprint(page, _hashes(app))


def _purge(app: Any, env: Any, docname: str) -> None:
    getattr(env, "runbook_fingerprints", {}).pop(docname, None)


def _merge(app: Any, env: Any, docnames: Iterable[str], other: Any) -> None:
    if not hasattr(env, "runbook_fingerprints"):
        env.runbook_fingerprints = {}
    mine = getattr(other, "runbook_fingerprints", {})
    env.runbook_fingerprints.update({d: mine[d] for d in docnames if d in mine})


def case_toctree_problem(listed: Sequence[str], case_names: Sequence[str]) -> str | None:
    """Why the Cases toctree does not mirror the case list, or None when it does."""
    pages = [d for d in listed if d.startswith("cases/")]
    expected = [f"cases/{name}" for name in case_names]
    if pages == expected:
        return None
    return (
        f"the toctree of index.md lists case pages {pages} but runbook.case_names() gives "
        f"{expected}: add, remove or reorder the pages so the navigation mirrors the cases."
    )


def _check_case_pages(app: Any, env: Any) -> None:
    from sphinx.util import logging

    import runbook

    listed = env.toctree_includes.get(env.config.root_doc, [])
    problem = case_toctree_problem(listed, runbook.case_names())
    if problem:  # a warning: an error under -W
        logging.getLogger(__name__).warning(problem, location=env.config.root_doc)


_MARKDOWN_CODE = re.compile(r"(?<![`:\w])`([^`]+)`(?!`)")


def markdown_code(lines: list[str]) -> None:
    """Make the package's Markdown-style docstrings valid reStructuredText, in place.

    Single-backtick `code` becomes a code literal (in reST it would be a cross-reference
    to nothing, or broken markup before a letter) and ``|`` is escaped (a substitution
    reference otherwise). Doctest lines are left alone.

    Examples:
        >>> lines = ["Compile `fn` for `jax.ShapeDtypeStruct`s: |a - b|.", ">>> f(`x`)"]
        >>> markdown_code(lines)
        >>> lines[0]
        'Compile :code:`fn`\\\\  for :code:`jax.ShapeDtypeStruct`\\\\ s: \\\\|a - b\\\\|.'
        >>> lines[1]
        '>>> f(`x`)'
    """
    for i, line in enumerate(lines):
        if line.lstrip().startswith((">>>", "...")):
            continue
        line = line.replace("|", r"\|")
        lines[i] = _MARKDOWN_CODE.sub(r":code:`\1`\\ ", line)


def _process_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]):
    markdown_code(lines)


# Pages that read every case's measurements run last, so that they find them in the
# measurement cache; case pages, the heaviest, run first. The diagnose page starts before
# them: it diagnoses the corpus, minutes of work of its own, which behind the case pages
# was the build's last page, running on one core while the others idled. With the
# pre-pass (`PREPARE_VAR`), which measures the corpus before any page, it comes after them.
_ORDER = {"diagnose": -1, "cases/": 0, "index": 2, "versions": 2, "status": 3}
# The measurement pre-pass (`runbook_prepare`) runs only when this is "1", as
# docs/_tools/build_site.py sets it unless told otherwise.
PREPARE_VAR = "RUNBOOK_PREPARE"


def _priority(docname: str, prepared: bool) -> int:
    if prepared and docname == "diagnose":
        return 1
    return next((v for k, v in _ORDER.items() if docname.startswith(k)), 1)


def read_order(
    docnames: Sequence[str], seconds: Mapping[str, float], prepared: bool = False
) -> list[str]:
    """The order to execute pages in: the diagnose page (after the case pages when the
    pre-pass has measured its corpus: `prepared`), case pages, other pages, then the pages
    that read every case; within each, the longest first (by `seconds`, each page's last
    execution time).

    Examples:
        >>> pages = ["status", "index", "guide", "cases/a", "cases/b", "diagnose"]
        >>> read_order(pages, {"cases/b": 90})
        ['diagnose', 'cases/b', 'cases/a', 'guide', 'index', 'status']
        >>> read_order(pages, {"cases/b": 90, "diagnose": 60}, prepared=True)
        ['cases/b', 'cases/a', 'diagnose', 'guide', 'index', 'status']
    """
    return sorted(docnames, key=lambda d: (_priority(d, prepared), -seconds.get(d, 0.0), d))


def one_page_a_chunk(arguments: Sequence[str], nproc: int, maxbatch: int = 10) -> list[list[str]]:
    """Sphinx's parallel read, one page per task, started in the order of `arguments`.

    Sphinx splits the pages to read into equal runs of names, which can put every case page
    in one worker's run while the others idle. Pages here take seconds to minutes, so each
    is a task of its own and a worker that finishes takes the next. Sphinx's task runner
    starts the first `nproc` tasks in the order given, then, as workers free up, the task
    added last (it pops its waiting list from the end): the rest are handed over reversed.

    Examples:
        >>> one_page_a_chunk(["a", "b", "c", "d", "e"], 2)
        [['a'], ['b'], ['e'], ['d'], ['c']]
    """
    pages = [[doc] for doc in arguments]
    return pages[:nproc] + pages[nproc:][::-1]


def page_seconds(env: Any) -> dict[str, float]:
    """Each page's execution time in the build `env` last recorded (MyST-NB's data)."""
    found = {}
    for docname, data in getattr(env, "nb_metadata", {}).items():
        runtime = (data.get("exec_data") or {}).get("runtime")
        if runtime is not None:
            found[docname] = float(runtime)
    return found


def _order_reads(app: Any, env: Any, docnames: list[str]) -> None:
    # A rebuild knows each page's time from the build before; a first build takes the
    # times of the cold build that the committed benchmark timed.
    seconds = page_seconds(env) or _benchmark(app).get("docs_page_seconds", {})
    docnames[:] = read_order(docnames, seconds, prepared=_preparing())


def _preparing() -> bool:
    """Whether this build runs the measurement pre-pass (`PREPARE_VAR`) into a cache."""
    return os.environ.get(PREPARE_VAR) == "1" and bool(os.environ.get("RUNBOOK_CACHE_DIR"))


def _benchmark(app: Any) -> dict[str, Any]:
    """The committed benchmark (`nox -s bench`), or {}."""
    bench = pathlib.Path(app.srcdir) / "_data" / "bench" / "bench.json"
    return json.loads(bench.read_text()) if bench.exists() else {}


def _prepare(app: Any, env: Any, docnames: list[str]) -> None:
    """Run the slow calls the pages about to execute declare, on every core, before them
    (`runbook_prepare`): measured into the cache, which the pages then read."""
    if not _preparing():  # without a cache, what it measured would not reach the pages
        return
    import runbook_prepare  # docs/_ext, beside this module

    folder = os.environ["RUNBOOK_CACHE_DIR"]
    # For a first build's order: how long each page's measurements took, wherever they
    # were made (the measurement cache's profile of the benchmark's build).
    measuring = (_benchmark(app).get("docs_profile") or {}).get("by_page", {})
    seconds = {page: row["seconds"] for page, row in measuring.items()}
    pages = {d: pathlib.Path(env.doc2path(d)) for d in docnames}
    calls = [
        (d, call, runbook_prepare.devices(page))
        for d, page in pages.items()
        for call in runbook_prepare.declared(page)
    ]
    runbook_prepare.prepare(calls, pathlib.Path(folder), page_seconds=seconds)


def _name_page(app: Any, docname: str, source: list[str]) -> None:
    # The page about to execute, for the measurement cache's profile (runbook._cache.PAGE_VAR):
    # its kernel starts after this, in this process, and inherits the variable.
    os.environ["RUNBOOK_PAGE"] = docname


def _balance_parallel_reads() -> None:
    import sphinx.builders

    sphinx.builders.make_chunks = one_page_a_chunk  # type: ignore[attr-defined]


def setup(app: Any) -> dict[str, Any]:
    _balance_parallel_reads()
    app.connect("env-get-outdated", _outdated)
    app.connect("env-before-read-docs", _order_reads)
    app.connect("env-before-read-docs", _prepare)  # after the order: the pages it will read
    app.connect("source-read", _name_page)
    app.connect("doctree-read", _record)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("env-check-consistency", _check_case_pages)
    # After napoleon (priority 500) has turned the Google-style sections into fields.
    app.connect("autodoc-process-docstring", _process_docstring, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "env_version": 2}
