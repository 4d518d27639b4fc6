"""Where a number came from: backend, device and library versions."""

from __future__ import annotations

import dataclasses
import datetime
import platform

import jax
import jaxlib


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

    @classmethod
    def current(cls) -> Provenance:
        """Describe the running process's default JAX backend."""
        device = jax.devices()[0]
        return cls(
            backend=jax.default_backend(),
            device_kind=device.device_kind,
            devices=jax.device_count(),
            jax=jax.__version__,
            jaxlib=jaxlib.__version__,
            machine=f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
            date=datetime.date.today().isoformat(),
        )

    def label(self) -> str:
        """One line for figure captions and table footers."""
        return (
            f"{self.backend.upper()} ({self.device_kind}, {self.devices} device"
            f"{'s' if self.devices != 1 else ''}), jax {self.jax} / jaxlib {self.jaxlib}"
        )
