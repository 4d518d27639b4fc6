"""What a case module declares: its programs (`Variant`) and the problem they belong to (`Case`).

A case module imports this and nothing else of the package, so that the file a reader copies
from needs only JAX (and NumPy, optax) beside it. Measuring, rendering and claims live
elsewhere and import the case, never the other way round.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ._errors import RunbookError, UnknownNameError

ROLES = ("baseline", "reproduction", "fix")
Params = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Variant:
    """One program of a case. `program(params)` returns the function to compile."""

    name: str
    role: str
    summary: str
    program: Callable[[Params], Callable[..., Any]]
    since: str = ""  # a JAX API this variant needs, e.g. "jax.shard_map"
    args: Callable[[Mapping[str, Any], Params, bool], tuple[Any, ...]] | None = None
    # Why this variant cannot be compiled for a platform ("cpu", "cuda", "tpu") on this
    # machine, in a sentence; None: it can. For programs only some compilers can build
    # (cuDNN's kernels): measured elsewhere as "not applicable", with the reason.
    unavailable: Callable[[str], str | None] | None = None
    # How the same-result check gets this variant's result from its compiled program, for a
    # program a user calls several times per result (a step taken once per micro-batch):
    # ``run(compiled, scale, params)`` makes its own real inputs and returns the result.
    # None: one call on the variant's inputs.
    run: Callable[[Callable[..., Any], Mapping[str, Any], Params], Any] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"`role` must be one of {ROLES}, got {self.role!r}")


@dataclasses.dataclass(frozen=True)
class Case:
    """A memory problem: its variants, the scales it runs at and the grid of points.

    Attributes:
        args: ``args(scale, params, concrete)`` gives the inputs: `jax.ShapeDtypeStruct`s,
            or real arrays when `concrete` (only at a runnable scale).
        grid: ``grid(scale)`` lists the params each variant is measured at.
        floor: optional analytic floor per device, ``floor(variant, scale, params)``: bytes
            the program must hold at the least, a lower bound of its compile-time total. A
            floor that differs by compiler takes a keyword ``platform`` too: the platform
            whose compiler built the program (``"cpu"``, ``"cuda"``, ``"tpu"``: a target's,
            or this process's backend), e.g. to leave out an intermediate that XLA's TPU
            compiler fuses into its consumer and never writes to memory. See `floor_bytes`.
        options: ``options()`` gives the XLA options for every compilation of the case.
        cause: why it happens, in a phrase (the case page shows the evidence).
        recommended: the fix the case page recommends (default: the smallest fix).
        shard: ``shard(scale, params, mesh)`` gives abstract inputs split over `mesh`'s axis
            "d" the way the program splits naturally, to ask how many devices it needs.
        compare: optional ``compare(result)``: the part of a variant's result that the
            same-result check compares (default: all of it), for variants whose results
            differ in structure, not in value (e.g. one returns zero gradients for frozen
            weights that another never computes).
        tolerance: the same-result check's largest elementwise error of a fix against the
            reproduction, max |fix - reproduction| / (|reproduction| + 1) (see
            `runbook.verify`); unused when `significance` is set.
        significance: optional: the results are samples of a distribution, compared as
            distributions, not value by value (for fixes that draw from another random
            stream). The same-result check runs a two-sample Kolmogorov-Smirnov test of a
            fix's numbers (every leaf of its compared result, flattened into one sample)
            against the reproduction's: the same unless the test rejects at this
            significance level (p-value below it; see `runbook.verify`). A test, not a
            tolerance, so that a small sample is not taken for a different distribution.
        figures: optional ``"module:function"`` naming ``function(variant, scale, params)``:
            figures the compiler's analysis cannot give (e.g. a real run's host resident
            set), by name: bytes, seconds (names ending ``_seconds``) or counts (names
            ending ``_count``). A name, not the function: a real run is measured by the
            library's runs package (``runbook.runs.<case>``), which a case module does not
            import.
            Called for this process's backend only (never for a target), stored in each
            report's ``figures``.
        key_figure: the name, in ``figures``, of the figure that shows the problem where
            the compiler's total does not (the landing table shows it for this machine).
        runtime: the problem shows only in a real run (memory growing over a loop's steps,
            or while compiling), never in one compiled program: `runbook.watch` names it,
            `runbook.diagnose` cannot.
        shown_on: the compile target whose compiler shows the problem, for a problem that
            one kind of compiler makes and others do not (``"v5e"``: a TPU's tiles). The
            case's own diagnosis compiles for it; None: every compiler shows it.
    """

    name: str
    title: str
    symptom: str
    devices: int
    scales: Mapping[str, Mapping[str, Any]]
    variants: Sequence[Variant]
    args: Callable[[Mapping[str, Any], Params, bool], tuple[Any, ...]]
    grid: Callable[[Mapping[str, Any]], list[dict[str, Any]]]
    floor: Callable[..., int] | None = None
    options: Callable[[], Mapping[str, Any]] = dict
    tolerance: float = 1e-5
    runnable_scale: str = "small"
    cause: str = ""
    recommended: str | None = None
    shard: Callable[[Mapping[str, Any], Params, Any], tuple[Any, ...]] | None = None
    compare: Callable[[Any], Any] | None = None
    figures: str | None = None
    key_figure: str | None = None
    runtime: bool = False
    significance: float | None = None
    shown_on: str | None = None

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        valid = ", ".join(v.name for v in self.variants)
        raise UnknownNameError(f"unknown variant {name!r} of case {self.name!r}; valid: {valid}")

    def floor_bytes(
        self, variant: Variant, scale: Mapping[str, Any], params: Params, platform: str
    ) -> int | None:
        """The case's floor for `variant` compiled by `platform`'s compiler (None: no floor).

        A floor declared without a ``platform`` parameter holds on every compiler.
        """
        if self.floor is None:
            return None
        if _takes_platform(self.floor):
            return int(self.floor(variant, scale, params, platform=platform))
        return int(self.floor(variant, scale, params))

    def inputs(
        self, variant: Variant, scale: Mapping[str, Any], params: Params, concrete: bool
    ) -> tuple[Any, ...]:
        """The arguments `variant` is called with (abstract unless `concrete`)."""
        return (variant.args or self.args)(scale, params, concrete)

    def scale(self, name: str) -> Mapping[str, Any]:
        if name not in self.scales:
            valid = ", ".join(self.scales)
            raise RunbookError(f"unknown scale {name!r} for case {self.name!r}; valid: {valid}")
        return self.scales[name]

    def available(self, variant: Variant) -> bool:
        """False when this JAX lacks an API the variant needs.

        `since` names an attribute path ("jax.shard_map") or a keyword argument of one
        ("jax.lax.map(batch_size=)").
        """
        if not variant.since:
            return True
        path, _, keyword = variant.since.partition("(")
        obj: Any = importlib.import_module(path.split(".")[0])
        for part in path.split(".")[1:]:
            obj = getattr(obj, part, None)
        if obj is None or not keyword:
            return obj is not None
        return keyword.rstrip("=)") in inspect.signature(obj).parameters


def _takes_platform(floor: Callable[..., int]) -> bool:
    try:
        parameters = inspect.signature(floor).parameters
    except (TypeError, ValueError):  # a builtin or C function: the plain signature
        return False
    return "platform" in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


# Set while the runbook compiles for a target (`runbook.target_devices`): the devices a case
# builds its meshes and pmaps on are then the target's compile-only ones.
_DEVICES: contextvars.ContextVar[Callable[[int], list[Any]] | None] = contextvars.ContextVar(
    "runbook_devices", default=None
)


def devices(count: int = 1) -> list[Any]:
    """The first `count` devices to build meshes and pmaps on.

    JAX's own devices, or a compile target's while the runbook compiles for one.
    """
    provider = _DEVICES.get()
    if provider is not None:
        return provider(count)
    import jax  # here, not at the top: the package imports this module before JAX starts

    return jax.devices()[:count]


@contextmanager
def devices_from(provider: Callable[[int], list[Any]] | None) -> Iterator[None]:
    """Inside, `devices(count)` is `provider(count)` (None: JAX's own devices)."""
    token = _DEVICES.set(provider)
    try:
        yield
    finally:
        _DEVICES.reset(token)
