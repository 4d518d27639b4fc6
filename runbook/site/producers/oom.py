"""Make the out-of-memory messages of docs/_data/oom/ that the runbook itself produces.

    nox -s oom    (python -m runbook.site.producers.oom [--out-dir DIR])

writes ``tpu_v5e_gather_grad.txt`` and ``tpu_v5e_vocab_logits.txt`` (XLA's TPU compiler,
from libtpu: the ``targets`` extra) and ``cpu_ones.txt`` (XLA's CPU runtime), each behind a
comment line saying how it was made and with which jax, jaxlib and libtpu. The tests call
the same functions to make fresh messages at run time, where that is cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys

OUT = pathlib.Path(__file__).resolve().parents[3] / "docs" / "_data" / "oom"

# A TPU compile's memory report is logged, not raised: libtpu writes it to stderr when
# its log level lets warnings through, and `xla_tpu_no_crash_on_oom` makes the compiler go
# past its first memory check (which raises with the totals only) to the report.
REPORT_ENV = {"TPU_STDERR_LOG_LEVEL": "0", "JAX_PLATFORMS": "cpu"}
_REPORT_CHILD = """
import sys
import jax, jax.numpy as jnp
import runbook
from runbook.cases import vocab_logits

if sys.argv[1] == "vocab-logits":  # the case's reproduction at its seed's largest point
    case = runbook.get_case("vocab-logits")
    scale = case.scales["seed"]
    params = {"tokens": max(scale["tokens"])}
    variant = case.variant("grad-one-hot")
    fn, args = variant.program(params), case.inputs(variant, scale, params, False)
else:  # "copies": a 6 GiB argument and two outputs of its size
    def fn(x):
        return jax.nn.softmax(x.reshape(-1, 1024), axis=-1) * 2, x + 1
    args = (jax.ShapeDtypeStruct((3 * 2**29,), jnp.float32),)
try:
    runbook.measure(fn, *args, target="v5e", compiler_options={"xla_tpu_no_crash_on_oom": True})
except runbook.RunbookError:
    pass  # the compile fails ("Invalid TPU program") after the report
"""
_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")


def versions(*dists: str) -> str:
    """The releases that made a message (default: jax, jaxlib and, where installed, libtpu)."""
    found = []
    for dist in dists or ("jax", "jaxlib", "libtpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{dist} {importlib.metadata.version(dist)}")
    return ", ".join(found)


def tpu_first_check() -> BaseException:
    """The error XLA's TPU compiler raises for the gather-grad gradient at seed scale on a
    v5e: its first memory check, which states the totals only (the `runbook.DoesNotFitError`
    whose ``__cause__`` is the compiler's error)."""
    import jax

    import runbook
    from runbook.cases.gather_grad import loss

    case = runbook.get_case("gather-grad")
    scale = case.scales["seed"]
    params = {"index_dtype": "int32"}
    args = case.inputs(case.variant("grad"), scale, params, False)
    try:
        runbook.measure(jax.grad(loss), *args, target="v5e")
    except runbook.DoesNotFitError as e:
        return e
    raise AssertionError("the gather-grad gradient fits a v5e: no message to record")


def tpu_log(program: str) -> str:
    """What a TPU compile for a v5e writes to stderr, memory reports included (in a child
    process: libtpu reads its log level when it loads).

    `program`: "vocab-logits" (the case's reproduction at seed scale, 10 s or so) or
    "copies" (a 6 GiB argument and two outputs as large, a few seconds).
    """
    env = {**os.environ, **REPORT_ENV}
    run = subprocess.run(
        [sys.executable, "-c", _REPORT_CHILD, program],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    return run.stderr


def first_report(log: str) -> str:
    """The first memory report of `log` that lists allocations, with its log-line prefix."""
    lines = log.splitlines()
    start = next(
        i
        for i, line in enumerate(lines)
        if "program_memory_allocator" in line and "Ran out of memory" in line
    )
    end = next((i for i in range(start + 1, len(lines)) if _LOG_LINE.match(lines[i])), len(lines))
    return "\n".join(lines[start:end]).rstrip() + "\n"


def cpu_allocation() -> BaseException:
    """The error XLA's CPU runtime raises for an array larger than any machine's address
    space (2**46 float32 elements, 256 TiB): nothing is allocated."""
    import jax.numpy as jnp

    try:
        jnp.ones((2**46,), jnp.float32).block_until_ready()
    except RuntimeError as e:  # XlaRuntimeError or JaxRuntimeError, by release
        return e
    raise AssertionError("a 256 TiB array was allocated")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=OUT)
    out = parser.parse_args(argv).out_dir
    out.mkdir(parents=True, exist_ok=True)
    made = versions()
    gather = tpu_first_check()
    (out / "tpu_v5e_gather_grad.txt").write_text(
        "# made by nox -s oom: jax.grad of runbook.cases.gather_grad.loss at "
        f"seed scale, compiled for a TPU v5e without the device ({made}); the compiler's "
        "error (the DoesNotFitError's __cause__)\n" + str(gather.__cause__).rstrip() + "\n"
    )
    (out / "tpu_v5e_vocab_logits.txt").write_text(
        "# made by nox -s oom: the vocab-logits case's grad-one-hot at seed "
        f"scale (32768 tokens), compiled for a TPU v5e without the device ({made}) with "
        "xla_tpu_no_crash_on_oom and TPU_STDERR_LOG_LEVEL=0: the memory report libtpu logs\n"
        + first_report(tpu_log("vocab-logits"))
    )
    (out / "cpu_ones.txt").write_text(
        "# made by nox -s oom: jnp.ones((2**46,), jnp.float32) on the CPU "
        f"({versions('jax', 'jaxlib')}); the error JAX raised\n"
        + str(cpu_allocation()).rstrip()
        + "\n"
    )


if __name__ == "__main__":
    main()
