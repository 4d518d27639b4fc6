"""`runbook.explain`: read an XLA out-of-memory message and say what it means.

XLA reports a program that does not fit as a ``RESOURCE_EXHAUSTED`` error, in a form that
depends on who noticed: the TPU compiler (its memory report, with the largest allocations
and the JAX operation and source line of each), the GPU runtime (the buffer assignment's
peak buffers, the BFC allocator's dump of in-use chunks), the CPU runtime (one line). This
module reads any of them (jax-ml/jax#9530 asks for the live buffers at an OOM) and says,
without claiming more than the text shows: how much was needed against how much there was,
the buffers listed, and which of the runbook's cases their roles point to.
"""

from __future__ import annotations

import dataclasses
import html
import os
import pathlib
import re
from collections.abc import Iterable, Sequence

from ._buffers import Buffer, _short_path
from ._diagnose import Dominant
from ._errors import DoesNotFitError, RunbookError
from ._render import Table, fmt_bytes
from ._targets import oom_figures, parse_size

__all__ = ["CaseMatch", "Explanation", "NotAnOomMessageError", "explain"]

EXPECTED = (
    "expected XLA's RESOURCE_EXHAUSTED text: 'Ran out of memory in memory space hbm ...', "
    "'Out of memory while trying to allocate N bytes', 'Out of memory allocating N bytes', "
    "or a BFC allocator's dump"
)


class NotAnOomMessageError(RunbookError):
    """The text given to `explain` is not an XLA out-of-memory message."""


