"""On your accelerator: a case's variants on CPU and compiled for GPU and TPU targets.

Every figure for a target is a compile-time prediction made by that target's own XLA
compiler without the device (see `runbook.targets()`): on this machine, or read from the
store `nox -s store` made with the same sources and compilers (`runbook._cache`); nothing
ran on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._case import CaseResult, get_case, measure_case
from .._errors import DoesNotFitError, RunbookError
from .._measure import MemoryReport
from .._render import Table, fmt_bytes, fmt_figure
from .._targets import GPU_ALLOCATOR_SOURCE, Target, get_target, unavailable
from ._claims import Claim
from ._history import Note
from ._page import page_module

CPU = "cpu"
# Marks for a per-device total against a target's memory.
FITS, OVER_SHARE, TOO_BIG = "fits", "over the default share", "exceeds memory"


# The targets every case page compiles for. TPU v5p, v6e and TPU7x are left to the CLI
# and the API (`python -m runbook run CASE --target v6e`): their compilers take the longest
# (several seconds per program here), and a cold build of the site must stay within its
# time budget.
PAGE_TARGETS = ("h100", "h200", "a100", "l4", "t4", "v5e")
# The targets pages compare every variant on (and decide the claims on). The others get
# the reproduction and the recommended fix: TPU compiles take seconds each, and every
# variant on every target would take a cold build past its budget.
CONTRAST = ("h100", "v5e")


def available_targets(names: Sequence[str] | None = None) -> list[Target]:
    """The targets this machine can compile for (of `names`, default: `PAGE_TARGETS`)."""
    chosen = [get_target(n) for n in names or PAGE_TARGETS]
    return [t for t in chosen if unavailable(t) is None]


def worst_point(result: CaseResult) -> dict[str, Any]:
    """The grid point where the reproduction needs the most memory."""
    repro = result.select(role="reproduction")
    if not repro:
        raise RunbookError(f"{result.case}: no reproduction was measured")
    return dict(max(repro, key=lambda r: r.total).params)


def recommended(result: CaseResult, params: Mapping[str, Any]) -> MemoryReport | None:
    """The case's recommended fix at `params` (else its smallest fix), if it was measured."""
    case = get_case(result.case)
    if case.recommended:
        found = result.select(case.recommended, **params)
        return found[0] if found else None
    fixes = result.select(role="fix", **params)
    return min(fixes, key=lambda r: r.total) if fixes else None


def on_targets(
    case: str,
    *,
    scale: str = "seed",
    at: Mapping[str, Any] | None = None,
    names: Sequence[str] | None = None,
    buffers: bool = True,
    every_variant: Sequence[str] | None = CONTRAST,
) -> dict[str, CaseResult]:
    """The case on this backend and on each available target, at one grid point.

    Args:
        case: a case name.
        scale: the scale (default: the write-up's).
        at: the grid point (default: where the reproduction is worst on this backend).
        names: target names (default: every available target).
        buffers: keep each program's largest buffers (the default: `buffer_contrast` then
            reads them from the measurement cache instead of compiling again).
        every_variant: the targets to compile every variant for (None: all of them); the
            others get the reproduction and the recommended fix (`key_variants`).

    Returns:
        ``{"cpu": result, "h100": result, ...}``, this backend first.
    """
    here = measure_case(case, scale)
    point = dict(at) if at is not None else worst_point(here)
    key = key_variants(here, point)
    if buffers:
        here = measure_case(case, scale, at=point, buffers=True)
    chosen = [t.name for t in available_targets(names)]

    def one(name: str) -> CaseResult:
        every = every_variant is None or name in every_variant
        variants = None if every else key
        return measure_case(case, scale, target=name, at=point, buffers=buffers, variants=variants)

    found = parallel(one, chosen)
    return {CPU: _at(here, point), **dict(zip(chosen, found, strict=True))}


def key_variants(result: CaseResult, params: Mapping[str, Any]) -> list[str]:
    """The reproductions and the recommended fix of `result`'s case at `params`."""
    names = [r.name for r in result.select(role="reproduction", **params)]
    fix = recommended(result, params)
    return names + ([fix.name] if fix is not None else [])


def parallel(fn: Any, items: Sequence[Any]) -> list[Any]:
    """`fn` over `items` in threads, one per core: XLA's compilers release Python's lock,
    so compiles for different targets run side by side."""
    import concurrent.futures
    import contextvars
    import os

    if len(items) <= 1:
        return [fn(x) for x in items]
    with concurrent.futures.ThreadPoolExecutor(min(len(items), os.cpu_count() or 1)) as pool:
        futures = [pool.submit(contextvars.copy_context().run, fn, x) for x in items]
        return [f.result() for f in futures]


