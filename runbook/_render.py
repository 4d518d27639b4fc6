"""Renderings of measurements: terminal text, HTML tables for notebooks, charts."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from ._buffers import Buffer
from ._measure import MemoryReport
from ._provenance import label_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def fmt_bytes(n: float) -> str:
    """Bytes in binary units, e.g. ``fmt_bytes(3 * 2**30) == '3.00 GiB'``.

    Examples:
        >>> fmt_bytes(1536)
        '1.50 KiB'
        >>> fmt_bytes(224.0078125 * 2**30)
        '224.01 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Table:
    """Rows of strings that print as text and render as HTML in a notebook."""

    def __init__(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = ""):
        self.columns = list(columns)
        self.rows = [[str(c) for c in row] for row in rows]
        self.caption = caption

    def __str__(self) -> str:
        widths = [
            max(len(r[i]) for r in [self.columns, *self.rows]) for i in range(len(self.columns))
        ]
        line: Callable[[Sequence[str]], str] = lambda r: "  ".join(
            c.ljust(w) for c, w in zip(r, widths, strict=True)
        )
        out = [line(self.columns), "  ".join("-" * w for w in widths), *map(line, self.rows)]
        return "\n".join(out + ([self.caption] if self.caption else []))

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in self.rows
        )
        cap = f"<caption>{html.escape(self.caption)}</caption>" if self.caption else ""
        return f'<table class="runbook-table">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    __repr__ = __str__


def _params(report: MemoryReport) -> str:
    return ", ".join(f"{k}={v}" for k, v in report.params.items())


def provenance_label(reports: Sequence[MemoryReport]) -> str:
    """The reports' `Provenance.label`, naming the devices each program ran on."""
    return label_of([(r.name, r.provenance) for r in reports])


def report_table(reports: Sequence[MemoryReport], caption: str | None = None) -> Table:
    """Per-variant bytes, lower bound and overhead (total / lower bound)."""
    rows = [
        [
            r.name,
            r.role,
            _params(r),
            fmt_bytes(r.argument),
            fmt_bytes(r.temp),
            fmt_bytes(r.output),
            fmt_bytes(r.total),
            fmt_bytes(r.lower_bound),
            f"{r.overhead:.3f}x",
        ]
        for r in reports
    ]
    if caption is None and reports:
        caption = f"Compile-time, per device. {provenance_label(reports)}."
        caveats = dict.fromkeys(c for r in reports for c in r.caveats)
        marked = [r.name for r in reports if r.caveats]
        if caveats:
            caption += f" Caveat ({', '.join(dict.fromkeys(marked))}): " + " ".join(caveats)
    columns = [
        "variant",
        "role",
        "params",
        "argument",
        "temp",
        "output",
        "total",
        "lower bound",
        "total / bound",
    ]
    return Table(columns, rows, caption or "")


def fmt_figure(name: str, value: float) -> str:
    """A case's figure by its name: seconds (``_seconds``), a count (``_count``) or bytes."""
    if name.endswith("_seconds"):
        return f"{value:.3f} s"
    return f"{int(value):,}" if name.endswith("_count") else fmt_bytes(value)


def figures_table(reports: Sequence[MemoryReport], caption: str = "") -> Table:
    """The figures a case measures beyond the compiler's (`MemoryReport.figures`), one row
    per report, one column per figure; bytes, except names ending in ``_seconds`` (seconds)
    and ``_count`` (a count)."""
    names = list(dict.fromkeys(k for r in reports for k in r.figures))
    cell: Callable[[str, float | None], str] = lambda k, v: "-" if v is None else fmt_figure(k, v)

    rows = [[r.name, _params(r), *(cell(k, r.figures.get(k)) for k in names)] for r in reports]
    return Table(["variant", "params", *names], rows, caption)


def buffer_line(b: Buffer) -> str:
    """One buffer on one line: size, shape, kind, HLO instruction, JAX operation, source."""
    return (
        f"{fmt_bytes(b.size):>10}  {b.shape}  {b.kind}  {b.instruction}  {b.op or '-'}  "
        f"{b.source or '-'}"
    )


