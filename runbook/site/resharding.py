"""The `resharding` page: the reports beside our figures, every variant's bytes per device on
each compiler, and the claims. The model, its step and the constraint that fixes it are in
`runbook.cases.resharding`."""

from __future__ import annotations

import functools
import pathlib
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _cache, _case_types, _subprocess
from .._case import CaseResult, measure_case
from .._measure import MemoryReport
from .._render import Table, fmt_bytes
from ..cases.resharding import CASE
from ..runs.constant_folding import _stderr_to  # descriptor 2, where XLA logs, to a file
from ._accelerator import on_targets, variant_table, worst_point
from ._claims import Claim, verdict

REPORTS = {
    "jax-ml/jax#21562": "XLA warns of an 'involuntary full rematerialization' when a value "
    "must go from one sharding to another it cannot reach by moving shards: the whole tensor "
    "is built on every device (also openxla/xla#15207)",
    "the issue commissioning this case (nanodo FSDP, jax 0.10.2)": "an FSDP language model "
    "computes its activations and logits for the whole global batch on every device; one "
    "with_sharding_constraint on the activations cuts its memory per device to about a third",
}
SHOWN = ("h100", "v5e")  # compiled without the device, on 8 of each

NEEDED = ("unconstrained", "constrain-embedding", "constrain-every", "constrain-remat")
WHOLE_FACTOR = 2  # "whole on every device": the reproduction needs this many times the fix
CLAIMS = {
    "whole-batch": "With the weights split on their model dimension and nothing pinning the "
    f"activations, each device holds the step for the whole global batch: at least "
    f"{WHOLE_FACTOR}x the memory of the same step with its activations pinned to the batch "
    "axis (the issue commissioning this case).",
    "one-constraint": "One with_sharding_constraint, on the embedded tokens, is enough: the "
    "partitioner carries the batch split through every layer and the logits (the same issue).",
    "remat-after": "Once the activations are split, checkpointing each layer lowers the "
    "step's memory further.",
}


def results(names: Sequence[str] = SHOWN) -> dict[str, CaseResult]:
    """Every variant at seed scale, on this backend and each target (8 devices each)."""
    return on_targets(CASE.name, names=names, every_variant=None)


def _cell(report: MemoryReport | None) -> str:
    return "not measured" if report is None else fmt_bytes(report.total)


def memory_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Per variant and compiler: the bytes each device needs."""
    found = found if found is not None else results()
    return variant_table(
        found,
        _cell,
        f"Bytes per device, {CASE.devices} devices, seed scale, jax {jax.__version__}.",
    )


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The claims, decided on this backend or for `target`.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.
    """
    result = result or measure_case(CASE.name, scale, target=target, variants=list(NEEDED))
    at = worst_point(result)
    report = {n: found[0] for n in NEEDED if (found := result.select(n, **at))}

    def said(*names: str) -> str:
        return "; ".join(f"{n}: {_cell(report.get(n))}" for n in names) + " per device."

    def decide(key: str, names: tuple[str, str], holds: Callable[..., bool]) -> Claim:
        chosen = [report.get(n) for n in names]
        if any(r is None for r in chosen):
            return Claim(key, CLAIMS[key], "not reproducible here", said(*names))
        return Claim(key, CLAIMS[key], verdict(holds(*chosen)), said(*names))

    # jax-ml/jax#21562's reshard is compiled on this machine's CPU devices, whose compile log
    # is read here: decided on CPU only (every compiler's row keeps the claim, as a table has)
    on_cpu = target is None and result.provenance.backend == "cpu"
    warned = reshard_claim() if on_cpu else reshard_claim(None, decided=False)
    return [
        decide(
            "whole-batch",
            ("unconstrained", "constrain-every"),
            lambda loose, pinned: loose.total >= WHOLE_FACTOR * pinned.total,
        ),
        decide(
            "one-constraint",
            ("constrain-embedding", "constrain-every"),
            lambda first, every: first.total <= 1.05 * every.total,
        ),
        decide(
            "remat-after",
            ("constrain-every", "constrain-remat"),
            lambda every, remat: remat.total < every.total,
        ),
        warned,
    ]