def _at(result: CaseResult, params: Mapping[str, Any]) -> CaseResult:
    """Only the programs of `result` at grid point `params`."""
    keep: Callable[[Mapping[str, Any]], bool] = lambda p: all(
        p.get(k) == v for k, v in params.items()
    )
    return CaseResult(
        result.case,
        result.scale,
        result.provenance,
        tuple(r for r in result.reports if keep(r.params)),
        tuple(s for s in result.skipped if keep(s["params"])),
    )


def fit(total: int, target: Target) -> str:
    """`FITS` within what a program may use by default, `OVER_SHARE` past that but within
    the device's memory, `TOO_BIG` past the memory."""
    if total <= target.usable():
        return FITS
    return OVER_SHARE if total <= target.memory else TOO_BIG


_MARK = {FITS: "✓", OVER_SHARE: "~", TOO_BIG: "✗"}


def _cell(result: CaseResult, name: str) -> str:
    found = result.select(name)
    if found:
        target = result.target
        mark = f" {_MARK[fit(found[0].total, target)]}" if target else ""
        return fmt_bytes(found[0].total) + mark
    entry = next((s for s in result.skipped if s["name"] == name), None)
    if entry is None:
        return "-"
    if entry["status"] == "does not fit":
        return f"✗ does not fit: needs {fmt_bytes(entry['needed'])}"
    if entry["status"] == "failed":
        return f"does not compile: {_reason(entry['reason'])}"
    status: str = entry["status"]
    return status


