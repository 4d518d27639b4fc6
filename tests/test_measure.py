"""The measurement core against programs whose bytes can be computed by hand."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import runbook

N = 1024
VEC = jax.ShapeDtypeStruct((N,), jnp.float32)


def test_elementwise_bytes_by_hand():
    report = runbook.measure(lambda a: a * 2.0, VEC)
    assert report.argument == N * 4
    assert report.output == N * 4
    assert report.alias == 0
    assert report.total == report.argument + report.output + report.temp
    assert report.lower_bound == 2 * N * 4


def test_donation_is_counted_once():
    donated = jax.jit(lambda a: a * 2.0, donate_argnums=0)
    report = runbook.measure(donated, VEC)
    assert report.alias == N * 4
    assert report.lower_bound == N * 4
    assert report.total == N * 4 + report.temp


def test_two_inputs_and_a_tuple_output():
    pair = (jax.ShapeDtypeStruct((N, 2), jnp.float32), jax.ShapeDtypeStruct((N,), jnp.int16))
    report = runbook.measure(lambda a, b: (a.sum(1), b + 1), *pair)
    assert report.argument == N * 2 * 4 + N * 2
    # A tuple output also owns its table of element pointers: 8 bytes per element.
    assert report.output == N * 4 + N * 2 + 2 * 8


def test_concrete_and_abstract_arguments_agree():
    concrete = runbook.measure(lambda a: jnp.cumsum(a), jnp.ones(N))
    abstract = runbook.measure(lambda a: jnp.cumsum(a), VEC)
    assert (concrete.argument, concrete.output, concrete.temp) == (
        abstract.argument,
        abstract.output,
        abstract.temp,
    )


def test_overhead_is_total_over_lower_bound():
    report = runbook.measure(lambda a: jnp.outer(a, a).sum(0), VEC)
    assert report.overhead == pytest.approx(report.total / report.lower_bound)
    assert report.overhead >= 1.0


def test_provenance_names_backend_and_versions():
    p = runbook.measure(lambda a: a, VEC).provenance
    assert p.backend == jax.default_backend()
    assert p.jax == jax.__version__
    assert p.devices == jax.device_count()
    assert p.jax in p.label()
    assert p.backend.upper() in p.label()


def test_json_has_integer_bytes():
    data = runbook.measure(lambda a: a + 1, VEC).to_json()
    assert all(isinstance(v, int) for v in data["bytes"].values())
    b = data["bytes"]
    assert b["total"] == b["argument"] + b["output"] + b["temp"] - b["alias"]


def test_not_callable_is_a_clear_error():
    with pytest.raises(runbook.RunbookError, match="`fn` must be a callable"):
        runbook.measure(42, VEC)


def test_untraceable_function_is_a_clear_error():
    def branchy(a):
        return a if a.sum() > 0 else -a

    with pytest.raises(runbook.RunbookError, match="could not trace `branchy`"):
        runbook.measure(branchy, VEC)


def test_unknown_compiler_option_is_a_clear_error():
    with pytest.raises(runbook.RunbookError, match="XLA could not compile"):
        runbook.measure(lambda a: a, VEC, compiler_options={"xla_no_such_option": True})


def test_largest_buffers_need_buffers():
    report = runbook.measure(lambda a: a, VEC)
    with pytest.raises(runbook.RunbookError, match="buffers=True"):
        runbook.largest_buffers(report)


def test_largest_buffer_is_the_materialised_intermediate():
    # The sort's result feeds two consumers, so XLA keeps it as a buffer of its own.
    def f(a):
        c = jnp.sort(a)
        return c[::2] + c[1::2]

    report = runbook.measure(f, VEC, buffers=True)
    biggest = runbook.largest_buffers(report, 3)
    assert biggest == sorted(biggest, key=lambda b: b.size, reverse=True)
    assert {b.kind for b in report.buffers} >= {"argument", "output"}
    assert any(b.size == N * 4 and b.kind == "argument" for b in report.buffers)
    sort = [b for b in report.buffers if "sort" in b.op]
    assert sort
    assert sort[0].source.startswith("tests/test_measure.py:")


def test_xla_report_agrees_with_memory_analysis():
    f = lambda a: jnp.outer(a, a).sum(0)
    report = runbook.measure(f, VEC)
    total = runbook.xla_usage_report_total(f, VEC)
    assert total is not None
    assert total == pytest.approx(report.total, rel=0.01)


def test_shape_error_is_reported_without_a_misleading_hint():
    with pytest.raises(
        runbook.RunbookError, match=r"could not trace .*contracting dimensions"
    ) as info:
        runbook.measure(lambda a: a @ jnp.ones((3, 3)), jax.ShapeDtypeStruct((4, 4), jnp.float32))
    assert "control flow" not in str(info.value)


def test_cache_key_ignores_what_the_package_sets_but_not_what_the_user_sets(monkeypatch):
    from runbook import _cache, _targets

    for name in _targets.own_env():
        monkeypatch.delenv(name, raising=False)
    before = _cache.key({"case": "x"})
    for name, value in _targets.own_env().items():  # what compiling for a TPU target sets
        monkeypatch.setenv(name, value)
    assert _cache.key({"case": "x"}) == before
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=false")
    assert _cache.key({"case": "x"}) != before


def test_cache_key_reads_xla_flags_as_xla_does(monkeypatch):
    # A child rebuilds XLA_FLAGS without its device flag ("" where the page had none) and a
    # page appends its flag after a space: each spelling of the same flags is one key.
    from runbook import _cache

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    unset = _cache.key({"case": "x"})
    monkeypatch.setenv("XLA_FLAGS", "")
    assert _cache.key({"case": "x"}) == unset
    flag = "--xla_force_host_platform_device_count=4"
    monkeypatch.setenv("XLA_FLAGS", flag)
    alone = _cache.key({"case": "x"})
    assert alone != unset
    monkeypatch.setenv("XLA_FLAGS", f" {flag} ")
    assert _cache.key({"case": "x"}) == alone


def test_unusable_donation_is_a_caveat_not_a_warning():
    # A function of its own: JAX warns on a program's first lowering in a process only.
    def double_and_drop(a, b):
        return a * 2.0 + b  # two donated inputs, one output

    report = runbook.measure(jax.jit(double_and_drop, donate_argnums=(0, 1)), VEC, VEC)
    assert report.alias == N * 4
    (caveat,) = [c for c in report.caveats if "not usable" in c]
    assert "float32[1024]" in caveat
    assert runbook.measure(lambda a: a * 2.0, VEC).caveats == ()


def test_compile_fn_collects_unusable_donations_and_passes_other_warnings():
    import warnings

    from runbook._measure import compile_fn

    def drop_and_warn(a, b):
        warnings.warn("something else", UserWarning, stacklevel=1)
        return a + b

    unusable: list[str] = []
    with pytest.warns(UserWarning, match="something else"):
        compile_fn(jax.jit(drop_and_warn, donate_argnums=(0, 1)), VEC, VEC, unusable=unusable)
    assert len(unusable) == 1
    assert unusable[0].startswith("Some donated buffers were not usable")


def test_plot_draws_each_bar_at_its_total():
    import matplotlib

    matplotlib.use("Agg")
    donated = runbook.measure(jax.jit(lambda a: a * 2.0, donate_argnums=0), VEC, name="d")
    plain = runbook.measure(lambda a: a * 2.0, VEC, name="p")
    ax = runbook.plot_reports([plain, donated])
    ends: dict[float, float] = {}
    for bar in ax.patches:
        y = bar.get_y()
        ends[y] = max(ends.get(y, 0.0), bar.get_x() + bar.get_width())
    unit_scale = 1024 if max(plain.total, donated.total) < 2**20 else 2**20
    assert sorted(ends.values()) == pytest.approx(
        sorted([donated.total / unit_scale, plain.total / unit_scale])
    )


def _double(a):
    return a * 2.0


def _double_again(a):  # the same body on other source lines: another program
    return a * 2.0


def test_measure_reuses_a_program_already_compiled(monkeypatch, tmp_path):
    from runbook import _cache, _measure

    monkeypatch.setenv("RUNBOOK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(_cache.STORE_VAR, "")  # the store holds these compiles: count real ones
    compiles = []
    real = _measure._measure_lowered
    monkeypatch.setattr(_measure, "_measure_lowered", lambda *a: compiles.append(a[1]) or real(*a))
    first = runbook.measure(_double, VEC)
    again = runbook.measure(jax.jit(_double), VEC)  # a new jit of the same program
    assert compiles == ["_double"]
    assert again.total == first.total
    assert again.name == first.name
    runbook.measure(_double, jax.ShapeDtypeStruct((2 * N,), jnp.float32))
    with_buffers = runbook.measure(_double, VEC, buffers=True)
    runbook.measure(_double, VEC, target="h100")
    assert len(compiles) == 4  # another shape, buffers asked for, another compiler
    assert with_buffers.buffers
    assert not first.buffers
    lowered = [_measure.lower_fn(f, VEC) for f in (_double, _double_again)]
    assert _measure.program_hash(lowered[0]) != _measure.program_hash(lowered[1])


def test_figures_render_by_their_names():
    report = runbook.measure(lambda a: a * 2.0, VEC)
    with_figures = dataclasses.replace(
        report, figures={"rss_growth": 3 * 2**20, "compile_seconds": 0.25, "compile_count": 1200}
    )
    row = runbook.figures_table([with_figures]).rows[0]
    assert row[2:] == ["3.00 MiB", "0.250 s", "1,200"]


def test_the_cache_records_who_made_and_used_each_entry_for_the_build_profile(
    monkeypatch, tmp_path
):
    import time

    from runbook import _cache
    from runbook.site.producers.bench import profile, projection

    def slow(seconds, value):
        time.sleep(seconds)
        return value

    monkeypatch.setenv(_cache.ENV_VAR, str(tmp_path))
    monkeypatch.setenv(_cache.STORE_VAR, "")  # made-up requests: no store answers them
    monkeypatch.setenv(_cache.PAGE_VAR, "cases/a")
    inner = lambda: _cache.cached({"kind": "inner"}, lambda: slow(0.3, 1))
    outer = {"kind": "outer", "target": "h100"}
    assert _cache.cached(outer, lambda: inner() + slow(0.05, 1)) == 2
    monkeypatch.setenv(_cache.PAGE_VAR, "cases/b")
    assert _cache.cached(outer, lambda: pytest.fail("computed twice")) == 2  # a hit
    found = profile(tmp_path)
    assert found["entries"] == 2
    assert set(found["by_page"]) == {"cases/a"}
    # The outer entry's own seconds leave out the entry computed inside it.
    assert found["by_target"]["h100"]["seconds"] < 0.2 < found["by_target"]["cpu"]["seconds"]
    assert found["seconds"] < 0.5
    assert found["used_by_several_pages"]["entries"] == 1
    assert found["used_by_several_pages"]["pages"] == {"cases/b": 1}
    pages = {"cases/a": 10.0, "cases/b": 30.0, "index": 4.0}
    got = projection({"cold": 30.0}, pages, cases=2, to=4)
    overhead = max(30.0 - 44.0 / got["cores"], 0.0)
    assert got["seconds"] == pytest.approx(overhead + (40 + 2 * 20 + 4 * 2) / got["cores"], abs=0.1)
    # What the pre-pass made for a page counts as the page's: here cases/a costs 30 s too.
    before = {"cases/a": 20.0}
    got = projection({"cold": 50.0}, pages, cases=2, to=4, prepared=before)
    overhead = max(50.0 - 64.0 / got["cores"], 0.0)
    assert got["median_case_page_seconds"] == 30.0
    assert got["seconds"] == pytest.approx(overhead + (60 + 2 * 30 + 4 * 2) / got["cores"], abs=0.1)


def test_a_case_result_read_back_keeps_each_report_s_caveats():
    # A multi-device case's result comes back from its child as JSON: its tables' caveats
    # must come with it.
    import json

    from runbook._case import CaseResult

    result = runbook.measure_case("inplace-copy", "tiny")
    marked = dataclasses.replace(
        result,
        reports=tuple(
            dataclasses.replace(r, caveats=(f"caveat of {r.name}",)) for r in result.reports
        ),
    )
    back = CaseResult.from_json(json.loads(json.dumps(marked.to_json())))
    assert [r.caveats for r in back.reports] == [r.caveats for r in marked.reports]
    assert [r.total for r in back.reports] == [r.total for r in marked.reports]


def test_a_variant_called_several_times_per_result_is_run_its_own_way():
    # `Variant.run`: the same-result check takes the result from the calls a user makes (a
    # step once per micro-batch), not from one call on the variant's inputs.
    from runbook._case import run_variant
    from runbook._case_types import Case, Variant

    def inputs(scale, params, concrete):
        return (jnp.ones(4) if concrete else jax.ShapeDtypeStruct((4,), jnp.float32),)

    def twice(step, scale, params):
        return step(step(jnp.ones(4)))

    double = lambda p: jax.jit(lambda x: 2 * x)
    once, run = Variant("once", "fix", "", double), Variant("run", "fix", "", double, run=twice)
    case = Case("t", "t", "t", 1, {"s": {}}, (once, run), inputs, lambda s: [{}])
    assert run_variant(case, once, "s", {}).tolist() == [2.0] * 4
    assert run_variant(case, run, "s", {}).tolist() == [4.0] * 4