@dataclasses.dataclass(frozen=True)
class CaseMatch:
    """A runbook case that the role of some listed buffers points to.

    Attributes:
        case: the case's name (``python -m runbook list``).
        bytes: the listed buffers it accounts for, added up.
        buffers: those buffers, largest first.
        evidence: what in the message shows the role, in a sentence.
    """

    case: str
    bytes: int
    buffers: tuple[Buffer, ...]
    evidence: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What an XLA out-of-memory message says, read by `runbook.explain`.

    Attributes:
        form: which message it is, e.g. "TPU compiler: memory report", "BFC allocator".
        platform: "TPU", "GPU" or "CPU" where the message shows it, else "" (not stated).
        needed: the bytes the message says were needed: the program's (what `what` names)
            or the one allocation that failed; None where it states none.
        limit: the bytes it says there were (the device's usable memory, the allocator's
            limit); None where it states none.
        what: what `needed` counts ("hbm in all", "HLO temporaries", "one allocation", ...).
        stated_over: by how much it says `needed` exceeds the memory, where it says so.
        buffers: the buffers it lists (`runbook.Buffer`), largest first; `kind` is
            "argument", "output", "temp" (or another allocation type it names), "" where
            it names none.
        totals: other figures it states, by name (e.g. "reserved", "arguments",
            "total allocation", "in use").
        chunks: the BFC allocator's in-use chunks, ``(count, bytes each)``, largest first.
        padding: bytes of the listed buffers that the TPU's tiled layouts add, as stated.
        matches: the runbook cases the listed buffers point to, largest first.
        text: the message as given.
    """

    form: str
    platform: str
    needed: int | None
    limit: int | None
    what: str
    stated_over: int | None = None
    buffers: tuple[Buffer, ...] = ()
    totals: dict[str, int] = dataclasses.field(default_factory=dict)
    chunks: tuple[tuple[int, int], ...] = ()
    padding: int = 0
    matches: tuple[CaseMatch, ...] = ()
    text: str = dataclasses.field(default="", repr=False)

    @property
    def cases(self) -> list[str]:
        """The names of the cases matched, largest first."""
        return [m.case for m in self.matches]

    @property
    def over(self) -> int | None:
        """How much more was needed than there was (as stated, else `needed - limit`)."""
        if self.stated_over is not None:
            return self.stated_over
        if self.needed is not None and self.limit is not None:
            return self.needed - self.limit
        return None

    @property
    def listed(self) -> int:
        """The listed buffers' bytes, added up."""
        return sum(b.size for b in self.buffers)

    def dominant(self, count: int = 3) -> list[Dominant]:
        """The listed buffers grouped by the JAX operation and source line that made them,
        largest first (what dominates where no case matches)."""
        labels = {"argument": "(an argument)", "output": "(an output)"}
        return Dominant.group(self.buffers, lambda b: b.op or labels.get(b.kind, "-"))[:count]

    def summary(self) -> list[str]:
        """The message in plain terms: who reported it and needed against available."""
        lines = [f"Out of memory: {self.form}" + (f" ({self.platform})" if self.platform else "")]
        needed, limit, over = self.needed, self.limit, self.over
        one = self.what == "one allocation"
        if needed is not None and limit is not None and over is not None:
            ratio = f", {needed / limit:.2f}x what fits" if limit else ""
            need = f"{fmt_bytes(needed)} " + ("in one allocation" if one else f"of {self.what}")
            lines.append(
                f"It needs {need}; there is {fmt_bytes(limit)}: {fmt_bytes(over)} too much{ratio}."
            )
        elif needed is not None:
            what = "" if one else f" ({self.what})"
            lines.append(
                f"An allocation of {fmt_bytes(needed)} failed{what}; the message does not say "
                "how much memory there was."
            )
            if self.platform == "GPU" and one:
                lines.append(
                    f"So less than {fmt_bytes(needed)} was free in one piece at that moment."
                )
            program = self.totals.get("total allocation")
            if program is not None:
                lines.append(
                    f"The program's own buffers total {fmt_bytes(program)} (its buffer "
                    "assignment); what else held the device's memory, the message does not say."
                )
        elif limit is not None:
            lines.append(
                f"The allocator's limit is {fmt_bytes(limit)}; the message does not say how "
                "much the failed request asked for."
            )
        else:
            lines.append("The message states no byte counts.")
        if self.totals:
            stated = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.totals.items())
            lines.append(f"It also states: {stated}.")
        if self.chunks:
            top = ", ".join(f"{n} x {fmt_bytes(s)}" for n, s in self.chunks[:3])
            lines.append(f"The allocator's largest in-use chunks: {top}.")
        if self.padding and self.listed:
            lines.append(
                f"Of the listed {fmt_bytes(self.listed)}, {fmt_bytes(self.padding)} "
                f"({self.padding / self.listed:.0%}) is padding the TPU's tiled layouts add."
            )
        return lines

    def findings(self) -> list[str]:
        """The cases the listed buffers point to, or what dominates them."""
        if not self.buffers:
            return [
                (
                    "The message lists no buffers. `runbook.diagnose(fn, *args)` names them "
                    "from the compiled program (with `target=` for a GPU or TPU)."
                )
            ]
        listed = self.listed
        if self.matches:
            lines = ["The buffers' roles point to these runbook cases:"]
            for m in self.matches:
                share = f"{m.bytes / listed:.0%}" if listed else "-"
                lines.append(
                    f"  {m.case}: {fmt_bytes(m.bytes)}, {share} of the listed bytes "
                    f"({len(m.buffers)} buffer{'s' if len(m.buffers) > 1 else ''}); {m.evidence}"
                )
                lines.append(f"    {_case_line(m.case)}")
            return lines
        lines = [
            (
                "No runbook case shows in the listed buffers. What dominates them, by the JAX "
                "operation and source line that made them (bytes, share of the listed bytes):"
            )
        ]
        lines += [f"  {g.describe(listed)}" for g in self.dominant()]
        return lines

    def table(self, count: int = 12) -> Table:
        """The listed buffers, largest first: size, dtype, shape, kind, JAX op, source, case."""
        case_of = {id(b): m.case for m in self.matches for b in m.buffers}
        rows = []
        for b in self.buffers[:count]:
            dtype, shape = _split_shape(b.shape)
            rows.append(
                [
                    fmt_bytes(b.size),
                    dtype,
                    shape,
                    b.kind or "-",
                    _short_op(b.op) or "-",
                    b.source or "-",
                    case_of.get(id(b), "-"),
                ]
            )
        more = len(self.buffers) - count
        n = len(self.buffers)
        caption = f"{n} buffer{'s' if n > 1 else ''} listed, {fmt_bytes(self.listed)}" + (
            f"; the {more} smallest not shown" if more > 0 else ""
        )
        return Table(["size", "dtype", "shape", "kind", "JAX op", "source", "case"], rows, caption)

    def __str__(self) -> str:
        lines = self.summary()
        if self.buffers:
            lines += ["", str(self.table()), ""]
        lines += self.findings()
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        e = html.escape
        parts = ['<div class="runbook-explanation">']
        parts += [f"<p>{e(line)}</p>" for line in self.summary()]
        if self.buffers:
            parts.append(self.table()._repr_html_())
        parts.append("<pre>" + e("\n".join(self.findings())) + "</pre></div>")
        return "".join(parts)


