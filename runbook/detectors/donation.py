"""`donation`: a state-update step whose new state does not reuse the old state's memory.

A training step returns new parameters and optimizer state shaped like the ones it was
given. Unless the inputs are donated (``jax.jit(step, donate_argnums=...)``), XLA must
keep the old state alive for the caller while it writes the new one: both copies exist at
once. Donating lets the outputs reuse the inputs' buffers.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax

from .._errors import RunbookError
from .._measure import _is_pmap, compile_fn
from .._program import Finding, Program, finding
from .._render import fmt_bytes
from ._common import StatePair, fusion_part, is_product, moved_input, source_of, state_pairs

MIN_SHARE = 0.10  # of the program's total: undonated state below this is not reported
PATTERN = "state outputs not donated"
BLOCKED = "donation turned off by jax_debug_nans"
CASE = "donation"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "outputs computed directly from an input of their own shape and dtype, neither aliased "
        "nor a product of that input (which cannot be written over it), "
        f"at least {MIN_SHARE:.0%} of the program's total; with measure_fixes, the step is "
        "compiled again with those arguments donated, and reported only if that saves memory"
    )


def donation_blocked(fn: Any) -> bool:
    """Whether `fn` is a `jax.jit` asked to donate while ``jax_debug_nans`` is on: JAX then
    traces it with no donation at all (jax-ml/jax#12514, the donation page's claim)."""
    info = getattr(fn, "_jit_info", None)  # JAX's private record of what jit was asked
    asked = info is not None and bool(info.donate_argnums or info.donate_argnames)
    return asked and bool(jax.config.values["jax_debug_nans"])


def measure_donated(program: Program, argnums: tuple[int, ...]) -> int | None:
    """The program's total with `argnums` donated (compiled the same way, with
    ``jax_debug_nans`` off while it traces: on, JAX would donate nothing), or None."""
    if _is_pmap(program.fn):
        return None  # jax.pmap: donation is its own argument; not applied mechanically
    donated = jax.jit(program.fn, donate_argnums=argnums)
    try:
        # JAX's own context sets the flag for this thread alone: set process-wide, it would
        # turn donation off in a step another thread traced meanwhile.
        with warnings.catch_warnings(), jax.debug_nans(False):
            warnings.simplefilter("ignore")  # "some donated buffers were not usable"
            # Only its figures are read: no dump to write and parse.
            stats = compile_fn(
                donated, *program.args, compiler_options=program.options, target=program.target
            ).memory_analysis()
    except (RunbookError, TypeError, ValueError):
        return None
    if stats is None:
        return None
    return int(
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )


def _factor(program: Program, pair: StatePair) -> bool:
    """Whether the pair's input is a factor of a matrix product that computes its output
    (``a @ a``): a product reads all of a factor for each element it writes, so it cannot
    be written over it, and donating the input could only add a copy. An input added to a
    product (``p - x.T @ g``, a GPU gemm's addend) is not a factor."""
    made = source_of(program, pair.output)
    computing = fusion_part(program, made) or [made, *program.module.inner_ops(made)]
    for inst in (i for i in computing if is_product(i)):
        for k in (0, 1):
            found = moved_input(program, program.operand(inst, k))
            if found is not None and found.parameter_number == pair.parameter.number:
                return True
    return False


def detect(program: Program) -> list[Finding]:
    pairs = [
        p
        for p in state_pairs(program)
        if not p.aliased and not p.parameter.aliased and not _factor(program, p)
    ]
    nbytes = sum(p.output.shape.nbytes for p in pairs)
    if not pairs or nbytes < MIN_SHARE * program.total:
        return []
    argnums = tuple(sorted({p.parameter.argnum for p in pairs if p.parameter.argnum is not None}))
    saving = None
    if argnums and program.measure_fixes:
        donated = measure_donated(program, argnums)
        if donated is not None:
            saving = program.total - donated
            if saving <= 0:
                return []  # donating changes nothing here: no finding to make
    if saving is not None:
        measured = f" Compiled again with donate_argnums={argnums}: {fmt_bytes(saving)} less."
    elif argnums and not program.measure_fixes:  # diagnose compiles once unless asked
        measured = (
            " The saving is not measured: diagnose(..., measure_fixes=True) measures it"
            " (--measure-fixes on the command line)."
        )
    else:
        measured = ""
    names = ", ".join(p.parameter.path for p in pairs[:3]) + (", ..." if len(pairs) > 3 else "")
    detail = (
        f"{len(pairs)} output(s) are computed from an input of the same shape ({names}) and "
        f"reuse none of the inputs' memory: {fmt_bytes(nbytes)} held twice."
    )
    if donation_blocked(program.fn):
        return [
            finding(
                BLOCKED,
                CASE,
                nbytes,
                [program.buffer(p.output) for p in pairs],
                "Turn jax_debug_nans off where memory matters "
                "(jax.config.update('jax_debug_nans', False)) and trace the step again: JAX "
                "donates nothing while it is on",
                detail=f"The step asks for donation, but jax_debug_nans is on. {detail}"
                + measured.replace("Compiled again with", "Traced with the flag off and"),
                saving=saving,
            )
        ]
    return [
        finding(
            PATTERN,
            CASE,
            nbytes,
            [program.buffer(p.output) for p in pairs],
            f"Donate the state arguments, jax.jit(step, donate_argnums={argnums or '(...)'}), "
            "so that the new state is written into the old state's buffers",
            detail=detail + measured,
            saving=saving,
            copy="runbook.cases.donation.donated_step",
        )
    ]