def _reason(text: str, limit: int = 90) -> str:
    """The compiler's own sentence, without the HLO instruction it quotes."""
    text = text.split(": ", 1)[-1] if text.startswith("XLA could not compile") else text
    text = text.split(" in %")[0].removeprefix("INVALID_ARGUMENT: ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _column(where: str, result: CaseResult) -> str:
    if where == CPU:
        return f"{result.provenance.backend.upper()} (this machine)"
    t = get_target(where)
    return f"{t.name} ({fmt_bytes(t.memory)})"


def variant_table(
    results: Mapping[str, CaseResult], cell: Callable[[MemoryReport], str], caption: str
) -> Table:
    """One row per variant of the case, one column per compiler of `results` (this backend,
    then each target: a prediction): `cell` of the variant's report there, else the status
    it was skipped with."""
    first = next(iter(results.values()))
    rows = []
    for v in get_case(first.case).variants:
        row = [v.name]
        for result in results.values():
            found = result.select(v.name)
            skipped = [e["status"] for e in result.skipped if e["name"] == v.name]
            row.append(cell(found[0]) if found else (skipped or ["not measured"])[0])
        rows.append(row)
    labels = [n if n == CPU else f"{n} (compile-time prediction)" for n in results]
    return Table(["variant", *labels], rows, caption)


def target_table(results: Mapping[str, CaseResult]) -> Table:
    """Per variant (rows), the total per device on this backend and on each target.

    ✓: within what a program may use by default (a GPU: JAX's allocator share; a TPU: the
    usable HBM XLA reports); ~: past that but within the device's memory; ✗: past it.
    """
    first = next(iter(results.values()))
    names = list(
        dict.fromkeys([*(r.name for r in first.reports), *(s["name"] for s in first.skipped)])
    )
    case = get_case(first.case)
    rows = [
        [name, case.variant(name).role, *(_cell(r, name) for r in results.values())]
        for name in names
    ]
    params = _params(first.reports[0].params if first.reports else first.skipped[0]["params"])
    p = first.provenance
    partial = [
        w for w, r in results.items() if w != CPU and len(r.reports) + len(r.skipped) < len(names)
    ]
    caption = (
        f"Total bytes per device at {params}, scale {first.scale!r}. ✓ fits what a program may "
        f"use by default (GPU: the {_share()} JAX's allocator takes, {GPU_ALLOCATOR_SOURCE}; "
        "TPU: the usable HBM XLA reports), ~ fits the device's memory but not that share, ✗ "
        f"exceeds the memory. First column: this machine, {p.label()}. Other columns: compiled "
        "by each target's own XLA compiler, without the device: predictions, not runs."
    )
    if partial:
        caption += (
            f" For {', '.join(partial)}, the page compiles the reproduction and the recommended "
            f"fix only (-: not compiled); `python -m runbook run {first.case} --target NAME` "
            "compiles every variant."
        )
    return Table(["variant", "role", *(_column(w, r) for w, r in results.items())], rows, caption)


def _params(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _share() -> str:
    from .._targets import GPU_ALLOCATOR_FRACTION

    return f"{GPU_ALLOCATOR_FRACTION:.0%}"


def memory_table(names: Sequence[str] | None = None) -> Table:
    """Each available target: its memory and what a program may use of it by default."""
    rows = [
        [t.name, t.label, fmt_bytes(t.memory), fmt_bytes(t.usable()), t.usable_rule()]
        for t in available_targets(names)
    ]
    return Table(["target", "device", "memory", "usable by default", "rule"], rows)


_FIT_WORDS = {
    FITS: "fits what a program may use there by default",
    OVER_SHARE: "fits the device's memory but not what a program may use by default",
    TOO_BIG: "exceeds the device's memory",
}


def _describe(result: CaseResult, name: str) -> str:
    found = result.select(name)
    if found:
        r = found[0]
        t = result.target
        where = f"; it {_FIT_WORDS[fit(r.total, t)]}" if t else ""
        return f"{fmt_bytes(r.total)} ({fmt_bytes(r.temp)} of temporaries{where})"
    entry = next((e for e in result.skipped if e["name"] == name), None)
    if entry and entry["status"] == "does not fit":
        return (
            f"more than one device holds (XLA counts {fmt_bytes(entry['needed'])} of "
            f"{entry['what']})"
        )
    return f"nothing: it does not compile ({_reason(entry['reason']) if entry else 'not measured'})"


def target_summary(case: str, name: str, *, scale: str = "seed") -> Note:
    """In two sentences, the reproduction and the recommended fix on target `name` against
    this machine, at the reproduction's worst point here."""
    results = on_targets(case, scale=scale, names=[name])
    if name not in results:
        return Note(f"No figures for {name}: {unavailable(name)}.")
    here, there = results[CPU], results[name]
    repro = here.select(role="reproduction")[0]
    fix = recommended(here, repro.params)
    t = get_target(name)
    text = (
        f"For {t.label} (per device), the reproduction `{repro.name}` needs "
        f"{_describe(there, repro.name)}, against {fmt_bytes(repro.total)} on this machine."
    )
    if fix is not None:
        theirs = there.select(fix.name)
        mine = there.select(repro.name)
        gain = ""
        if theirs and mine:
            ratio = mine[0].total / theirs[0].total
            gain = (
                f", {ratio:.2f}x less than the reproduction there"
                if ratio >= 1.01
                else ", no saving there"
            ) + f" (here {repro.total / fix.total:.2f}x)"
        text += f" The recommended fix `{fix.name}` needs {_describe(there, fix.name)}{gain}."
    return Note(text)


def buffer_contrast(
    case: str,
    variant: str,
    params: Mapping[str, Any],
    names: Sequence[str],
    *,
    scale: str = "seed",
    count: int = 3,
) -> Table:
    """The largest temporaries of one program on this backend and on each target in `names`."""
    wheres = [None, *(n for n in names if unavailable(n) is None)]
    rows = []
    for where in wheres:
        # Every variant at the point, as `on_targets` measured it: read from the cache.
        whole = measure_case(case, scale, target=where, at=params, buffers=True)
        result = dataclasses.replace(
            whole,
            reports=tuple(r for r in whole.reports if r.name == variant),
            skipped=tuple(s for s in whole.skipped if s["name"] == variant),
        )
        label = where or CPU
        if not result.reports:
            status = result.skipped[0]["status"] if result.skipped else "not measured"
            rows.append([label, "-", "-", "-", status, "-"])
            continue
        temps = [b for b in result.reports[0].buffers if b.kind == "temp"][:count]
        if not temps:
            rows.append([label, "0 B", "-", "-", "no temporaries", "-"])
        rows += [
            [label, fmt_bytes(b.size), b.shape, b.instruction, b.op, b.source or "-"] for b in temps
        ]
    caption = (
        f"{variant}: its {count} largest temporaries per compiler, at {_params(params)}, "
        f"scale {scale!r}, read from each compiler's buffer assignment."
    )
    return Table(
        ["compiled for", "size", "shape", "HLO instruction", "JAX op", "source"], rows, caption
    )


def fusion_table(fn: Any, *args: Any, where: Sequence[str | None] = (None, "h100")) -> Table:
    """The fused kernels of one program per compiler: what each reads and which operations
    it holds, the evidence of where a compiler put an intermediate."""
    from .._hlo import fusions
    from .._measure import compile_fn

    rows = []
    for w in where:
        if w is not None and unavailable(w) is not None:
            continue
        for f in fusions(compile_fn(fn, *args, target=w).as_text()):
            rows.append([w or CPU, f.name, f.shape, ", ".join(f.operands) or "-", ", ".join(f.ops)])
    return Table(
        ["compiled for", "fusion", "result", "reads", "operations inside"],
        rows,
        "The entry computation's fusions in each compiler's optimised program; an operation "
        "inside a fusion leaves no buffer of its own.",
    )


COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def devices_to_fit(
    case: str,
    variant: str,
    target: str,
    *,
    scale: str = "seed",
    at: Mapping[str, Any] | None = None,
) -> tuple[int | None, list[tuple[int, str]]]:
    """The fewest devices of `target` whose share of the program fits each one.

    The program's inputs are split the way the case says it splits naturally (`Case.shard`),
    over 1, 2, 4, ... devices, until the per-device total fits what a program may use.

    Returns:
        (devices, tried): the count that fits (None if none up to 256 does), and per count
        tried, the per-device total or why it did not compile.
    """
    import numpy as np
    from jax.sharding import Mesh

    from .._measure import measure
    from .._targets import target_devices

    c = get_case(case)
    if c.shard is None:
        raise RunbookError(f"case {case!r} does not say how its inputs split over devices")
    v = c.variant(variant)
    size = c.scale(scale)
    params = dict(at) if at is not None else c.grid(size)[0]
    t = get_target(target)
    tried: list[tuple[int, str]] = []
    for n in COUNTS:
        try:
            mesh = Mesh(np.array(target_devices(t, n)), ("d",))
            report = measure(v.program(params), *c.shard(size, params, mesh), target=t.name)
        except DoesNotFitError as e:
            tried.append((n, f"✗ needs {fmt_bytes(e.needed)}"))
            continue
        except RunbookError as e:
            tried.append((n, _reason(str(e), 60)))
            continue
        tried.append((n, fmt_bytes(report.total)))
        if report.total <= t.usable():
            return n, tried
    return None, tried


def devices_table(case: str, variants: Sequence[str], names: Sequence[str], **kw: Any) -> Table:
    """For each target and variant: how many devices it takes to fit, and what each holds."""
    rows = []
    for name in names:
        if unavailable(name) is not None:
            continue
        t = get_target(name)
        for variant in variants:
            n, tried = devices_to_fit(case, variant, name, **kw)
            rows.append(
                [name, variant, str(n) if n else "more than 256",
                 dict(tried)[n] if n else "-", fmt_bytes(t.usable()),
                 "; ".join(f"{k}: {v}" for k, v in tried)]
            )  # fmt: skip
    return Table(
        ["target", "variant", "devices to fit", "per device there", "usable per device",
         "per device, by device count"],
        rows,
        "Inputs split over the devices the way the program splits naturally; compile-time "
        "predictions by each target's compiler, without the devices.",
    )  # fmt: skip


def claims_by_target(
    case: str,
    names: Sequence[str],
    *,
    scale: str = "seed",
    cpu: Sequence[Claim] | None = None,
) -> dict[str, list[Claim] | str]:
    """The case's claims decided on this backend and on each target in `names`.

    Where the programs the claims rest on do not compile for a target at `scale`, they are
    decided at the case's runnable scale and the key says so; where they cannot be decided
    at all, the value is the reason. `cpu`: this backend's claims, when a page has them.
    """
    module = page_module(case)
    small = get_case(case).runnable_scale

    def decide(name: str) -> tuple[str, list[Claim] | str]:
        # Decide at the seed scale if the reproduction compiles there, else at `small`.
        seed = on_targets(case, scale=scale, names=[name])[name]
        where = scale if seed.select(role="reproduction") else small
        try:
            label = name if where == scale else f"{name} (scale {where!r})"
            return label, module.claims(target=name, scale=where)
        except RunbookError as e:
            return name, str(e)

    chosen = [n for n in names if unavailable(n) is None]
    here = list(cpu) if cpu is not None else module.claims()
    return {CPU: here, **dict(parallel(decide, chosen))}


def claims_matrix(found: Mapping[str, list[Claim] | str]) -> Table:
    """One row per claim: the verdict on each compiler, and the evidence where they differ."""
    base = found[CPU]
    assert not isinstance(base, str)
    rows = []
    for claim in base:
        verdicts, notes = [], []
        for where, claims in found.items():
            if isinstance(claims, str):
                verdicts.append("n/a")
                continue
            mine = next(c for c in claims if c.key == claim.key)
            verdicts.append(mine.verdict.upper())
            if where != CPU and mine.verdict != claim.verdict:
                notes.append(f"{where}: {mine.evidence}")
        evidence = claim.evidence + "".join(f" | {n}" for n in notes)
        rows.append([claim.claim, *verdicts, evidence])
    unmeasured = [f"{w}: {c}" for w, c in found.items() if isinstance(c, str)]
    caption = "Each verdict decided by measurements made during this build, per compiler; "
    caption += "the evidence is this machine's, then each target's where its verdict differs."
    if unmeasured:
        caption += " Not decidable: " + "; ".join(unmeasured)
    return Table(
        ["claim", *(w.upper() if w == CPU else w for w in found), "evidence"], rows, caption
    )


def accelerator_report(
    case: str, *, contrast: Sequence[str] = CONTRAST, names: Sequence[str] = PAGE_TARGETS
) -> list[Any]:
    """Everything a case page's "On your accelerator" section shows, in order.

    The targets' memory; the variants' totals per device on this backend and on every
    available target of `names` at the reproduction's worst point; the reproduction's
    largest temporaries on this backend and on the targets in `contrast`. (The claims per
    compiler are `claims_matrix(claims_by_target(...))`, shown in a case page's claims
    section.) A case whose every program is slow to compile may name fewer targets.
    """
    missing = {t: unavailable(t) for t in names if unavailable(t)}
    items: list[Any] = []
    if missing:
        items.append(
            Note(
                "Target figures unavailable on this build for "
                + "; ".join(f"{n}: {why}" for n, why in missing.items())
                + "."
            )
        )
    results = on_targets(case, names=names)
    if len(results) == 1:
        return items
    items.append(memory_table(names))
    items.append(target_table(results))
    cpu = results[CPU]
    repro = cpu.select(role="reproduction")
    if repro:
        shown = [n for n in contrast if n in names]
        items.append(buffer_contrast(case, repro[0].name, dict(repro[0].params), shown))
    return items


class Html(str):
    """HTML that a notebook renders and a terminal prints as its source."""

    def _repr_html_(self) -> str:
        return str(self)


def case_table(names: Sequence[str] | None = None, *, compare: Sequence[str] = CONTRAST) -> Html:
    """The landing page's table: per case, the reproduction against the recommended fix at
    the reproduction's worst point, on this machine and on each target in `compare`."""
    import html

    from .._case import case_names

    wheres = [CPU, *(n for n in compare if unavailable(n) is None)]
    head = ["Case", "Symptom", "Cause", "Recommended fix"]
    head += [
        f"{'This machine' if w == CPU else get_target(w).label}: before &rarr; after"
        for w in wheres
    ]
    rows, labels = [], set()
    for name in names or case_names():
        case = get_case(name)
        results = on_targets(name, names=[w for w in wheres if w != CPU])
        here = results[CPU]
        before = max(here.select(role="reproduction"), key=lambda r: r.total)
        after = recommended(here, before.params)
        fix = after.name if after else "-"
        cells = [
            f'<a href="cases/{name}.html">{html.escape(case.title.split(":")[0])}</a>',
            html.escape(case.symptom),
            html.escape(case.cause),
            f"<code>{html.escape(fix)}</code>: {html.escape(case.variant(fix).summary) if after else ''}",
        ]
        for w in wheres:
            got = results.get(w)
            if got is None:
                cells.append("-")
                continue
            labels.add(got.provenance.label())
            b = got.select(before.name)
            a = got.select(fix)
            key = case.key_figure
            if key and b and a and key in b[0].figures and key in a[0].figures:
                x, y = b[0].figures[key], a[0].figures[key]
                cells.append(
                    f"<b>{fmt_figure(key, x)} &rarr; {fmt_figure(key, y)}</b><br>"
                    f"{f'{x / y:.1f}x less' if y else 'none with the fix'} "
                    f"<small>({html.escape(key)}, a real run)</small>"
                )
            elif key and b and a:
                cells.append(
                    f"{fmt_bytes(b[0].total)} &rarr; {fmt_bytes(a[0].total)}<br><small>"
                    "compile-time totals, which leave out what this case is about</small>"
                )
            elif b and a:
                cells.append(
                    f"<b>{fmt_bytes(b[0].total)} &rarr; {fmt_bytes(a[0].total)}</b><br>"
                    f"{b[0].total / a[0].total:.1f}x less"
                )
            else:
                cells.append(html.escape(f"{_cell(got, before.name)} → {_cell(got, fix)}"))
        point = _params(before.params)
        cells[3] += f"<br><small>at {html.escape(point)}</small>"
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = (
        '<table class="runbook-table runbook-cases"><thead><tr>'
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )
    note = (
        '<p class="runbook-provenance">Compile-time bytes per device at each case\'s full '
        "scale, measured by this build: " + html.escape("; ".join(sorted(labels))) + ".</p>"
    )
    return Html(table + note)
