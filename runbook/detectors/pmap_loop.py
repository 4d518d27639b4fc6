"""`pmap-loop`: a Python loop unrolled into one set of temporaries per iteration, and inputs
replicated on every device.

Unrolled loop. A Python ``for`` loop in a traced function is unrolled: the compiled program holds one
copy of the body per iteration. Where the iterations do not depend on one another, XLA
may compute them side by side, so the same-shape temporaries of one source line exist
once per iteration at the same time. A rolled loop (``lax.fori_loop``, ``lax.scan``,
``lax.map``) keeps one iteration's.

Values that each feed outputs of their own (one weight gradient per layer, each updating
its own layer) are left out: a rolled loop would still return every one of them, so
rolling it would not free them. So are the forward pass's values that the backward pass
reads (each layer's activations): a rolled loop stacks them one per step. And so are
random bits (one dropout draw per layer), which prng-temporaries reads. And so are the
float32 copies XLA:CPU makes of each bfloat16 operand it multiplies (each layer's weights):
a GPU or TPU compiler keeps them in bfloat16, and the diagnosis's caveat counts them.
And so are the broadcasts a GPU compiler writes out for a cuDNN convolution to add (a
time embedding added after each block's convolution): the compiler's operands for the call.

Replicated inputs. ``jax.pmap(..., in_axes=None)``, or a `NamedSharding` with an empty
`PartitionSpec`, puts the whole array on every device. Often intended (parameters in data
parallelism); it matters when the copies are large against a device's memory.
"""

from __future__ import annotations

from collections import defaultdict

import jax

from .._hlo import Instruction, Value
from .._program import Finding, NearMiss, Program, finding
from .._render import fmt_bytes
from ._common import kept_for_backward
from .prng_temporaries import _UNSIGNED, _makes_floats_from_bits
from .resharding import whole
from .sharding_replicated import replicated_state

MIN_REPEATS = 4  # independent copies of one line's temporary, live at once
MIN_SHARE = 0.10  # of the program's total, for either sign (smaller replicated inputs are
# not mentioned)
MAX_EVIDENCE = 8
LARGE = 0.25  # of the device's usable memory: replicated inputs above it are a finding, not
# information
UNROLLED = "unrolled Python loop"
REPLICATED = "inputs replicated on every device"
PATTERN = f"{UNROLLED}, or {REPLICATED}"
CASE = "pmap-loop"


def rule() -> str:
    """How this detector decides, with its thresholds."""
    return (
        f"same-shape temporaries from one source line, at least {MIN_REPEATS} of them computed "
        f"from none of the others and at least {MIN_REPEATS} live at once, all such lines "
        f"together at least {MIN_SHARE:.0%} of the program's total (values inside loops, "
        "values that each feed outputs no other of them feeds, and broadcasts only a GPU "
        "library call reads, are left out); or inputs whose "
        "sharding is the whole array on every device of a multi-device program, together at "
        f"least {MIN_SHARE:.0%} of its total, informational unless at least {LARGE:.0%} of the "
        "device's usable memory (a target's, or the device's own limit)"
    )


_Group = tuple[str, str, list[Value], set[str], int]


# Instructions that compute a tuple element by element from their operands (XLA combines
# the per-layer all-reduces of a gradient into one): followed element-wise, not as a whole.
_ELEMENTWISE_TUPLES = {"tuple", "all-reduce", "all-reduce-start", "all-gather",
                       "all-gather-start", "reduce-scatter", "all-to-all"}  # fmt: skip


def _tuple_positions(program: Program) -> dict[str, dict[str, int]]:
    """Each instruction of `_ELEMENTWISE_TUPLES` with several operands -> each operand's
    first position among them (a program's output tuple has hundreds to look through)."""
    found: dict[str, dict[str, int]] = {}
    for inst in program.module.instructions.values():
        if inst.opcode in _ELEMENTWISE_TUPLES and len(inst.operands) > 1:
            first: dict[str, int] = {}
            for k, operand in enumerate(inst.operands):
                first.setdefault(operand, k)
            found[inst.name] = first
    return found


def _elements(program: Program) -> dict[str, int | None]:
    """Each get-tuple-element -> the element it reads (read from its text once: a loop's
    tuple can have hundreds, each passed at every walk through it)."""
    return {
        inst.name: inst.tuple_index
        for inst in program.module.instructions.values()
        if inst.opcode == "get-tuple-element"
    }


