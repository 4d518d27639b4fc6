"""The `sharding-replicated` page: the reports beside our figures, what placement JAX gives
an axis the mesh does not divide, creating the state sharded against on one device, and
the claims. The reproduction and its fixes are in `runbook.cases.sharding_replicated`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import _cache, _spec, _subprocess, _targets
from .._case import CaseResult, measure_case
from .._claims import Claim, verdict
from .._measure import measure
from .._pages import cited_reports_table
from .._render import Table, fmt_bytes
from ..cases.sharding_replicated import AXIS, CASE, DEVICES, fsdp, init, state_bytes

# What the reports say, summarised; ours is measured beside it.
REPORTS = {
    "jax-ml/jax#14075": "an array created on one device and then sharded over 8 devices can "
    "only be about half as large as what one device holds",
    "jax-ml/jax#16679": "creating a 6B-parameter model's Adam state with pjit and "
    "out_shardings runs out of memory where device_put of the same state does not",
    "jax-ml/jax#18263, #19893": "a large model's parameters and optimizer state run out of "
    "memory on each device although they would fit the devices together",
    "jax-ml/jax#26946": "a sharding constraint on an axis the mesh does not divide silently "
    "replicates the array instead of sharding it",
    "the issue commissioning this case (jax 0.10.2)": "16 layers of 8192x8192 with Adam on 8 "
    "devices: 12 GiB of arguments per device replicated, 1.5 GiB sharded; 8 GiB of "
    "temporaries in both",
}

ODD_ROWS = 8 * 1024 + 1  # #26946: an axis 8 devices do not divide
COLUMNS = 1024


def _on_mesh(name: str, **kwargs: Any) -> Any:
    """`name(**kwargs)` with `DEVICES` devices: forced in a child on a CPU that lacks them."""
    fn = globals()[name]
    if kwargs.get("target") is None and jax.device_count() < DEVICES:
        return _subprocess.call(f"{__name__}:{name}", devices=DEVICES, **kwargs)
    return fn(**kwargs)


def _mesh() -> Mesh:
    return Mesh(np.array(_spec.devices(DEVICES)), (AXIS,))


def _indivisible_json(concrete: bool) -> list[dict[str, Any]]:
    """A (rows, COLUMNS) array made inside `jit` and constrained to ``P(AXIS, None)``, for
    rows the devices do not divide and rows they do."""
    mesh = _mesh()
    sharding = NamedSharding(mesh, P(AXIS, None))
    found = []
    for rows in (ODD_ROWS, ODD_ROWS - 1):

        def make(rows: int = rows) -> jax.Array:
            x = jnp.arange(rows * COLUMNS, dtype=jnp.float32).reshape(rows, COLUMNS)
            out: jax.Array = jax.lax.with_sharding_constraint(x, sharding)
            return out

        compiled = jax.jit(make).lower().compile()
        stats = compiled.memory_analysis()
        assert stats is not None
        out = compiled.output_shardings
        one: dict[str, Any] = {
            "rows": rows,
            "whole": rows * COLUMNS * 4,
            "output": int(stats.output_size_in_bytes),
            "replicated": bool(out.is_fully_replicated),
            "spec": str(getattr(out, "spec", out)),
        }
        if concrete:  # device_put of the same array to the same sharding, for real
            try:
                jax.device_put(np.zeros((rows, COLUMNS), np.float32), sharding)
                one["device_put"] = "accepted"
            except ValueError as e:
                one["device_put"] = f"refused: {str(e).splitlines()[0][:120]}"
        found.append(one)
    return found


@functools.cache  # once per process: every target's claims read the same CPU figures
def indivisible() -> list[dict[str, Any]]:
    """jax-ml/jax#26946 on this JAX, over `DEVICES` (forced) CPU devices: an axis they do not
    divide, then one they do: per device, the output's bytes, its sharding, and what
    `device_put` to the same sharding does."""
    request = {"kind": "sharding-indivisible", "rows": ODD_ROWS, "devices": DEVICES}
    compute = functools.partial(_on_mesh, "_indivisible_json", concrete=True)
    found: list[dict[str, Any]] = _cache.cached(request, compute, module=__name__)
    return found


def indivisible_table(found: list[dict[str, Any]], caption: str = "") -> Table:
    rows = [
        [f"{f['rows']:,} x {COLUMNS:,}", "yes" if f["rows"] % DEVICES == 0 else "no",
         fmt_bytes(f["whole"]), fmt_bytes(f["output"]), f"{f['whole'] / f['output']:.2f}x",
         "yes" if f["replicated"] else "no", f["device_put"]]
        for f in found
    ]  # fmt: skip
    return Table(
        ["array", f"rows divide by {DEVICES}", "whole array", "per device, constrained in jit",
         "whole / per device", "replicated", "device_put to the same sharding"],
        rows,
        caption,
    )  # fmt: skip


def _init_json(scale: str, target: str | None) -> dict[str, Any]:
    """The state made by `init` on one device, and made sharded (`out_shardings`)."""
    size = CASE.scale(scale)
    layers, width = size["layers"], size["width"]
    make = functools.partial(init, layers=layers, width=width)
    with _targets.compiling_for(target):
        key = jax.eval_shape(lambda: jax.random.key(0))
        one = _spec.devices(1)[0]
        placed = jax.ShapeDtypeStruct(
            key.shape, key.dtype, sharding=jax.sharding.SingleDeviceSharding(one)
        )
        whole = measure(make, placed, name="one device", target=target)
        mesh = _mesh()
        shapes = jax.eval_shape(make, key)
        shardings = (fsdp(mesh, shapes[0]), fsdp(mesh, shapes[1]))
        spread = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, P()))
        sharded = measure(
            jax.jit(make, out_shardings=shardings), spread, name="sharded", target=target
        )
    return {
        "one": {"output": whole.output, "temp": whole.temp},
        "sharded": {"output": sharded.output, "temp": sharded.temp},
    }


@functools.cache
def init_placement(scale: str = "issue") -> dict[str, Any]:
    """Creating the state: with `init` on one device (then a `device_put` would split it)
    against `jit(init, out_shardings=...)`, per device, compiled (nothing allocated)."""
    request = {"kind": "sharding-init", "scale": scale, "devices": DEVICES}
    compute = functools.partial(_on_mesh, "_init_json", scale=scale, target=None)
    found: dict[str, Any] = _cache.cached(request, compute, module=__name__)
    return found


def init_table(found: dict[str, Any], scale: str = "issue", caption: str = "") -> Table:
    rows = [
        ["init on one device (then device_put)", "1", fmt_bytes(found["one"]["output"]),
         fmt_bytes(found["one"]["temp"])],
        ["jit(init, out_shardings=fsdp(...))", str(DEVICES),
         fmt_bytes(found["sharded"]["output"]), fmt_bytes(found["sharded"]["temp"])],
    ]  # fmt: skip
    return Table(
        ["how the state is created", "devices", "state per device", "temporaries per device"],
        rows,
        caption or f"The whole state is {fmt_bytes(state_bytes(CASE.scale(scale)))}.",
    )


def issue_scale() -> CaseResult:
    """The case at the issue's own scale (16 layers), on this backend."""
    return measure_case(CASE.name, "issue")


