"""Cases: a reproduction, its baseline and its fixes, measured the same way."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from . import _cache, _subprocess, _targets, cases
from ._buffers import Buffer
from ._case_types import Case, Params, Variant
from ._errors import DoesNotFitError, RunbookError, UnknownNameError
from ._measure import MemoryReport, compile_fn, measure
from ._provenance import Provenance
from ._quiet import start_backend

# Every module of `runbook.cases` is a case: ``runbook/cases/<name>.py`` holds the case
# ``<name>`` with dashes for underscores (checked when it loads). Found from the files, so a new
# case is only its own files; listing them imports none (`import runbook` stays light).
_CASES = {
    m.name.replace("_", "-"): f"runbook.cases.{m.name}"
    for m in sorted(pkgutil.iter_modules(cases.__path__), key=lambda m: m.name)
    if not m.name.startswith("_")
}


def case_names() -> list[str]:
    """Names of every case, in alphabetical order (the order the site presents them)."""
    return list(_CASES)


def get_case(name: str) -> Case:
    """The `Case` called `name` (see `case_names()`)."""
    if name not in _CASES:
        raise UnknownNameError(f"unknown case {name!r}; valid: {', '.join(_CASES)}")
    case: Case = importlib.import_module(_CASES[name]).CASE
    if case.name != name:
        raise RunbookError(f"{_CASES[name]} holds the case {case.name!r}: its file must be named "
                           f"{case.name.replace('-', '_')}.py")  # fmt: skip
    return case


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """Every variant of a case measured at one scale.

    Attributes:
        skipped: the programs not measured, each ``{"name", "params", "status", "reason"}``:
            status ``"not applicable"`` (this JAX lacks an API the variant needs), ``"does
            not fit"`` (a target's compiler refused it as too large for one device; with
            ``"needed"`` and ``"limit"`` bytes) or ``"failed"`` (the compiler rejected it).
    """

    case: str
    scale: str
    provenance: Provenance
    reports: tuple[MemoryReport, ...]
    skipped: tuple[dict[str, Any], ...] = ()

    @property
    def target(self) -> _targets.Target | None:
        """The target these figures were compiled for; None for this process's backend."""
        return _targets.get_target(self.provenance.target) if self.provenance.target else None

    def select(
        self, name: str | None = None, role: str | None = None, **params: Any
    ) -> list[MemoryReport]:
        """Reports matching a variant name, a role and params."""
        return [
            r
            for r in self.reports
            if (name is None or r.name == name)
            and (role is None or r.role == role)
            and all(r.params.get(k) == v for k, v in params.items())
        ]

    def figures_of(self, name: str) -> Mapping[str, float]:
        """Variant `name`'s real-run figures (`Case.figures`): measured on this machine's
        backend only, never for a target, and not where this JAX lacks the variant's API."""
        found = self.select(name)
        if not found or not found[0].figures:
            where = f"the {self.target.name} target" if self.target else "this result"
            raise RunbookError(
                f"no real-run figures for {name!r} in {where}: they are measured on this "
                "machine's backend only, where this JAX has the variant's API"
            )
        return found[0].figures

    def one(self, name: str, **params: Any) -> MemoryReport:
        found = self.select(name, **params)
        if len(found) != 1:
            raise RunbookError(f"{len(found)} reports match {name!r} {params}")
        return found[0]

    def to_json(self) -> dict[str, Any]:
        p = self.provenance
        return {
            "case": self.case,
            "scale": self.scale,
            "backend": p.backend,
            "jax": p.jax,
            "jaxlib": p.jaxlib,
            "device_kind": p.device_kind,
            "devices": p.devices,
            "machine": p.machine,
            "generated": p.date,
            "target": self.target.to_json() if self.target else None,
            "variants": [r.to_json() for r in self.reports],
            "skipped": list(self.skipped),
        }

    @classmethod
    def from_json(
        cls, data: Mapping[str, Any], buffers: Mapping[str, Any] | None = None
    ) -> CaseResult:
        prov = Provenance(
            data["backend"],
            data["device_kind"],
            data["devices"],
            data["jax"],
            data["jaxlib"],
            data.get("machine", ""),
            data.get("generated", ""),
            (data.get("target") or {}).get("name", ""),
        )
        reports = []
        for i, v in enumerate(data["variants"]):
            b = v["bytes"]
            default_floor = b["argument"] + b["output"] - b["alias"]
            reports.append(
                MemoryReport(
                    v["name"],
                    b["argument"],
                    b["output"],
                    b["temp"],
                    b["alias"],
                    dataclasses.replace(prov, devices=v.get("devices", prov.devices)),
                    role=v["role"],
                    params=v["params"],
                    floor=None if v["lower_bound"] == default_floor else v["lower_bound"],
                    compile_seconds=v.get("compile_seconds", 0.0),
                    figures=dict(v.get("figures", {})),
                    host={k: n for k, n in v.get("host_bytes", {}).items() if k != "total"},
                    caveats=tuple(v.get("caveats", ())),
                    buffers=tuple(Buffer(**x) for x in (buffers or {}).get(str(i), ())),
                )
            )
        return cls(
            data["case"], data["scale"], prov, tuple(reports), tuple(data.get("skipped", ()))
        )