def _outputs_reached(program: Program, name: str, outputs: dict[str, set[int]]) -> set[int]:
    """The program's outputs (by position) that `name` feeds, through any chain of users."""
    users = program.module.users
    positions = program.shared(_tuple_positions)
    elements = program.shared(_elements)
    reached: set[int] = set()
    # (instruction, the tuple element that carries `name`'s value, or None for all of it)
    stack: list[tuple[str, int | None]] = [(name, None)]
    seen = set(stack)
    while stack:
        n, element = stack.pop()
        if element is None:
            reached |= outputs.get(n, set())
        for user in users.get(n, ()):
            nxt: tuple[str, int | None]
            if element is not None and user.opcode == "get-tuple-element":
                if elements[user.name] != element:
                    continue
                nxt = (user.name, None)
            elif element is not None and user.opcode.endswith("-done"):
                nxt = (user.name, element)
            elif element is None and user.opcode in _ELEMENTWISE_TUPLES and len(user.operands) > 1:
                nxt = (user.name, positions[user.name][n])
            else:
                nxt = (user.name, None)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return reached


def _output_positions(program: Program) -> dict[str, set[int]]:
    """Each instruction that computes a program output -> the outputs' positions."""
    outputs: dict[str, set[int]] = defaultdict(set)
    for index, inst in program.outputs():
        outputs[inst.name].add(index[0] if index else 0)
    return outputs


def _per_output(program: Program, names: set[str], outputs: dict[str, set[int]]) -> bool:
    """Whether each of `names` feeds some output and no two feed the same one: values a
    program returns one by one (per-layer gradients), which no rolled loop would free."""
    claimed: set[int] = set()
    for n in names:
        reached = _outputs_reached(program, n, outputs)
        if not reached or reached & claimed:
            return False
        claimed |= reached
    return True


def _library_addend(program: Program, inst: Instruction) -> bool:
    """Whether `inst` is a broadcast that only library calls read: a GPU compiler that folds
    ``h + dense(t)[:, None, None]`` into a cuDNN convolution writes the broadcast out whole as
    the call's addend, once per block: an operand the compiler made for that call, not a
    value the program's code computes."""
    root = program.module.root(inst.calls[0]) if inst.opcode == "fusion" and inst.calls else inst
    users = program.module.users.get(inst.name, ())
    return (
        root is not None
        and root.opcode == "broadcast"
        and bool(users)
        and all(u.opcode == "custom-call" for u in users)
    )


def _repeats(program: Program) -> list[_Group]:
    """Each line's same-shape temporaries repeated at least twice, at least two of them
    computed independently and live at once, and not returned one by one: (shape, source
    line, values, the members computed from no other member, how many are live at once)."""
    groups: dict[tuple[str, str], list[Value]] = defaultdict(list)
    bits = _makes_floats_from_bits(program)
    computed_whole = whole(program)
    for v in program.values:
        inst = program.module.get(v.instruction)
        if v.kind != "temp" or inst is None or program.in_loop(inst):
            continue
        if v.instruction in program.shared(kept_for_backward):
            continue  # a residual the gradient keeps: a rolled loop would stack it too
        if bits and v.shape.split("[")[0] in _UNSIGNED:
            continue  # random bits (dropout's, one draw per layer): prng-temporaries' own
        if v.instruction in program.widened:
            continue  # XLA:CPU's float32 copies of bfloat16 operands: the caveat's, CPU only
        if (v.instruction, v.index) in computed_whole:
            continue  # computed whole on every device: splitting the batch comes first
        if _library_addend(program, inst):
            continue  # a GPU library call's broadcast operand: the compiler's, per call
        _, source = program.describe(inst)
        if source:
            groups[(v.shape, source)].append(v)
    # Every line whose temporaries repeat, independently and at once: one finding for them
    # all (the loop's other lines repeat with it).
    out: list[_Group] = []
    outputs = _output_positions(program)
    for (shape, source), values in groups.items():
        names = {v.instruction for v in values}
        if len(names) < 2:
            continue
        size = max(v.size for v in values)
        together = program.peak(values) // size if size else 0
        if together < 2:
            continue  # one at a time: no loop to roll (the cheap test first)
        # The iterations: members computed from no other member. In a chain (the layers
        # of a network) only the first is; in an unrolled loop of independent iterations
        # every iteration's first value is.
        starts = names - program.module.dependent(names)
        if len(starts) < 2 or _per_output(program, starts, outputs):
            continue  # a chain, or values the program returns one by one
        out.append((shape, source, values, starts, together))
    return out