def reports_table(result: CaseResult) -> Table:
    issue = issue_scale()
    rep, fs = issue.one("replicated"), issue.one("fsdp")
    seed_rep = result.one("replicated")
    init_found = init_placement()
    odd = indivisible()[0]
    ours = [
        (
            f"creating the state on one device needs {fmt_bytes(init_found['one']['output'])} "
            f"there; created sharded, {fmt_bytes(init_found['sharded']['output'])} per device"
        ),
        (
            f"created sharded with jit(out_shardings): {fmt_bytes(init_found['sharded']['output'])}"
            " per device (#16679's state was a closure constant: see the closure-constant case)"
        ),
        (
            f"{fmt_bytes(seed_rep.argument)} of arguments per device replicated at "
            f"{CASE.scale(result.scale)['layers']} layers"
        ),
        (
            f"{odd['rows']:,} rows over {DEVICES} devices: {fmt_bytes(odd['output'])} per device "
            f"of {fmt_bytes(odd['whole'])} ({'replicated' if odd['replicated'] else 'not replicated'}); "
            f"device_put {odd['device_put'].split(':')[0]}"
        ),
        (
            f"{fmt_bytes(rep.argument)} replicated, {fmt_bytes(fs.argument)} sharded; temporaries "
            f"{fmt_bytes(rep.temp)} replicated, {fmt_bytes(fs.temp)} sharded"
        ),
    ]
    return cited_reports_table(REPORTS, ours, issue.provenance.label())


