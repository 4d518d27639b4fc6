"""Run a function of this package in a fresh Python process.

Two reasons to do so: forcing several host devices, which must happen before JAX starts,
and measuring a real peak, which must not be polluted by anything this process did.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from ._errors import RunbookError, WontFitError

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def child_env(devices: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: `devices` host devices on CPU (GPUs are unaffected)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    if devices > 1:
        flags.append(f"{_DEVICE_FLAG}={devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    # Big allocations always come from mmap and go back to the OS when freed, so that the
    # resident-set peak measures the program rather than the allocator's caching.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    env.update(extra or {})
    return env


def call(target: str, /, *, devices: int = 1, timeout: float = 1800, **kwargs: Any) -> Any:
    """Call ``module:function`` with JSON-able `kwargs` in a fresh process; return its JSON."""
    request = json.dumps({"target": target, "kwargs": kwargs})
    proc = subprocess.run(
        [sys.executable, "-m", "runbook._subprocess", request],
        env=child_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RunbookError(f"child process for {target} failed (exit {proc.returncode}):\n{tail}")
    reply = json.loads(lines[-1])
    if "error" in reply:
        raise (WontFitError if reply.get("kind") == "WontFitError" else RunbookError)(
            reply["error"]
        )
    return reply["result"]


def _main(request: str) -> None:
    spec = json.loads(request)
    module, _, name = spec["target"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    try:
        result = fn(**spec["kwargs"])
    except RunbookError as e:
        print(json.dumps({"error": str(e), "kind": type(e).__name__}))
        return
    print(json.dumps({"result": result}))


if __name__ == "__main__":
    _main(sys.argv[1])
