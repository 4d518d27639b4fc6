"""Where a number came from: backend, device and library versions."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from typing import TYPE_CHECKING, Any

import jax
import jaxlib.version

from ._quiet import start_backend

if TYPE_CHECKING:
    from ._targets import Target


@dataclasses.dataclass(frozen=True)
class Provenance:
    """The environment a measurement was taken in."""

    backend: str
    device_kind: str
    devices: int
    jax: str
    jaxlib: str
    machine: str
    date: str
    target: str = ""  # a target's name (see `runbook.targets()`): compiled for it, not run

    @property
    def compile_only(self) -> bool:
        """True for figures compiled for a target device this machine does not have."""
        return bool(self.target)

    @classmethod
    def current(cls) -> Provenance:
        """Describe the running process's default JAX backend."""
        start_backend()
        device = jax.devices()[0]
        return cls(
            backend=jax.default_backend(),
            device_kind=device.device_kind,
            devices=jax.device_count(),
            jax=jax.__version__,
            jaxlib=jaxlib.version.__version__,
            machine=f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
            date=datetime.date.today().isoformat(),
        )

    @classmethod
    def for_target(cls, target: Target, devices: int) -> Provenance:
        """Figures compiled for `target` on `devices` of its devices, on this machine."""
        here = cls.current()
        return dataclasses.replace(
            here,
            backend=target.platform,
            device_kind=target.label,
            devices=devices,
            target=target.name,
        )

    def label(self) -> str:
        """One line for figure captions and table footers."""
        if self.target:
            return (
                f"{self.device_kind} target ({self.devices} device"
                f"{'s' if self.devices != 1 else ''}), compiled by XLA's "
                f"{'GPU' if self.backend == 'cuda' else self.backend.upper()} compiler without "
                f"the device (a prediction), jax {self.jax} / jaxlib {self.jaxlib}"
            )
        return (
            f"{self.backend.upper()} ({self.device_kind}, {self.devices} device"
            f"{'s' if self.devices != 1 else ''}), jax {self.jax} / jaxlib {self.jaxlib}"
        )


def host() -> dict[str, Any]:
    """The machine: CPU model, cores and memory, which the compile times depend on."""
    cpu = platform.processor() or platform.machine()
    memory = 0
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
        with open("/proc/meminfo") as f:
            memory = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal"))
    except (OSError, StopIteration):  # not Linux: the platform module's answer will do
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_bytes": memory}