def claims(
    result: CaseResult | None = None, *, target: str | None = None, scale: str = "seed"
) -> list[Claim]:
    """The reports' claims and the common advice, decided by measurements.

    Args:
        result: the case measured (measured here when not given).
        target: decide the claims for this compile target instead of this backend.
        scale: the scale to measure at when `result` is not given.

    How JAX places an axis the mesh does not divide, and where `init` puts the state, are
    JAX's decisions before any compiler: those two are decided on this machine's CPU
    devices for every target.
    """
    result = result or measure_case(CASE.name, scale, target=target)
    rep, fs, scan = (result.one(n) for n in ("replicated", "fsdp", "fsdp-scan"))
    size = CASE.scale(result.scale)
    params = state_bytes(size) // 3
    odd, even = indivisible()
    made = init_placement()
    return [
        Claim(
            "sharding-divides",
            f"Sharding the parameters and the optimizer state over {DEVICES} devices divides "
            "each device's state by the mesh size.",
            verdict(rep.argument >= 0.95 * DEVICES * fs.argument),
            f"arguments per device: {fmt_bytes(rep.argument)} replicated, "
            f"{fmt_bytes(fs.argument)} sharded ({rep.argument / fs.argument:.2f}x); totals "
            f"{fmt_bytes(rep.total)} and {fmt_bytes(fs.total)}.",
        ),
        Claim(
            "temporaries-stay",
            "Sharding the state does not shrink the step's temporaries.",
            verdict(fs.temp >= 0.9 * rep.temp),
            f"temporaries per device: {fmt_bytes(rep.temp)} replicated, {fmt_bytes(fs.temp)} "
            "sharded.",
        ),
        Claim(
            "all-layers-gathered",
            "Sharded, without scanning, the temporaries hold every layer's gathered weights "
            "at once.",
            verdict(fs.temp >= 0.9 * params),
            f"{fmt_bytes(fs.temp)} of temporaries per device, against "
            f"{fmt_bytes(params)} for every layer's weights whole.",
        ),
        Claim(
            "scan-checkpoint-fixes",
            "Scanning the stacked layers with jax.checkpoint removes the gathered weights: "
            "the step then needs little more than its floor.",
            verdict(scan.temp <= 0.5 * fs.temp and scan.total <= 1.25 * scan.lower_bound),
            f"temporaries {fmt_bytes(scan.temp)} scanned against {fmt_bytes(fs.temp)} "
            f"unrolled; total {fmt_bytes(scan.total)}, {scan.overhead:.3f}x its floor.",
        ),
        Claim(
            "indivisible-replicated",
            "A sharding constraint on an axis the mesh does not divide silently replicates "
            "the array (jax-ml/jax#26946).",
            verdict(odd["replicated"] and odd["output"] >= odd["whole"]),
            f"decided on CPU: {odd['rows']:,} rows give {fmt_bytes(odd['output'])} per device "
            f"of {fmt_bytes(odd['whole'])}, {odd['spec']}; {even['rows']:,} rows give "
            f"{fmt_bytes(even['output'])}. device_put of the odd one: {odd['device_put']}.",
        ),
        Claim(
            "init-one-device",
            "Creating the state on one device and then calling device_put needs the whole "
            "state on that device (jax-ml/jax#14075).",
            verdict(made["one"]["output"] >= state_bytes(CASE.scale("issue"))),
            f"decided on CPU at the issue's scale: init on one device outputs {fmt_bytes(made['one']['output'])}; "
            f"jit(init, out_shardings=...) {fmt_bytes(made['sharded']['output'])} per device.",
        ),
    ]
