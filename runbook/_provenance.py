"""Where a number came from: backend, device and library versions."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
from collections import Counter
from collections.abc import Mapping, Sequence
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

    def label(self, others: Mapping[int, Sequence[str]] | None = None) -> str:
        """One line for figure captions and table footers, naming the devices the figures
        are for: ``others`` maps a device count to the programs (by name) that ran on that
        many devices instead of `devices`."""
        devices = _count(self.devices)
        if others:
            devices += (
                " ("
                + "; ".join(f"{', '.join(names)} on {_count(n)}" for n, names in others.items())
                + ")"
            )
        per_device = ", per device" if self.devices > 1 or others else ""
        if self.target:
            return (
                f"{devices} of {_article(self.device_kind)} {self.device_kind} target"
                f"{per_device}, compiled by XLA's "
                f"{'GPU' if self.backend == 'cuda' else self.backend.upper()} compiler without "
                f"the device (a prediction), jax {self.jax} / jaxlib {self.jaxlib}"
            )
        return (
            f"{self.backend.upper()} ({self.device_kind}), {devices}{per_device}, "
            f"jax {self.jax} / jaxlib {self.jaxlib}"
        )


def _article(name: str) -> str:
    """ "a" or "an" before `name`, read aloud ("an NVIDIA H100", "a TPU v5e")."""
    spelled = name[:2].isupper() and name[0] in "AEFHILMNORSX"  # an acronym's first letter
    return "an" if spelled or name[:1].lower() in "aeiou" else "a"


def _count(devices: int) -> str:
    return f"{devices} device{'s' if devices != 1 else ''}"


def label_of(named: Sequence[tuple[str, Provenance]]) -> str:
    """`Provenance.label` for figures of several programs (name, provenance) in one caption:
    the device count most of them ran on, and the programs that ran on other counts."""
    counts = Counter(p.devices for _, p in named)
    most = max(counts, key=lambda n: (counts[n], n))
    others: dict[int, list[str]] = {}
    for name, p in named:
        if p.devices != most and name not in others.get(p.devices, []):
            others.setdefault(p.devices, []).append(name)
    first = next(p for _, p in named if p.devices == most)
    return first.label(others)


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