def near_miss(program: Program) -> NearMiss | None:
    """The largest repeated line this detector did not name, and which test it failed."""
    best: NearMiss | None = None
    for shape, source, values, starts, together in program.shared(_repeats):
        nbytes = program.peak(values)
        if len(starts) >= MIN_REPEATS and together >= MIN_REPEATS:
            if nbytes >= MIN_SHARE * program.total:
                continue  # named (or part of a finding)
            why = (
                f"they hold {fmt_bytes(nbytes)}, {nbytes / (program.total or 1):.0%} of the "
                f"total (named from {MIN_SHARE:.0%})"
            )
        else:
            why = (
                f"{len(starts)} are computed independently and {together} are live at once "
                f"(named from {MIN_REPEATS} of each)"
            )
        miss = NearMiss(
            CASE,
            UNROLLED,
            nbytes,
            f"{len({v.instruction for v in values})} {shape} temporaries come from {source}, "
            f"but {why}",
        )
        if best is None or miss.bytes > best.bytes:
            best = miss
    return best


def _unrolled(program: Program) -> list[Finding]:
    found = [
        g for g in program.shared(_repeats) if len(g[3]) >= MIN_REPEATS and g[4] >= MIN_REPEATS
    ]
    if not found:
        return []
    nbytes = program.peak(v for *_, values, _, _ in found for v in values)
    if nbytes < MIN_SHARE * program.total:
        return []
    found.sort(key=lambda g: -program.peak(g[2]))
    evidence = []
    for _, _, values, starts, _ in found:
        firsts = [v for v in values if v.instruction in starts][:MAX_EVIDENCE]
        evidence += [
            program.buffer(inst, v)
            for v in firsts
            if (inst := program.module.get(v.instruction)) is not None
        ]
    lines = "; ".join(
        f"{shape} values from {source}: {len(starts)} computed independently, {together} "
        "live at once"
        for shape, source, _, starts, together in found[:3]
    )
    return [
        finding(
            UNROLLED,
            CASE,
            nbytes,
            evidence,
            "Roll the loop with lax.fori_loop, lax.scan or lax.map(batch_size=...) so that "
            "one iteration's temporaries exist at a time",
            copy="runbook.cases.pmap_loop.fori_sum",
            detail=f"{lines}: {fmt_bytes(nbytes)} at once, one copy per unrolled iteration.",
        )
    ]


def device_memory(program: Program) -> int | None:
    """The bytes a program may use on one device: the target's, or this device's limit."""
    if program.target is not None:
        return program.target.usable()
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        return None
    return stats.get("bytes_limit")


def _replicated(program: Program) -> list[Finding]:
    # A training step's replicated state is `replicated_state`'s finding (sharding-replicated).
    state = {p.number for p in replicated_state(program)}
    replicated = [p for p in program.parameters if p.replicated and p.number not in state]
    nbytes = sum(p.shape.nbytes for p in replicated)
    if program.devices < 2 or not replicated or nbytes < MIN_SHARE * program.total:
        return []
    memory = device_memory(program)
    large = memory is not None and nbytes >= LARGE * memory
    against = (
        f"{nbytes / memory:.1%} of a device's usable {fmt_bytes(memory)}"
        if memory
        else "no device memory limit known here (pass target= to compare)"
    )
    names = ", ".join(p.path for p in replicated[:4]) + (", ..." if len(replicated) > 4 else "")
    return [
        finding(
            REPLICATED,
            CASE,
            nbytes,
            [program.buffer(p.instruction) for p in replicated],
            "Split large inputs over the devices (in_axes=0 in pmap, or a NamedSharding that "
            "divides an axis) so that each device holds its share",
            copy="runbook.cases.pmap_loop.shard_mapped",
            detail=f"{len(replicated)} input(s) ({names}) are whole on each of "
            f"{program.devices} devices: {fmt_bytes(nbytes)} per device, {against}.",
            informational=not large,
        )
    ]


def detect(program: Program) -> list[Finding]:
    return _unrolled(program) + _replicated(program)
