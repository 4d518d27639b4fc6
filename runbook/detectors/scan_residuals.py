"""`scan-residuals`: a scan's forward pass stacks per-step residuals for its backward pass.

Reverse mode through ``lax.scan`` keeps what each step's backward needs, for every step:
the forward loop writes them into ``(steps, ...)`` arrays that the backward loop reads.
Intermediates of the step a checkpointed body (``jax.checkpoint``) would recompute; the
step's inputs (the carry) are stored even then, which only nested checkpointing reduces.

The detector recognises the stacking by what the loops do, not by how one XLA prints it:
a loop element of ``steps`` rows that the body rewrites in place with a per-step
dynamic-update-slice (found through copies, bitcasts, fusions, multi-output fusions and
async wrappers), and that a later loop reads. Every loop that stacks counts toward one
finding, so that a scan split into blocks (or recomputed block by block under
``jax.checkpoint``) is judged by what its stacks hold at once, not block by block.
A stacking loop that runs inside the reverse-mode pass is a checkpointed scan being
recomputed: checkpointing the whole scan moved its stacks into the backward pass.

The same mechanism without a loop: layers written out one after another (a Python loop,
or a model's blocks ``Block_0``, ``Block_1``, ...), each keeping its intermediates for the
backward pass. Their op names say which layer made them (the scope JAX records, as
flax.linen names its modules); a checkpoint on each layer keeps only its output. Where the
compiler merges a checkpoint's recomputation back into the forward pass (XLA:CPU in some
releases), that fix frees nothing: a probe compile on the program's own backend decides,
and the layers are then a near miss that says so.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from .._buffers import Buffer
from .._hlo import Instruction, Value
from .._measure import compile_fn
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes
from . import grad_accumulation
from ._common import kept_for_backward, trip_count

MIN_SHARE = 0.10  # of the total: stacked intermediates a checkpointed body would not store
MIN_CARRY_SHARE = 0.25  # of the total: stacked carries, which only nesting reduces...
MIN_NEST_GAIN = 8  # ...reported where nesting stores this many times fewer (2 sqrt(T) of T)
MIN_STEPS = (2 * MIN_NEST_GAIN) ** 2
PATTERN = "scan residuals stacked for the backward pass"
PATTERN_RECOMPUTED = "checkpointed scan recomputed in the backward pass, every step stacked"
CASE = "scan-residuals"
COPY = "runbook.cases.scan_residuals.loss_nested"
MIN_LAYER_SHARE = 0.10  # of the total: layers' intermediates a checkpoint per layer frees
PATTERN_LAYERS = "each layer's intermediates kept for the backward pass"
COPY_LAYERS = "runbook.cases.scan_residuals.loss_remat_body"
PROBE_LAYERS = 4  # of (256, 512): a few MiB, compiled in under a second


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        "while loops write (steps, ...) arrays step by step (a dynamic-update-slice, however "
        "fused, copied or wrapped) that a later while loop reads; all such loops together are "
        f"reported when the step's intermediates they hold at once are at least {MIN_SHARE:.0%} "
        f"of the total, or its inputs (carries) alone at least {MIN_CARRY_SHARE:.0%} over "
        f"{MIN_STEPS} steps or more, where nesting would store {MIN_NEST_GAIN}x fewer; a "
        "stacking loop inside the reverse-mode pass is named a checkpointed scan recomputed; "
        "without a loop, temporaries the backward pass reads, grouped by the numbered scope "
        "that made them (layer_0, layer_1, ...: at least two layers), reported when all but "
        "each layer's output (what the forward pass reads outside the layer, which a "
        "checkpoint keeps) hold, less one layer's worth, at least "
        f"{MIN_LAYER_SHARE:.0%} of the total; the values another detector names count "
        "toward that share and under their own finding; on a backend whose compiler undoes "
        f"a checkpoint (a probe of {PROBE_LAYERS} checkpointed layers needs no fewer "
        "temporaries than the same layers unchecked), a near miss instead"
    )


def _body(loop: Instruction) -> str | None:
    m = re.search(r"\bbody=%?([\w.\-]+)", loop.attributes)
    return m[1] if m else None


_MOVES = ("bitcast", "copy", "reshape", "async-done", "async-update", "copy-done")
_CALLS = ("fusion", "async-start", "call")


def _writer(program: Program, inst: Instruction) -> Instruction | None:
    """The dynamic-update-slice that produces `inst`, looking through what only moves or
    wraps a value: copies, bitcasts, fusions (one result of a multi-output fusion too),
    async and call wrappers. None when `inst` is computed some other way."""
    seen: set[str] = set()
    current: Instruction | None = inst
    while current is not None and current.name not in seen:
        seen.add(current.name)
        if current.opcode == "dynamic-update-slice":
            return current
        if current.opcode in _MOVES and current.operands:
            current = program.module.get(current.operands[0])
        elif current.opcode in _CALLS and current.calls:
            current = program.module.root(current.calls[0])
        elif current.opcode == "get-tuple-element" and current.operands:
            producer = program.module.get(current.operands[0])
            k = current.tuple_index
            if producer is None or producer.opcode not in _CALLS or not producer.calls:
                return None
            root = program.module.root(producer.calls[0])
            if root is None or root.opcode != "tuple" or k is None or k >= len(root.operands):
                return None
            current = program.module.get(root.operands[k])
        elif current.opcode == "parameter":
            outer = program.outside(current)
            current = None if outer is current else outer
        else:
            return None
    return None


def _loop_element(program: Program, inst: Instruction | None, body: str) -> int | None:
    """Which element of the loop state `inst` is (the body's parameter, element k), or None."""
    seen: set[str] = set()
    while inst is not None and inst.name not in seen:
        seen.add(inst.name)
        if inst.opcode == "get-tuple-element" and inst.computation == body:
            return inst.tuple_index
        if inst.opcode == "parameter":
            outer = program.outside(inst)
            if outer is inst:
                return None
            inst = outer
        elif inst.opcode in _MOVES and inst.operands:
            inst = program.module.get(inst.operands[0])
        else:
            return None
    return None


def _consumed_by_loop(program: Program, loop: Instruction, index: int) -> Instruction | None:
    """The later loop element `index` of `loop`'s result flows into (through tuples,
    copies, bitcasts, one-op fusions, calls and async wrappers), or None."""
    result = program.module.returned(loop)  # out of the call XLA:CPU may wrap it in
    todo = [
        u
        for u in program.module.users.get(result.name, [])
        if u.opcode == "get-tuple-element" and u.tuple_index == index
    ]
    seen: set[str] = set()
    while todo:
        inst = todo.pop()
        if inst.name in seen:
            continue
        seen.add(inst.name)
        for user in program.module.users.get(inst.name, []):
            if user.opcode == "while" and user.name != loop.name:
                return user
            if user.opcode in ("tuple", "get-tuple-element", *_MOVES, "async-start"):
                todo.append(user)
            elif user.opcode in ("fusion", "call"):
                inner = program.module.through(user)
                if inner.opcode in ("bitcast", "copy", "reshape", "transpose", "tuple"):
                    todo.append(user)
                elif user.opcode == "call" and any(
                    i.opcode == "while" for i in program.module.inner_ops(user)
                ):
                    return user
    return None


@dataclasses.dataclass(frozen=True)
class _Stack:
    loop: Instruction
    steps: int  # the loop's trip count
    index: int
    write: Instruction  # the body's result for this element
    update: Instruction  # the value written each step
    carry: bool  # the step's input, unchanged (else one of its intermediates)
    recomputed: bool  # the loop runs inside the reverse-mode pass
    reader: Instruction | None = None  # the later loop that reads it


def _stacked(program: Program, loop: Instruction, steps: int) -> Iterator[_Stack]:
    """Each array `loop` stacks: rewritten in place, one step at a time."""
    body = _body(loop)
    root = program.module.root(body) if body else None
    if body is None or root is None or root.opcode != "tuple":
        return
    recomputed = "transpose(" in loop.op_name
    for index, name in enumerate(root.operands):
        write = program.module.get(name)
        if write is None or steps not in write.shape.dims:
            continue
        dus = _writer(program, write)
        if dus is None or len(dus.operands) < 2:
            continue
        if _loop_element(program, program.module.get(dus.operands[0]), body) != index:
            continue  # not this element's buffer, rewritten in place
        update = program.operand(dus, 1)
        while update is not None and update.opcode in ("bitcast", "copy", "reshape"):
            update = program.operand(update, 0)
        if update is None:
            continue
        carry = _loop_element(program, update, body) is not None
        yield _Stack(loop, steps, index, write, update, carry, recomputed)


def stacks(program: Program) -> list[_Stack]:
    """Every per-step array a loop stores for a later loop, over the whole program."""
    found = []
    for loop in program.module.instructions.values():
        steps = trip_count(program, loop) if loop.opcode == "while" else None
        if not steps or steps < 2:
            continue
        for s in _stacked(program, loop, steps):
            reader = _consumed_by_loop(program, s.loop, s.index)
            if reader is not None:
                found.append(dataclasses.replace(s, reader=reader))
    return found


def held(program: Program, chosen: list[_Stack]) -> int:
    """The bytes `chosen` hold at once. Where XLA's buffer assignment is at hand, stacks
    that share memory (blocks of a scan recomputed one after another, given the same
    offset) count once and the others all count: a loop's stack lives, in the loop's
    buffer, from its start to the later loop that reads it, which the body's own live
    ranges do not show. Without it, the order of the loops decides (`_held_in_order`).
    A stack the program keeps in host memory (offloaded: not XLA's colour 0) holds none of
    the device's bytes."""
    extents: dict[tuple[int, int, int], int] = {}
    for s in chosen:
        found = program.values_of(s.write.name) or [
            v for v in program.values_of(s.loop.name) if v.index == f"{{{s.index}}}"
        ]
        if not found:
            return _held_in_order(program, chosen)
        extents.update({v.extent: v.size for v in found if v.space == 0})
    return sum(extents.values())


def _held_in_order(program: Program, chosen: list[_Stack]) -> int:
    """Without XLA's live ranges: each stack lives from its loop to the loop that reads it,
    in the order the (scheduled) computation lists them; all at once when they are not in
    one computation. A stack written to host memory (its layout's memory space) holds none
    of the device's bytes."""
    chosen = [s for s in chosen if s.write.shape.memory_space == 0]
    if not chosen:
        return 0
    computations = {s.loop.computation for s in chosen} | {
        s.reader.computation for s in chosen if s.reader is not None
    }
    if len(computations) != 1:
        return sum(s.write.shape.nbytes for s in chosen)
    order = {i.name: n for n, i in enumerate(program.module.computations[computations.pop()])}
    spans = [
        (order[s.loop.name], order[s.reader.name] if s.reader else len(order), s.write.shape.nbytes)
        for s in chosen
    ]
    return max(sum(b for a, z, b in spans if a <= start <= z) for start, _, _ in spans)


@dataclasses.dataclass(frozen=True)
class _Judgement:
    stacks: list[_Stack]
    computed: int  # bytes of stacked intermediates held at once
    carried: int  # bytes of stacked carries held at once
    steps: int  # the longest stacking loop's steps
    sentence: str  # the fix, or "" when below the thresholds
    why_not: str  # why it is not named, when below


def _judge(program: Program, chosen: list[_Stack]) -> _Judgement:
    computed = held(program, [s for s in chosen if not s.carry])
    carried = held(program, [s for s in chosen if s.carry])
    steps = max(s.steps for s in chosen)
    total = program.total or 1
    recomputed = all(s.recomputed for s in chosen)
    sentence = why_not = ""
    if computed >= MIN_SHARE * total:
        sentence = (
            (
                "Checkpointing the whole scan (or each block of it) only moves its stacks into "
                "the backward pass, which recomputes the scan storing every step: checkpoint "
                "the scan's body inside each block (lax.scan(jax.checkpoint(body), ...)), or "
                "nest checkpointed scans over segments of about sqrt(steps) steps"
            )
            if recomputed
            else (
                "Checkpoint the loop's body (lax.scan(jax.checkpoint(body), ...), or the same "
                "in lax.fori_loop) so that each step stores only its inputs, or nest "
                "checkpointed scans over segments of about sqrt(steps) steps to store fewer "
                "still"
            )
        )
    elif carried >= MIN_CARRY_SHARE * total and steps >= MIN_STEPS:
        sentence = (
            "Nest checkpointed scans: a scan over about sqrt(steps) segments, each a "
            "checkpointed scan over its steps, stores about 2 sqrt(steps) carries "
            "instead of one per step"
        )
    else:
        why_not = (
            f"stacked step intermediates hold {fmt_bytes(computed)} at once "
            f"({computed / total:.0%} of the total, named from {MIN_SHARE:.0%}) and stacked "
            f"carries {fmt_bytes(carried)} ({carried / total:.0%}, named from "
            f"{MIN_CARRY_SHARE:.0%} over {MIN_STEPS} steps or more; the longest loop has "
            f"{steps})"
        )
    return _Judgement(chosen, computed, carried, steps, sentence, why_not)


def _groups(program: Program) -> list[list[_Stack]]:
    """The stacks, split into loops of the forward pass and loops recomputed in the
    reverse-mode pass (their fixes differ)."""
    found = program.shared(stacks)
    groups = [[s for s in found if s.recomputed], [s for s in found if not s.recomputed]]
    return [g for g in groups if g]


_INDEXED = re.compile(r"(.*[A-Za-z_])(\d+)")
_TRANSFORM = re.compile(r"\w+\((.*)\)")


def _layer(op: str) -> tuple[str, int] | None:
    """The numbered scope (``Block_3``, ``layers/2``) an op name is inside, as (its path
    with the number left out, the number): the first one, a model's outermost repeated
    block. Transformations' marks (``jvp(Block_3)``) are unwrapped; the first component,
    the jitted function's name, is not a scope of the model, nor is the last, the
    primitive (``expm1``)."""
    parts = op.split("/")[1:-1]
    for k, part in enumerate(parts):
        while (m := _TRANSFORM.fullmatch(part)) is not None:
            part = m[1]
        if part.isdigit() and k:
            return "/".join(parts[:k]) + "/#", int(part)
        if (m := _INDEXED.fullmatch(part)) is not None:
            return "/".join([*parts[:k], m[1]]) + "#", int(m[2])
    return None


@dataclasses.dataclass(frozen=True)
class _Layers:
    family: str  # the scope, its number left out
    layers: dict[int, list[tuple[Value, Instruction]]]  # each layer's values, its output left out
    own: list[tuple[Value, Instruction]]  # those that no other detector names
    held: int  # what a checkpoint on each layer frees: all of them, less one layer's
    # The same, counting the values another detector names (attention scores, logits) that
    # a checkpoint on each layer frees too; `held` leaves them to their own findings.
    freed: int
    shared: int  # how many of the values it counts are another detector's


def _same_scope(a: tuple[str, int] | None, b: tuple[str, int]) -> bool:
    """Whether two ops are in the same layer: the same numbered scope, whatever scopes and
    transformations its op name is inside (an op fused or traced apart may lack them)."""
    return a is not None and a[1] == b[1] and a[0].rsplit("/", 1)[-1] == b[0].rsplit("/", 1)[-1]


def _outputs(
    program: Program, scope: tuple[str, int], values: list[tuple[Value, Instruction]]
) -> set[str]:
    """The instructions of a layer's values that the forward pass reads outside the layer
    (through moves): its output, which a checkpoint keeps, as the next layer's input."""
    out = set()
    for _, inst in values:
        todo, seen = [inst.name], set()
        while todo and inst.name not in out:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for user in program.module.users.get(n, ()):
                if user.opcode in _MOVES or program.module.relays(user):
                    todo.append(user.name)
                elif not program.backward_ancestry(user.name) and not _same_scope(
                    _layer(program.describe(user)[0]), scope
                ):
                    out.add(inst.name)
                    break
    return out


def _freed(program: Program, by_layer: dict[int, list[tuple[Value, Instruction]]]) -> int:
    """What a checkpoint on each layer frees of these values: all of them live at the peak,
    less one layer's, which the backward pass recomputes at a time."""
    one = max((program.peak(v for v, _ in values) for values in by_layer.values()), default=0)
    return max(program.peak(v for values in by_layer.values() for v, _ in values) - one, 0)


def _probe_layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.tanh(jnp.tanh(x @ w) @ w.T) + x


def _probe_loss(ws: list[jax.Array], x: jax.Array, checkpoint: bool) -> jax.Array:
    layer = jax.checkpoint(_probe_layer) if checkpoint else _probe_layer
    for w in ws:
        x = layer(w, x)
    return jnp.sum(x * x)


@functools.cache
def _probe(options: tuple[tuple[str, Any], ...]) -> tuple[int, int]:
    """The temporaries of `PROBE_LAYERS` written-out layers' gradient on this process's
    backend, compiled with `options`: (unchecked, each layer checkpointed)."""
    ws = [jax.ShapeDtypeStruct((256, 512), jnp.float32)] * PROBE_LAYERS
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    temps = []
    for checkpoint in (False, True):
        grad = jax.grad(functools.partial(_probe_loss, checkpoint=checkpoint))
        compiled = compile_fn(grad, ws, x, compiler_options=dict(options))
        temps.append(int(compiled.memory_analysis().temp_size_in_bytes))
    return temps[0], temps[1]


def checkpoint_undone(program: Program) -> tuple[int, int] | None:
    """Where `program`'s compiler merges a per-layer checkpoint's recomputation back into
    the forward pass, so that the checkpoint frees nothing: the probe's temporaries
    (unchecked, checkpointed). None where it keeps the checkpoint, or is not probed: only
    this process's CPU backend is (XLA:CPU is the compiler seen undoing it), with the
    program's own options; a GPU or TPU target is not."""
    if program.target is not None or jax.default_backend() != "cpu":
        return None
    plain, checkpointed = _probe(tuple(sorted(program.options.items())))
    return (plain, checkpointed) if checkpointed >= plain else None


def layers(program: Program) -> _Layers | None:
    """The written-out layers whose intermediates the backward pass reads: per numbered
    scope, the temporaries outside loops that the reverse-mode pass reads, less each
    layer's output (what the forward pass reads outside the layer); the scope whose
    intermediates hold the most. Values another detector names count toward `freed`, not
    `held`."""
    if not program.has_backward:
        return None
    claimed = program.shared(grad_accumulation.claimed_elsewhere)
    if program.shared(grad_accumulation.names):  # a new set: the shared one stays as it is
        claimed = claimed | {
            (v.instruction, v.index) for v, _ in program.shared(grad_accumulation.activations)[0]
        }
    kept = program.shared(kept_for_backward)
    families: dict[str, dict[int, list[tuple[Value, Instruction]]]] = {}
    for v in program.values:
        inst = program.module.get(v.instruction)
        if inst is None or v.instruction not in kept:
            continue
        found = _layer(program.describe(inst)[0])
        if found is not None:
            families.setdefault(found[0], {}).setdefault(found[1], []).append((v, inst))
    best = None
    for family, by_layer in families.items():
        # A checkpoint keeps each layer's output and frees the rest, recomputing one
        # layer's at a time in the backward pass.
        rest = {}
        for k, values in by_layer.items():
            out = _outputs(program, (family, k), values)
            rest[k] = [(v, i) for v, i in values if i.name not in out]
        rest = {k: values for k, values in rest.items() if values}
        if len(rest) < 2:
            continue
        mine = {
            k: [(v, i) for v, i in values if (v.instruction, v.index) not in claimed]
            for k, values in rest.items()
        }

        total = _freed(program, rest)
        if best is None or total > best.freed:
            shared = sum(len(rest[k]) - len(mine[k]) for k in rest)
            own = [p for values in mine.values() for p in values]
            best = _Layers(family, rest, own, _freed(program, mine), total, shared)
    return best


def _layers_finding(program: Program, found: _Layers) -> Finding:
    chosen = found.own or [p for values in found.layers.values() for p in values]
    evidence = sorted((program.buffer(i, v) for v, i in chosen), key=lambda b: -b.size)
    first, last = min(found.layers), max(found.layers)
    return finding(
        PATTERN_LAYERS,
        CASE,
        found.held,
        evidence[:6],
        "Checkpoint each layer (jax.checkpoint around the layer's function; flax: "
        "nn.remat(Block), equinox: eqx.filter_checkpoint), or stack the layers' weights "
        "and scan a checkpointed layer over them, so that each layer keeps only its output "
        "and recomputes the rest in the backward pass",
        copy=COPY_LAYERS,
        detail=f"{len(found.layers)} layers ({found.family.replace('#', str(first))} to "
        f"{found.family.replace('#', str(last))}) keep intermediates besides their outputs "
        f"for the backward pass; a checkpoint on each layer frees {fmt_bytes(found.freed)} "
        "at once"
        + (
            f", {fmt_bytes(found.held)} of it counted here: the rest is held by "
            f"{found.shared} values that other findings name (attention scores, logits, the "
            "batch's activations) and counted once, there."
            if found.shared
            else "."
        ),
    )


def detect(program: Program) -> list[Finding]:
    out = []
    found = program.shared(layers)
    if (
        found is not None
        and found.freed >= MIN_LAYER_SHARE * program.total
        and program.shared(checkpoint_undone) is None
    ):
        out.append(_layers_finding(program, found))
    for chosen in _groups(program):
        j = _judge(program, chosen)
        if not j.sentence:
            continue
        evidence = []
        for s in chosen:
            op, source = program.describe(s.update)
            if not source:
                op, source = program.describe(s.write)
            kind = "carry" if s.carry else "intermediate"
            evidence.append(
                Buffer(
                    s.write.shape.nbytes,
                    str(s.write.shape),
                    f"stacked {kind}",
                    f"{s.write.name} ({s.write.opcode})",
                    op,
                    source,
                )
            )
        loops = list(dict.fromkeys(s.loop.name for s in chosen))
        first = program.module.get(loops[0])
        op = program.describe(first)[0] if first else ""
        where = (
            f"a {j.steps}-step loop ({op or loops[0]})"
            if len(loops) == 1
            else f"{len(loops)} loops of up to {j.steps} steps ({op or loops[0]}, ...)"
        )
        recomputed = chosen[0].recomputed
        out.append(
            finding(
                PATTERN_RECOMPUTED if recomputed else PATTERN,
                CASE,
                j.carried + j.computed,
                evidence,
                j.sentence,
                copy=COPY,
                detail=f"{where}{' inside the reverse-mode pass' if recomputed else ''} "
                f"store(s) {len(chosen)} per-step array(s) that a later loop (the backward "
                f"pass) reads, holding at once {fmt_bytes(j.computed)} of step intermediates "
                f"and {fmt_bytes(j.carried)} of step inputs (carries).",
            )
        )
    return out


def near_miss(program: Program) -> NearMiss | None:
    """The stacking this detector saw and did not name, with the threshold it missed."""
    best: NearMiss | None = None
    found = program.shared(layers)
    if found is not None and found.freed > 0:
        kept = (
            f"{len(found.layers)} layers keep intermediates for the backward pass that a "
            f"checkpoint on each would free, {fmt_bytes(found.freed)} at once, "
            f"{found.freed / (program.total or 1):.0%} of the total"
        )
        if found.freed < MIN_LAYER_SHARE * program.total:
            best = NearMiss(
                CASE, PATTERN_LAYERS, found.freed, f"{kept} (named from {MIN_LAYER_SHARE:.0%})"
            )
        elif (undone := program.shared(checkpoint_undone)) is not None:
            plain, checkpointed = undone
            best = NearMiss(
                CASE,
                PATTERN_LAYERS,
                found.freed,
                f"{kept}, but this compiler ({jax.default_backend().upper()}, jax "
                f"{jax.__version__}) merges a checkpoint's recomputation back into the "
                f"forward pass: {PROBE_LAYERS} layers' gradient needs "
                f"{fmt_bytes(checkpointed)} of temporaries with a checkpoint on each layer "
                f"and {fmt_bytes(plain)} without, so here the checkpoint frees nothing "
                "(diagnose for a GPU or TPU target to see what it frees there)",
            )
    for chosen in _groups(program):
        j = _judge(program, chosen)
        if j.sentence:
            continue
        loops = len({s.loop.name for s in chosen})
        miss = NearMiss(
            CASE,
            PATTERN_RECOMPUTED if chosen[0].recomputed else PATTERN,
            j.computed + j.carried,
            f"{loops} loop(s) stack per-step arrays that a later loop reads, but {j.why_not}",
        )
        if best is None or miss.bytes > best.bytes:
            best = miss
    return best