def buffer_table(buffers: Sequence[Buffer], caption: str = "") -> Table:
    """The largest buffers: size, shape, kind, the instruction and source line that made it."""
    rows = [
        [fmt_bytes(b.size), b.shape, b.kind, b.instruction, b.op, b.source or "-"] for b in buffers
    ]
    return Table(["size", "shape", "kind", "HLO instruction", "JAX op", "source"], rows, caption)


def plot_reports(
    reports: Sequence[MemoryReport],
    *,
    label: Callable[[MemoryReport], str] | None = None,
    ax: Any = None,
    title: str = "",
) -> Axes:
    """Stacked argument / temp / output bars per report, with each lower bound marked.

    Outputs written into donated arguments (aliased) are drawn once, as arguments: each bar
    is the report's total.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.55 * len(reports) + 1.6))
    label = label or (lambda r: f"{r.name} ({_params(r)})" if r.params else r.name)
    unit, scale = _unit(max(r.total for r in reports))
    names = [label(r) for r in reports]
    left = [0.0] * len(reports)
    parts: tuple[tuple[str, str, Callable[[MemoryReport], int]], ...] = (
        ("argument", "#4c72b0", lambda r: r.argument),
        ("temp", "#dd8452", lambda r: r.temp),
        ("output", "#55a868", lambda r: r.output - r.alias),
    )
    for part, color, size in parts:
        widths = [size(r) / scale for r in reports]
        ax.barh(names, widths, left=left, color=color, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.scatter(
        [r.lower_bound / scale for r in reports],
        names,
        marker="|",
        s=400,
        color="black",
        label="lower bound",
        zorder=3,
    )
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit} per device (compile time)")
    ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize="small", frameon=False
    )
    prov = provenance_label(reports)
    ax.set_title(f"{title}\n{prov}" if title else prov, fontsize="medium")
    ax.figure.tight_layout()
    return cast("Axes", ax)


def plot_sweep(
    reports: Sequence[MemoryReport], x: str, *, part: str = "total", ax: Any = None, title: str = ""
) -> Axes:
    """One line per variant: bytes (`part`: total, temp, argument) against `params[x]`."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    unit, scale = _unit(max(getattr(r, part) for r in reports) or 1)
    styles = ("-", "--", ":", "-.")
    for i, name in enumerate(dict.fromkeys(r.name for r in reports)):
        points = sorted((r.params[x], getattr(r, part) / scale) for r in reports if r.name == name)
        # Identical variants draw on top of each other: vary style and size so both show.
        ax.plot(
            *zip(*points, strict=True),
            marker="o",
            markersize=9 - i,
            linestyle=styles[i % 4],
            linewidth=2.4 - 0.2 * i,
            label=name,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel(x)
    ax.set_ylabel(f"{part} {unit} per device (compile time)")
    ax.legend(fontsize="small")
    prov = provenance_label(reports)
    ax.set_title(f"{title}\n{prov}" if title else prov, fontsize="medium")
    ax.figure.tight_layout()
    return cast("Axes", ax)


def _unit(largest: float) -> tuple[str, float]:
    for unit, power in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if largest >= 2**power:
            return unit, float(2**power)
    return "bytes", 1.0


def peak_table(peaks: Sequence[Any], *, reference: str | None = None, caption: str = "") -> Table:
    """Measured peaks beside their compile-time predictions (`RuntimePeak`s).

    With `reference` (a variant name), run times are also given as a ratio to that variant.
    """
    ref = next((p.seconds for p in peaks if p.name == reference), None)
    rows = []
    for p in peaks:
        row = [
            p.name,
            ", ".join(f"{k}={v}" for k, v in p.params.items()),
            fmt_bytes(p.predicted),
            fmt_bytes(p.measured),
            f"{p.ratio:.2f}",
            "yes" if p.agrees else "NO",
            f"{p.seconds * 1e3:.1f} ms",
        ]
        if ref:
            row.append(f"{p.seconds / ref:.2f}x")
        rows.append(row)
    columns = [
        "variant",
        "params",
        "predicted",
        "measured",
        "measured / predicted",
        "agree?",
        "run time",
    ]
    if ref:
        columns.append(f"time vs {reference}")
    return Table(columns, rows, caption)