def _case_line(name: str) -> str:
    """The case's title and recommended fix, and where to see it measured."""
    from ._case import get_case

    case = get_case(name)
    fix = ""
    if case.recommended is not None:
        summary = case.variant(case.recommended).summary.removeprefix("recommended: ")
        fix = f" Recommended fix: {summary}."
    return f"{case.title}.{fix} See `python -m runbook run {name}`."


# --- reading the text ------------------------------------------------------------------------

_SIZE = r"(\d+(?:\.\d+)?[KMGT]?(?:i?B)?)"
# A log line's prefix: glog ("W1125 19:12:45.941151   21249 file.cc:1340] "), TensorFlow's
# ("2020-06-07 17:48:49.800300: I path/bfc_allocator.cc:812] "), a quote ("> ").
_LOG_PREFIX = re.compile(
    r"^\s*(?:>\s*)?(?:\[\d+\]\s*)?(?:\d{4}-\d\d-\d\d[ T][\d:.]+:?\s+)?"
    r"(?:[IWEF]\d{4} [\d:.]+\s+\d+\s+|[IWEF]\s+(?:\d+\s+)?)?"
    r"[^\s\]]*?[\w\-]+\.(?:cc|h|py):\d+\]\s?"
)


def _rx(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """`pattern` with each space matching any run of whitespace (messages wrap)."""
    return re.compile(pattern.replace("SIZE", _SIZE).replace(" ", r"\s+"), flags)


_TPU_REPORT = _rx(
    r"Ran out of memory in memory space (\w+)\. Used SIZE of SIZE \w+\. "
    r"Exceeded \w+ capacity by SIZE"
)
_TPU_ABORT = _rx(r"unlikely to have enough device memory\. Requires SIZE, has SIZE available")
_TPU_RESERVE = _rx(r"Attempting to reserve SIZE at the bottom of memory")
_TPU_FREE = _rx(r"There are SIZE free, SIZE reserved, and SIZE reservable")
_GPU_LIMIT = _rx(r"Allocating (\d+) bytes exceeds the memory limit of (\d+) bytes")
_WHILE_TRYING = _rx(r"Out of memory while trying to allocate (\d+) bytes", re.IGNORECASE)
_CPU = _rx(r"Out of memory allocating (\d+) bytes")
_REQUEST = _rx(r"Failed to allocate request for SIZE \((\d+)B\) on device ordinal (\d+)")
_BFC_REQUEST = _rx(
    r"Allocator \(([^)]+)\) ran out of memory trying to allocate SIZE(?: \(rounded to (\d+)\))?"
)
_BFC_TOTAL = _rx(r"Sum Total of in-use chunks: SIZE")
_BFC_LIMIT = _rx(r"memory_limit_: (\d+)")
_BFC_REGION = _rx(r"total_region_allocated_bytes_: (\d+)")
_BFC_AVAILABLE = _rx(r"available bytes: (\d+)")
_BFC_CHUNKS = _rx(r"(\d+) Chunks of size (\d+) totalling")
_STATS = re.compile(r"^\s*(Limit|InUse|MaxInUse|MaxAllocSize):\s+(\d+)\s*$", re.MULTILINE)
_BUFFER_ASSIGNMENT = re.compile(
    r"^\s*([\w ]+? (?:allocation|fragmentation)):\s+" + _SIZE, re.MULTILINE
)
_EXHAUSTED = re.compile(r"RESOURCE_EXHAUSTED|Resource exhausted", re.IGNORECASE)
_GPU_WORDS = re.compile(
    r"GPU_\d+_bfc|\bgpu\b|\bcuda\b|BufferAssignment OOM Debugging", re.IGNORECASE
)
_TOTAL_LINE = re.compile(r"^\s{2,}([A-Za-z][A-Za-z ]*?)\s{2,}" + _SIZE + r"(?:\s|$)")


def _clean(text: str) -> str:
    """The text without log-line prefixes, so that a pasted log reads as the message, and
    without comment lines (``# ...``, a note above a saved message)."""
    lines = (_LOG_PREFIX.sub("", line, count=1) for line in text.splitlines())
    return "\n".join(line for line in lines if not line.startswith("# "))


def _strip_layout(shape: str) -> str:
    """``f32[8,128]{1,0:T(8,128)}`` -> ``f32[8,128]`` (tuples too)."""
    return re.sub(r"\{[^{}]*\}", "", shape).strip()


def _split_shape(shape: str) -> tuple[str, str]:
    """(dtype, dimensions) of ``f32[8,128]``; ("tuple", the shape) for a tuple."""
    m = re.fullmatch(r"(\w+)(\[[\d,]*\])", shape)
    if m is None:
        return ("tuple" if shape.startswith("(") else "-"), shape or "-"
    return m[1], m[2]


def _dims(shape: str) -> tuple[int, ...]:
    m = re.fullmatch(r"\w+\[([\d,]*)\]", shape)
    if m is None:
        return ()
    return tuple(int(d) for d in m[1].split(",") if d)


def _element_dims(shape: str) -> list[tuple[int, ...]]:
    """The dimensions of each array of a shape (one for an array, several for a tuple)."""
    return [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\w\[([\d,]*)\]", shape)]


def _op_name(operator: str) -> str:
    """The JAX operation of an ``Operator:`` line, without its parameters in brackets."""
    m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', operator)
    if m is None:
        return ""
    name = m[1]
    while (shorter := re.sub(r"\[[^\[\]]*\]", "", name)) != name:
        name = shorter
    return name.strip()


def _short_op(op: str, width: int = 64) -> str:
    return op if len(op) <= width else "..." + op[-(width - 3) :]


def _source(operator: str) -> str:
    m = re.search(r'source_file="([^"]*)" source_line=(\d+)', operator)
    return f"{_short_path(m[1])}:{m[2]}" if m else ""


_ENTRY = re.compile(r"^\s*(?:\d+\.\s+Size:\s*" + _SIZE + r"|Buffer \d+:)\s*$")


def _entries(block: str) -> tuple[list[Buffer], int]:
    """The listed buffers of a TPU memory report or a GPU buffer assignment's peak buffers,
    and the padding the entries state."""
    buffers: list[Buffer] = []
    padding = 0
    fields: dict[str, str] | None = None
    size: int | None = None

    def close() -> None:
        nonlocal fields, size, padding
        if fields is None:
            return
        size = size if size is not None else _size_or_none(fields.get("size", ""))
        if size is not None:
            label = fields.get("xla label", "")
            kind = _kind(fields.get("allocation type", ""), label)
            shape = fields.get("shape", "")
            if "entry parameter subshape" in fields:
                kind, shape = "argument", fields["entry parameter subshape"]
            operator = fields.get("operator", "")
            instruction = label.lstrip("%").split(" = ")[0].strip()
            buffers.append(
                Buffer(
                    size,
                    _strip_layout(shape),
                    kind,
                    instruction,
                    _op_name(operator),
                    _source(operator),
                )
            )
            extra = fields.get("extra memory due to padding", "")
            padding += _size_or_none(extra.split(" (")[0]) or 0
        fields, size = None, None

    for line in block.splitlines():
        if (m := _ENTRY.match(line)) is not None:
            close()
            fields, size = {}, (parse_size(m[1]) if m[1] else None)
        elif fields is not None:
            if line.strip().startswith("=="):
                close()
                continue
            key, sep, value = line.strip().partition(":")
            if sep:
                fields.setdefault(key.strip().lower(), value.strip())
    close()
    return buffers, padding


def _size_or_none(text: str) -> int | None:
    try:
        return parse_size(text)
    except ValueError:
        return None


def _kind(allocation_type: str, label: str) -> str:
    if allocation_type:
        return "temp" if allocation_type.strip() == "HLO temp" else allocation_type.strip()
    if label.startswith("Argument"):
        return "argument"
    if label.startswith("Output"):
        return "output"
    return ""


def _tpu_block(clean: str) -> tuple[re.Match[str], str] | None:
    """The memory report to read: the first whose text lists allocations (a log repeats the
    report; the first header is often followed by another table), else the first."""
    headers = list(_TPU_REPORT.finditer(clean))
    if not headers:
        return None
    ends = [h.start() for h in headers[1:]] + [len(clean)]
    blocks = [(h, clean[h.start() : end]) for h, end in zip(headers, ends, strict=True)]
    for h, block in blocks:
        if "Largest program" in block:
            return h, block
    return blocks[0]


def _tpu_totals(block: str) -> dict[str, int]:
    """The figures of a TPU report's usage and requirement tables (before its lists)."""
    totals: dict[str, int] = {}
    head = block.split("Largest program")[0]
    for line in head.splitlines():
        if (m := _TOTAL_LINE.match(line)) is not None:
            totals.setdefault(m[1].strip(), parse_size(m[2]))
        elif (o := re.match(r"\s*Output size " + _SIZE, line)) is not None:
            totals.setdefault("output", parse_size(o[1]))
    return totals


def _read(text: str) -> Explanation | None:
    """The explanation of `text`, or None where it holds no out-of-memory message."""
    clean = _clean(text)
    buffers: list[Buffer] = []
    totals: dict[str, int] = {}
    padding = 0
    platform = ""
    stated_over: int | None = None
    needed: int | None
    limit: int | None
    if (found := _tpu_block(clean)) is not None:
        header, block = found
        space = header[1]
        form, platform, what = "TPU compiler: memory report", "TPU", f"{space} in all"
        needed, limit, stated_over = (parse_size(header[i]) for i in (2, 3, 4))
        totals = _tpu_totals(block)
        buffers, padding = _entries(block)
    elif (figures := oom_figures(clean)) is not None:
        needed, limit, what = figures
        form, platform = "TPU compiler: first memory check", "TPU"
    elif (m := _TPU_ABORT.search(clean)) is not None:
        form, platform, what = "TPU compiler: early abort", "TPU", "the program"
        needed, limit = parse_size(m[1]), parse_size(m[2])
    elif (m := _TPU_RESERVE.search(clean)) is not None:
        form, platform, what = "TPU runtime: loading the program", "TPU", "program memory"
        needed, limit = parse_size(m[1]), None
        if (free := _TPU_FREE.search(clean)) is not None:
            limit = parse_size(free[3])
            totals = {"free": parse_size(free[1]), "reserved": parse_size(free[2])}
    elif (m := _GPU_LIMIT.search(clean)) is not None:
        form, platform, what = "GPU allocator: memory limit", "GPU", "one allocation"
        needed, limit = int(m[1]), int(m[2])
    elif (m := _WHILE_TRYING.search(clean)) is not None:
        form, what = "an allocation at run time", "one allocation"
        needed, limit = int(m[1]), None
    elif (m := _CPU.search(clean)) is not None:
        form, platform, what = "CPU runtime", "CPU", "one allocation"
        needed, limit = int(m[1]), None
    elif (m := _REQUEST.search(clean)) is not None:
        form, what = "an allocation at run time", "one allocation"
        needed, limit = int(m[2]), None
    elif _BFC_TOTAL.search(clean) or _BFC_REQUEST.search(clean) or _BFC_LIMIT.search(clean):
        form, what = "BFC allocator", "one allocation"
        needed, limit = None, None
    elif _EXHAUSTED.search(clean) and re.search(r"memory", clean, re.IGNORECASE):
        form, what = "out of memory", "-"
        needed, limit = None, None
    else:
        return None
    # What a GPU runtime's message adds: its buffer assignment and the BFC allocator's dump.
    if "BufferAssignment OOM Debugging" in clean:
        form = "GPU runtime: buffer assignment"
        totals.update((k.strip(), parse_size(v)) for k, v in _BUFFER_ASSIGNMENT.findall(clean))
        peak = clean.split("Peak buffers:", 1)
        if len(peak) == 2:
            buffers, padding = _entries(peak[1])
    requests = [int(r[3]) if r[3] else parse_size(r[2]) for r in _BFC_REQUEST.finditer(clean)]
    if requests:
        form = form if form != "an allocation at run time" else "BFC allocator"
        totals["largest request the allocator refused"] = max(requests)
        if needed is None:
            needed = max(requests)
    limit = _bfc(clean, totals, limit)
    chunks = sorted(
        {(int(n), int(s)) for n, s in _BFC_CHUNKS.findall(clean)}, key=lambda c: (-c[1], -c[0])
    )
    if not platform and (form.startswith("GPU") or _GPU_WORDS.search(clean) is not None):
        platform = "GPU"
    buffers.sort(key=lambda b: -b.size)
    return Explanation(
        form,
        platform,
        needed,
        limit,
        what,
        stated_over,
        tuple(buffers),
        totals,
        tuple(chunks),
        padding,
        tuple(_match_cases(buffers)),
        text,
    )


def _bfc(clean: str, totals: dict[str, int], limit: int | None) -> int | None:
    """Add the BFC allocator's figures to `totals`; its limit where none was found."""
    if (m := _BFC_TOTAL.search(clean)) is not None:
        totals["in-use chunks"] = parse_size(m[1])
    if (m := _BFC_REGION.search(clean)) is not None:
        totals["regions allocated"] = int(m[1])
    if (m := _BFC_AVAILABLE.search(clean)) is not None:
        totals["available"] = int(m[1])
    stats = dict(_STATS.findall(clean))
    for key, name in (("InUse", "in use"), ("MaxInUse", "most in use"), ("MaxAllocSize",
                      "largest allocation")):  # fmt: skip
        if key in stats:
            totals[name] = int(stats[key])
    if limit is None and (m := _BFC_LIMIT.search(clean)) is not None:
        limit = int(m[1])
    if limit is None and "Limit" in stats:
        limit = int(stats["Limit"])
    return limit


# --- the runbook's cases, from the roles the op names and shapes show ---------------------

# The last axis of a logits array at least this wide counts as a vocabulary (GPT-2's is
# 50257, Llama's 32000 to 128256; a classifier's 10 or 1000 classes do not count).
VOCAB_MIN = 8192
# JAX's and optax's functions of logits, as they name themselves in an op name.
_LOGIT_FNS = (
    "log_softmax",
    "logsumexp",
    "one_hot",
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
)
_PRNG_FNS = {
    "threefry2x32",
    "threefry_2x32",
    "random_bits",
    "rng_bit_generator",
    "_uniform",
    "_normal",
    "_normal_real",
    "_truncated_normal",
    "_gumbel",
    "_bernoulli",
    "_randint",
}
_EINSUM = re.compile(r"([A-Za-z.]+),([A-Za-z.]+)->([A-Za-z.]+)")


def _tokens(op: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][\w]*", op))


def _last(op: str) -> str:
    return op.rsplit("/", 1)[-1]


def _attention(b: Buffer) -> str | None:
    dims = _dims(b.shape)
    square = len(dims) >= 2 and dims[-1] == dims[-2] > 1
    if not square:
        return None
    for spec in _EINSUM.finditer(b.op):
        lhs, rhs, out = (s.replace(".", "") for s in spec.groups())
        # q k^T: both operands contracted over their last axis, the result's last two axes
        # one from each operand (the query and the key positions).
        if (
            len(out) >= 2
            and lhs[-1:] == rhs[-1:]
            and lhs[-1:] not in out
            and out[-2] in lhs
            and out[-2] not in rhs
            and out[-1] in rhs
            and out[-1] not in lhs
        ):
            return (
                f"the product {spec[0]} contracts two operands over their last axis into a "
                f"{dims[-2]} x {dims[-1]} matrix: attention scores (queries x keys)"
            )
    if "softmax" in _tokens(b.op):
        return f"a softmax over a {dims[-2]} x {dims[-1]} matrix: attention probabilities"
    return None


def _logit_fn(b: Buffer) -> str | None:
    """The function of logits that made `b`, by the name it has in the op name."""
    tokens = _tokens(b.op)
    return next((f for f in _LOGIT_FNS if f in tokens), None)


def _logits(b: Buffer) -> str | None:
    dims = _dims(b.shape)
    fn = _logit_fn(b)
    if fn is None or len(dims) < 2 or dims[-1] < VOCAB_MIN:
        return None
    return f"{fn} made it, {dims[-1]} wide on its last axis: logits over a vocabulary"


def _logits_product(b: Buffer, buffers: Sequence[Buffer]) -> str | None:
    """A product whose leading axes are those of a log-softmax (or one-hot) listed beside
    it, and whose last axis is a vocabulary's: the logits that feed the loss."""
    dims = _dims(b.shape)
    if len(dims) < 2 or dims[-1] < VOCAB_MIN or not ("dot_general" in b.op or "->" in b.op):
        return None
    for other in buffers:
        fn = _logit_fn(other)
        if fn is not None and any(d in (dims, dims[:-1]) for d in _element_dims(other.shape)):
            return (
                f"a product {dims} whose leading axes match the {fn} beside it "
                f"({other.shape}): the logits, {dims[-1]} wide on the vocabulary axis"
            )
    return None


def _prng(b: Buffer) -> str | None:
    found = sorted(_tokens(b.op) & _PRNG_FNS)
    if not found:
        return None
    return f"made inside jax.random ({', '.join(found)}): random-number generation"


def _gather_grad(b: Buffer) -> str | None:
    if "transpose" in _tokens(b.op) and re.search(r"scatter[-_]add", b.op):
        return "a scatter-add in the backward pass (transpose): the gradient of a gather"
    return None


def _scan_residuals(b: Buffer) -> str | None:
    tokens = _tokens(b.op)
    if (
        {"jvp", "while", "body"} <= tokens
        and "transpose" not in tokens
        and _last(b.op).startswith("dynamic_update_slice")
    ):
        return (
            "written step by step (dynamic_update_slice) in a loop of the forward pass of a "
            "gradient (jvp): residuals a scan stores per step"
        )
    return None


def _vmap_update(b: Buffer) -> str | None:
    if "vmap" in _tokens(b.op) and _last(b.op) in ("scatter", "dynamic_update_slice"):
        return "an indexed update under jax.vmap: one updated copy per example"
    return None


def _role(b: Buffer, buffers: Sequence[Buffer]) -> tuple[str, str] | None:
    """The case `b`'s role points to, with the evidence; None where it shows none."""
    checks = (
        ("attention-scores", _attention),
        ("vocab-logits", _logits),
        ("prng-temporaries", _prng),
        ("gather-grad", _gather_grad),
        ("scan-residuals", _scan_residuals),
        ("vmap-materialize", _vmap_update),
    )
    for case, check in checks:
        if (evidence := check(b)) is not None:
            return case, evidence
    if (evidence := _logits_product(b, buffers)) is not None:
        return "vocab-logits", evidence
    return None


def _match_cases(buffers: Sequence[Buffer]) -> list[CaseMatch]:
    found: dict[str, list[tuple[Buffer, str]]] = {}
    for b in buffers:
        if (role := _role(b, buffers)) is not None:
            found.setdefault(role[0], []).append((b, role[1]))
    matches = [
        CaseMatch(case, sum(b.size for b, _ in hits), tuple(b for b, _ in hits), hits[0][1])
        for case, hits in found.items()
    ]
    matches.sort(key=lambda m: -m.bytes)
    return matches


# --- the entry point -------------------------------------------------------------------------


def _texts(message: BaseException) -> Iterable[str]:
    """The texts of an exception and of those it was raised from (a DoesNotFitError's
    cause is the compiler's error)."""
    seen: set[int] = set()
    e: BaseException | None = message
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield str(e)
        e = e.__cause__ or e.__context__


def explain(message: str | BaseException | os.PathLike[str]) -> Explanation:
    """Explain an XLA out-of-memory message: needed against available, the buffers it lists
    (largest first, with the JAX operation and source line of each), and the runbook cases
    their roles point to, or what dominates where none does.

    Args:
        message: the message's text (a whole pasted log is fine), the exception JAX raised
            (a `runbook.DoesNotFitError` is read through the compiler's error it carries),
            or a path to a file holding the text.

    Returns:
        The `Explanation`, to print or to show in a notebook; its attributes hold the
        figures (`needed`, `limit`, `buffers`, `cases`).

    Raises:
        RunbookError: the text holds no XLA out-of-memory message (a `NotAnOomMessageError`,
            whose one line says what was expected), or the file cannot be read.

    Examples:
        >>> e = explain("RESOURCE_EXHAUSTED: Out of memory allocating 34359738368 bytes.")
        >>> e.platform, e.needed, e.limit
        ('CPU', 34359738368, None)
    """
    if isinstance(message, BaseException):
        for text in _texts(message):
            if (found := _read(text)) is not None:
                return found
        if isinstance(message, DoesNotFitError):
            return Explanation(
                "runbook.DoesNotFitError", "", message.needed, message.limit, message.what,
                text=str(message),
            )  # fmt: skip
        raise NotAnOomMessageError(
            f"`message` ({type(message).__name__}) holds no out-of-memory message; {EXPECTED}"
        )
    if isinstance(message, os.PathLike):
        path = pathlib.Path(message)
        try:
            text = path.read_text()
        except OSError as err:
            raise RunbookError(f"cannot read {str(path)!r}: {err.strerror}") from err
    else:
        text = message
    found = _read(text)
    if found is None:
        raise NotAnOomMessageError(f"`message` holds no out-of-memory message; {EXPECTED}")
    return found