# jax-ml/jax#21562's pattern, in our own code: two arrays split over both axes of a 4 x 2
# mesh (P("y", None, "x")), their sum constrained to P(None, ("x", "y"), None).
SIDE = 512  # a SIDE**3 float32 array: 512 MiB whole, 64 MiB a device when split 8 ways
WARNING = "Involuntary full rematerialization"


def _reshard_json(side: int) -> dict[str, Any]:
    mesh = Mesh(np.array(_case_types.devices(8)).reshape(4, 2), ("x", "y"))
    given = NamedSharding(mesh, P("y", None, "x"))
    wanted = NamedSharding(mesh, P(None, ("x", "y"), None))

    def f(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
        out: jax.Array = c + jax.lax.with_sharding_constraint(a + b, wanted)
        return out

    shape = (side, side, side)
    args = [jax.ShapeDtypeStruct(shape, jnp.float32, sharding=s) for s in (given, given, wanted)]
    fn = jax.jit(f, in_shardings=(given, given, wanted), out_shardings=wanted)
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        with _stderr_to(log.name):
            stats = fn.lower(*args).compile().memory_analysis()
        text = pathlib.Path(log.name).read_text()
    assert stats is not None  # every backend here reports a memory analysis
    return {
        "warned": WARNING in text,
        "temp": int(stats.temp_size_in_bytes),
        "whole": side**3 * 4,
        "devices": 8,
    }


@functools.cache
def reshard() -> dict[str, Any]:
    """jax-ml/jax#21562's reshard compiled on 8 CPU devices (forced in a child where this
    process has fewer): whether XLA warned, and the temporaries per device against the
    whole array."""
    request = {"kind": "reshard-21562", "side": SIDE}

    def compute() -> dict[str, Any]:
        if jax.device_count() < 8:
            found: dict[str, Any] = _subprocess.call(
                f"{__name__}:_reshard_json", devices=8, side=SIDE
            )
            return found
        return _reshard_json(SIDE)

    found: dict[str, Any] = _cache.cached(request, compute, module=__name__)
    return found


RESHARD_CLAIM = (
    "A reshard the partitioner cannot do by moving shards warns of an 'involuntary full "
    "rematerialization' and builds the whole array on every device (jax-ml/jax#21562)."
)


def reshard_claim(found: Mapping[str, Any] | None = None, *, decided: bool = True) -> Claim:
    """jax-ml/jax#21562: the warning, and the whole array built on every device (not
    `decided`: for a compile target, where this page reads no compile log)."""
    text = RESHARD_CLAIM
    if not decided:
        why = "decided on this machine's CPU devices only, where the page reads XLA's log"
        return Claim("reshard-21562", text, "not reproducible here", why)
    found = found if found is not None else reshard()
    evidence = (
        f"warning {'printed' if found['warned'] else 'not printed'}; temporaries "
        f"{fmt_bytes(found['temp'])} per device against {fmt_bytes(found['whole'])} whole "
        f"({found['devices']} CPU devices)."
    )
    holds = found["warned"] and found["temp"] >= found["whole"]
    return Claim("reshard-21562", text, verdict(holds), evidence)


def reports_table(found: Mapping[str, CaseResult] | None = None) -> Table:
    """Each report beside what this machine's CPU gives."""
    found = found if found is not None else results()
    cpu = next(iter(found.values()))
    decided = {c.key: c for c in claims(cpu)}
    warned = decided.get("reshard-21562") or reshard_claim()
    rows = [["jax-ml/jax#21562", REPORTS["jax-ml/jax#21562"], warned.verdict, warned.evidence]]
    issue = "the issue commissioning this case (nanodo FSDP, jax 0.10.2)"
    claim = decided["whole-batch"]
    rows.append([issue, REPORTS[issue], claim.verdict, claim.evidence])
    return Table(
        ["report", "what it says", "verdict here", "measured"],
        rows,
        f"{cpu.provenance.label()}.",
    )