def _needs_child(case: Case) -> bool:
    start_backend()  # this may be a page's first JAX call: the plugins' chatter filtered
    return jax.device_count() < case.devices


def measured_here(
    case: str, result: CaseResult | None, target: str | None, scale: str
) -> CaseResult:
    """`result`, else `case` measured on this machine at `scale`: what claims decided by a
    real run read. A compile target has no run (`RunbookError`)."""
    if target is not None:
        raise RunbookError(
            f"no real-run figures for {target}: {case}'s are measured on this machine's "
            "backend only"
        )
    return result or measure_case(case, scale)


def measure_case(
    name: str,
    scale: str = "seed",
    *,
    target: str | _targets.Target | None = None,
    buffers: bool = False,
    variants: Sequence[str] | None = None,
    at: Mapping[str, Any] | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> CaseResult:
    """Measure every variant of case `name` at every point of its grid, allocating nothing.

    On this process's backend, a case that needs more devices than the process has runs in
    a fresh process with forced host devices. For a `target`, the programs are compiled
    here, on the target's compile-only devices.

    Args:
        name: a case name from `case_names()`.
        scale: a scale of the case ("seed" is the write-up's full size).
        target: compile for this device (see `runbook.targets()`) instead of this
            process's backend. A program too large for one of its devices is listed in
            ``skipped`` with the compiler's figures.
        buffers: keep the largest buffers of each program (root-cause evidence).
        variants: only these variants (default: all).
        at: only the grid points whose params include these, e.g. ``{"iterations": 32}``.
        compiler_options: XLA options replacing the case's own (``{}``: XLA's defaults);
            compiled in a fresh process, so that an option crashing XLA cannot end this one.
        progress: called with a line per measured program.

    Raises:
        ChildCrashed: XLA crashed compiling with `compiler_options`.
    """
    # Names are resolved here, once; everything below takes the Case and the Target.
    case = get_case(name)
    t = _targets.resolve(target)
    case.scale(scale)
    for v in variants or ():
        case.variant(v)
    # Options other than the case's own are a trial, and some options crash XLA's compiler:
    # those compile in a child, whose crash the caller gets as `_subprocess.ChildCrashed`.
    if t is None and compiler_options is None and _needs_child(case):
        return _in_child(case, scale, buffers, variants, at)
    if t is None and compiler_options is not None:
        data = _subprocess.call(
            "runbook._case:_measure_json",
            devices=case.devices,
            name=name,
            scale=scale,
            buffers=buffers,
            variants=list(variants) if variants else None,
            at=dict(at) if at else None,
            compiler_options=dict(compiler_options),
        )
        return CaseResult.from_json(data["result"], data["buffers"])
    return _measure_here(case, scale, t, buffers, variants, at, compiler_options, progress)


def _in_child(
    case: Case,
    scale: str,
    buffers: bool,
    variants: Sequence[str] | None,
    at: Mapping[str, Any] | None,
) -> CaseResult:
    """A multi-device case measured in a child with forced host devices.

    The child's whole answer is cached (with its buffers, under a request that a filter
    selecting everything does not change), so that a page asking again, with or without
    buffers, at the worst point it already measured, starts no second child.
    """
    size = case.scales[scale]
    points = case.grid(size)
    if at and all(all(p.get(k) == v for k, v in at.items()) for p in points):
        at = None  # every grid point: the same programs as no filter
    if variants and set(variants) >= {v.name for v in case.variants}:
        variants = None
    request = {
        "kind": "case-child", "case": case.name, "scale": scale,
        "variants": sorted(variants) if variants else None, "at": dict(at) if at else None,
    }  # fmt: skip
    data = _cache.cached(
        request,
        lambda: _subprocess.call(
            "runbook._case:_measure_json",
            devices=case.devices,
            name=case.name,
            scale=scale,
            buffers=True,
            variants=request["variants"],
            at=request["at"],
            compiler_options=None,
        ),
        module=_CASES[case.name],
    )
    result = CaseResult.from_json(data["result"], data["buffers"])
    if buffers:
        return result
    bare = tuple(dataclasses.replace(r, buffers=()) for r in result.reports)
    return dataclasses.replace(result, reports=bare)


def _measure_here(
    case: Case,
    scale: str,
    t: _targets.Target | None,
    buffers: bool,
    variants: Sequence[str] | None,
    at: Mapping[str, Any] | None,
    compiler_options: Mapping[str, Any] | None,
    progress: Callable[[str], None] | None,
) -> CaseResult:
    """`measure_case` in this process, whatever its devices and options."""
    with _targets.compiling_for(t):
        reports, skipped = _measure_variants(
            case, scale, t, buffers, variants, at, compiler_options, progress
        )
    provenance = Provenance.for_target(t, case.devices) if t is not None else Provenance.current()
    return CaseResult(case.name, scale, provenance, tuple(reports), tuple(skipped))


def _measure_variants(
    case: Case,
    scale: str,
    target: _targets.Target | None,
    buffers: bool,
    variants: Sequence[str] | None,
    at: Mapping[str, Any] | None,
    compiler_options: Mapping[str, Any] | None,
    progress: Callable[[str], None] | None,
) -> tuple[list[MemoryReport], list[dict[str, Any]]]:
    size = case.scales[scale]
    if compiler_options is not None:
        options = compiler_options
    else:
        options = case.options() if target is None else {}
    reports: list[MemoryReport] = []
    skipped: list[dict[str, Any]] = []
    platform = target.platform if target is not None else jax.default_backend()
    for variant in case.variants:
        if variants and variant.name not in variants:
            continue
        for params in case.grid(size):
            if at and any(params.get(k) != v for k, v in at.items()):
                continue
            where = {"name": variant.name, "role": variant.role, "params": dict(params)}
            if not case.available(variant):
                skipped.append(
                    {**where, "status": "not applicable", "reason": f"needs {variant.since}"}
                )
                continue
            reason = variant.unavailable(platform) if variant.unavailable else None
            if reason:
                skipped.append({**where, "status": "not applicable", "reason": reason})
                continue
            # Reading the buffers back adds a few percent to a compile; storing them always
            # lets one compile answer both kinds of request (a page asks for both).
            request = {
                "kind": "case-program", "case": case.name, "scale": scale, **where,
                "target": target.name if target else None, "options": dict(options),
            }  # fmt: skip
            got = _cache.cached(
                request,
                functools.partial(_measure_one, case, variant, size, params, target, options),
                module=_CASES[case.name],
            )
            if "skipped" in got:
                skipped.append({**where, **got["skipped"]})
                if progress:
                    progress(f"{case.name} {variant.name} {params}: {got['skipped']['status']}")
                continue
            report = MemoryReport.from_record(got["report"])
            floor = case.floor_bytes(variant, size, params, platform)
            report = dataclasses.replace(
                report, role=variant.role, params=params, floor=floor,
                buffers=report.buffers if buffers else (),
            )  # fmt: skip
            if case.figures is not None and target is None and compiler_options is None:
                report = dataclasses.replace(
                    report, figures=_figures(case, scale, variant, size, params)
                )
            reports.append(report)
            if progress:
                progress(f"{case.name} {variant.name} {params}: {report.total:,} bytes")
    return reports, skipped


def _figures(
    case: Case, scale: str, variant: Variant, size: Mapping[str, Any], params: Params
) -> dict[str, int]:
    """`case.figures` for one program, cached apart from its compile-time report."""
    assert case.figures is not None
    request = {"kind": "case-figures", "case": case.name, "scale": scale,
               "name": variant.name, "params": dict(params)}  # fmt: skip
    module, _, name = case.figures.partition(":")
    function = getattr(importlib.import_module(module), name)
    got = _cache.cached(
        request,
        lambda: {k: _figure(k, v) for k, v in function(variant, size, params).items()},
        module=module,
    )
    return dict(got)


def _figure(name: str, value: float) -> float:
    """A figure as stored: seconds as measured, bytes and counts (``_count``) as integers."""
    return float(value) if name.endswith("_seconds") else int(value)


def _measure_one(
    case: Case,
    variant: Variant,
    size: Mapping[str, Any],
    params: Params,
    target: _targets.Target | None,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """One program: ``{"report": record}``, or ``{"skipped": entry}`` for a target's refusal."""
    args = case.inputs(variant, size, params, False)
    try:
        report = measure(
            variant.program(params),
            *args,
            name=variant.name,
            compiler_options=options,
            buffers=True,
            target=target,
        )
    except DoesNotFitError as e:
        return {"skipped": {"status": "does not fit", "reason": str(e), "needed": e.needed,
                            "limit": e.limit, "what": e.what}}  # fmt: skip
    except RunbookError as e:
        if target is None:
            raise
        return {"skipped": {"status": "failed", "reason": str(e)}}
    return {"report": report.to_record()}


def _measure_json(
    name: str,
    scale: str,
    buffers: bool,
    variants: list[str] | None,
    at: dict[str, Any] | None,
    compiler_options: dict[str, Any] | None,
) -> dict[str, Any]:
    # Measured here: this child is the fresh process measure_case asked for (calling
    # measure_case again would start another child for the same options, and so on).
    result = _measure_here(
        get_case(name), scale, None, buffers, variants, at, compiler_options, None
    )
    return {
        "result": result.to_json(),
        "buffers": {
            str(i): [dataclasses.asdict(b) for b in _kept(r.buffers)]
            for i, r in enumerate(result.reports)
        },
    }


def _kept(buffers: Sequence[Buffer], count: int = 40) -> list[Buffer]:
    """The `count` largest buffers, and the `count` largest temporaries, in size order:
    a program's arguments may outnumber its temporaries of the same size."""
    temps = {id(b) for b in [b for b in buffers if b.kind == "temp"][:count]}
    return [b for i, b in enumerate(buffers) if i < count or id(b) in temps]


def run_variant(case: Case, variant: Variant, scale: str, params: Params) -> Any:
    """Execute one variant on real inputs; returns its result as a NumPy pytree."""
    size = case.scale(scale)
    abstract = case.inputs(variant, size, params, False)
    compiled = compile_fn(  # a donation warning is the measurement's caveat, not news here
        variant.program(params), *abstract, compiler_options=case.options(), unusable=[]
    )
    if variant.run is not None:  # a program called several times per result
        return jax.tree_util.tree_map(np.asarray, variant.run(compiled, size, params))
    args = case.inputs(variant, size, params, True)
    return jax.tree_util.tree_map(np.asarray, compiled(*args))


def _verify_json(name: str, scale: str) -> list[dict[str, Any]]:
    case = get_case(name)
    size = case.scale(scale)
    reproduction = next(v for v in case.variants if v.role == "reproduction")
    pick = case.compare or (lambda result: result)
    checks = []
    for params in case.grid(size):
        expected = pick(run_variant(case, reproduction, scale, params))
        for v in case.variants:
            if v.role != "fix" or not case.available(v):
                continue
            if v.unavailable is not None and v.unavailable(jax.default_backend()):
                continue
            got = pick(run_variant(case, v, scale, params))
            check: dict[str, Any] = {"name": v.name, "params": dict(params)}
            if case.significance is None:
                diffs = jax.tree_util.tree_map(
                    lambda a, b: float(np.max(np.abs(a - b) / (np.abs(b) + 1.0))), got, expected
                )
                err = max(jax.tree_util.tree_leaves(diffs))
                check |= {
                    "compared": "values",
                    "max_rel_error": err,
                    "tolerance": case.tolerance,
                    "same": err <= case.tolerance,
                }
            else:
                # Samples of a distribution (another random stream): a two-sample
                # Kolmogorov-Smirnov test of the result's numbers (all its leaves, flattened,
                # one sample); the same unless it rejects at the case's significance. No
                # elementwise error is measured: `max_rel_error` is None. Past 2**24 numbers
                # the test reads an even stride of them (a sample of the same draws, as
                # independent), so that its sorts and CDFs fit in a few GiB at any scale.
                from scipy import stats  # type: ignore[import-untyped]  # scipy has no types

                def sample(tree: Any, most: int = 1 << 24) -> Any:
                    flat = [np.ravel(np.asarray(x)) for x in jax.tree_util.tree_leaves(tree)]
                    stride = -(-sum(x.size for x in flat) // most)
                    return np.concatenate([x[::stride].astype(np.float64) for x in flat])

                a, b = sample(got), sample(expected)
                ks = stats.ks_2samp(a, b)
                p_value = float(ks.pvalue)
                check |= {
                    "compared": "distribution",
                    "test": "two-sample Kolmogorov-Smirnov",
                    "sizes": [a.size, b.size],
                    "ks_statistic": float(ks.statistic),
                    "p_value": p_value,
                    "max_rel_error": None,
                    "tolerance": case.significance,
                    "same": p_value >= case.significance,
                }
            checks.append(check)
    return checks


def verify(name: str, scale: str | None = None) -> list[dict[str, Any]]:
    """Run each fix and the reproduction on the same real inputs and compare results.

    Each check is a dict: ``name`` (the fix), ``params`` (the grid point), ``compared``,
    ``max_rel_error``, ``tolerance`` and ``same``. Values (``compared == "values"``): the
    error is max |fix - reproduction| / (|reproduction| + 1), elementwise, and ``same`` when
    it is at most the case's tolerance. Distributions (``"distribution"``, a case with a
    `~runbook._case_types.Case.significance`: fixes that draw from another random stream):
    a two-sample Kolmogorov-Smirnov test of the fix's numbers against the reproduction's
    (at most 2**24 of each, an even stride of them past that: ``sizes``), with
    ``ks_statistic`` and ``p_value``; ``tolerance`` is the significance level, ``same``
    when the test does not reject at it (p-value >= significance), and ``max_rel_error`` is
    None (no elementwise error is measured). Runs at the case's runnable scale by default.
    """
    case = get_case(name)
    scale = scale or case.runnable_scale
    case.scale(scale)
    if _needs_child(case):
        compute = functools.partial(
            _subprocess.call,
            "runbook._case:_verify_json",
            devices=case.devices,
            name=name,
            scale=scale,
        )
    else:
        compute = functools.partial(_verify_json, name, scale)
    request = {"kind": "verify", "case": name, "scale": scale}
    checks: list[dict[str, Any]] = _cache.cached(request, compute, module=_CASES[name])
    return checks
