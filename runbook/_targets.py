"""Compile for an accelerator without having one: GPU and TPU targets.

XLA's GPU compiler (from ``jax-cuda12-plugin``) and TPU compiler (from ``libtpu``) run on
any Linux x86-64 machine. `jax.experimental.topologies` makes compile-only devices of a
target, and a program whose inputs are placed on them is compiled, buffer assignment and
all, by that target's compiler. Nothing runs, so every figure is a compile-time prediction.

A GPU target is described to XLA by a ``GpuTargetConfigProto``: the hardware facts below,
taken from each GPU's published specifications (memory, streaming multiprocessors, compute
capability, bandwidth, L2 cache, clock) and from the per-compute-capability limits in
NVIDIA's CUDA C++ Programming Guide. A TPU target is one of libtpu's own topologies.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import platform
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from . import _case_types
from ._errors import RunbookError, UnknownNameError
from ._quiet import compiler_chatter, plugin_chatter

# JAX preallocates this share of a GPU's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
GPU_ALLOCATOR_FRACTION = 0.75
GPU_ALLOCATOR_SOURCE = "https://docs.jax.dev/en/latest/gpu_memory_allocation.html"
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class _Arch:
    """Per-compute-capability limits (CUDA C++ Programming Guide, compute capabilities table)."""

    shared_per_core: int  # shared memory per SM, bytes
    shared_per_block_optin: int
    threads_per_core: int
    fp32_per_core: int  # FP32 units ("CUDA cores") per SM
    registers_per_core: int = 65536


# XLA's cost model divides by `fpus_per_core`: left out, it changes which fusions XLA makes
# (the gather-grad gradient on an H100 goes from 96 GiB to 288 GiB), so every field matters.
_ARCH = {
    (7, 0): _Arch(96 * 1024, 96 * 1024, 2048, 64),
    (7, 5): _Arch(64 * 1024, 64 * 1024, 1024, 64),
    (8, 0): _Arch(164 * 1024, 163 * 1024, 2048, 64),
    (8, 9): _Arch(100 * 1024, 99 * 1024, 1536, 128),
    (9, 0): _Arch(228 * 1024, 227 * 1024, 2048, 128),
}


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """A GPU's published figures: what XLA's GPU compiler is told about the device."""

    compute_capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    memory_bandwidth: float  # bytes/s
    l2_cache: int  # bytes
    clock_ghz: float  # boost clock

    def target_config(self, name: str, memory: int, *, thread_dims: bool = True) -> str:
        """The ``GpuTargetConfigProto`` in text format.

        `thread_dims=False` leaves out the per-dimension thread limits, fields that GPU
        compilers before jaxlib 0.10 do not know (and so refuse the whole text).
        """
        arch = _ARCH[self.compute_capability]
        major, minor = self.compute_capability
        fields = {
            "threads_per_block_limit": 1024,
            "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024,
            "shared_memory_per_core": arch.shared_per_core,
            "shared_memory_per_block_optin": arch.shared_per_block_optin,
            "threads_per_core_limit": arch.threads_per_core,
            "core_count": self.cores,
            "fpus_per_core": arch.fp32_per_core,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.memory_bandwidth),
            "l2_cache_size": self.l2_cache,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": memory,
            "registers_per_core_limit": arch.registers_per_core,
            "registers_per_block_limit": 65536,
        }
        if thread_dims:
            fields.update(thread_dim_limit_x=1024, thread_dim_limit_y=1024, thread_dim_limit_z=64)
        body = "\n".join(f"  {k}: {v}" for k, v in fields.items())
        return (
            f"gpu_device_info {{\n{body}\n"
            f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
            f'platform_name: "CUDA"\ndevice_description_str: "{name}"\n'
        )


# libtpu topology names by device count, per TPU generation: libtpu accepts these names,
# not the cloud's slice names ("v5p-8").
_TPU_2D = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TPU_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
}
_TPU_7X = {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to compile for without having it.

    A slice of several (``"v5e-16"``, ``"h100x8"``, see `get_target`) is a `Target` too: its
    one device's figures, with ``devices`` and ``base`` set.

    Attributes:
        name: what you pass as ``target=`` (``"h100"``, ``"v5e-16"``).
        label: the product, for captions.
        platform: ``"cuda"`` or ``"tpu"``.
        memory: the device's memory in bytes (nominal, per JAX device).
        source: where the hardware figures come from.
        devices: how many JAX devices it names: a slice's count, else 1.
        base: a slice's one-device target (``"v5e"``); "" for a one-device target.
    """

    name: str
    label: str
    platform: str
    memory: int
    source: str
    gpu: GpuSpec | None = None
    tpu: tuple[str, Mapping[int, str]] | None = None  # (generation, topologies by count)
    devices: int = 1
    base: str = ""

    @property
    def device_platforms(self) -> tuple[str, ...]:
        """What `jax.Device.platform` says for this target's devices."""
        return ("gpu", "cuda") if self.platform == "cuda" else ("tpu",)

    @property
    def kind(self) -> str:
        return "GPU" if self.platform == "cuda" else "TPU"

    @property
    def unit(self) -> str:
        """What one JAX device of this target is: a GPU, a TPU chip, or (TPU7x) a TensorCore."""
        if self.platform == "cuda":
            return "GPU"
        return "TensorCore" if self.tpu is not None and self.tpu[0] == "tpu7x" else "chip"

    def usable(self) -> int:
        """Bytes a program may use per device by default.

        GPU: the share JAX's allocator preallocates (`GPU_ALLOCATOR_FRACTION`, see
        `GPU_ALLOCATOR_SOURCE`). TPU: the HBM XLA's TPU compiler allows a program, as XLA
        reports it (to 0.01 GiB).
        """
        if self.platform == "cuda":
            return int(GPU_ALLOCATOR_FRACTION * self.memory)
        return _tpu_usable_hbm(self.base or self.name)

    def usable_rule(self) -> str:
        """How `usable()` is defined, in words."""
        if self.platform == "cuda":
            return f"JAX's default GPU allocator share, {GPU_ALLOCATOR_FRACTION:.0%} of memory"
        return "usable HBM as XLA's TPU compiler reports it"

    def with_memory(self, memory: int) -> Target:
        """This GPU described to XLA with `memory` bytes: a card of the same chip with less
        memory, or the share a program gets. XLA's GPU compiler may rematerialise values to
        fit the memory it is told, so a deviceless compile's temporaries can depend on this
        figure (the measuring page shows a program where they do)."""
        if self.gpu is None or self.base:
            raise RunbookError(f"{self.name!r}: only a one-GPU target's memory can be set")
        gib = memory / GiB
        return dataclasses.replace(
            self,
            name=f"{self.name}-{gib:g}gib",
            label=f"{self.label}, described with {gib:g} GiB",
            memory=int(memory),
        )

    def to_json(self) -> dict[str, Any]:
        found = {"name": self.name, "device_kind": self.label, "memory": self.memory}
        return {**found, "devices": self.devices} if self.base else found


_NVIDIA = "NVIDIA's product datasheet; per-architecture limits from the CUDA C++ Programming Guide"
_TARGETS = (
    Target("h100", "NVIDIA H100 SXM 80GB", "cuda", 80 * GiB, _NVIDIA,
           gpu=GpuSpec((9, 0), 132, 3.35e12, 50 * 2**20, 1.98)),
    Target("h200", "NVIDIA H200 SXM 141GB", "cuda", 141 * GiB, _NVIDIA,
           gpu=GpuSpec((9, 0), 132, 4.8e12, 50 * 2**20, 1.98)),
    Target("a100", "NVIDIA A100 SXM 80GB", "cuda", 80 * GiB, _NVIDIA,
           gpu=GpuSpec((8, 0), 108, 2.039e12, 40 * 2**20, 1.41)),
    Target("l4", "NVIDIA L4 24GB", "cuda", 24 * GiB, _NVIDIA,
           gpu=GpuSpec((8, 9), 58, 300e9, 48 * 2**20, 2.04)),
    Target("t4", "NVIDIA T4 16GB", "cuda", 16 * GiB, _NVIDIA,
           gpu=GpuSpec((7, 5), 40, 320e9, 4 * 2**20, 1.59)),
    Target("v5e", "TPU v5e", "tpu", 16 * GiB, "Google Cloud TPU documentation; topology from libtpu",
           tpu=("v5e", _TPU_2D)),
    Target("v5p", "TPU v5p", "tpu", 95 * GiB, "Google Cloud TPU documentation; topology from libtpu",
           tpu=("v5p", _TPU_3D)),
    Target("v6e", "TPU v6e (Trillium)", "tpu", 32 * GiB,
           "Google Cloud TPU documentation; topology from libtpu", tpu=("v6e", _TPU_2D)),
    Target("tpu7x", "TPU7x (Ironwood), per TensorCore", "tpu", 96 * GiB,
           "Google Cloud TPU documentation (192 GiB per chip, two TensorCores, each a JAX "
           "device); topology from libtpu", tpu=("tpu7x", _TPU_7X)),
)  # fmt: skip


def targets() -> list[Target]:
    """Every target this runbook can compile for (whether this machine can is `unavailable`)."""
    return list(_TARGETS)


def matching(device_kind: str) -> Target | None:
    """The GPU target a real device's kind names ("NVIDIA H100 80GB HBM3" -> h100), if any."""
    for t in _TARGETS:
        if t.gpu is not None and re.search(rf"\b{t.name}\b", device_kind, re.IGNORECASE):
            return t
    return None


def target_names() -> list[str]:
    return [t.name for t in _TARGETS]


def get_target(name: str | Target) -> Target:
    """The `Target` called `name`: a device of `targets()`, or a slice of several.

    A slice is named as the cloud sells it. TPU: ``"<tpu>-<N>"``; for v5e and v6e, N is the
    chips (``"v5e-16"``: 16 chips, 16 JAX devices); for v5p, N is the TensorCores, two per
    chip, and each chip is one JAX device (megacore), so ``"v5p-32"`` is 16 chips, 16 JAX
    devices. GPU: ``"<gpu>x<N>"``, N GPUs (``"h100x8"``). Its sizes are the topologies this
    runbook compiles for.

    Examples:
        >>> get_target("v5p-32").devices, get_target("h100x8").devices
        (16, 8)
        >>> get_target("v5e-16").base
        'v5e'
    """
    if isinstance(name, Target):
        return name
    for t in _TARGETS:
        if t.name == name:
            return t
    found = _slice(name)
    if found is not None:
        return found
    raise UnknownNameError(
        f"unknown target {name!r}; valid: {', '.join(target_names())}, or a slice such as "
        "v5e-16, v5p-32 or h100x8"
    )


_GPU_SLICE_MAX = 256  # 32 hosts of 8 GPUs


def _slice_sizes(base: Target) -> list[int]:
    """The N a slice name of `base` may have."""
    if base.tpu is not None:
        per_chip = 2 if base.name == "v5p" else 1  # Google Cloud names v5p by TensorCores
        return [n * per_chip for n in base.tpu[1]]
    return [*range(1, 8), *range(8, _GPU_SLICE_MAX + 1, 8)]  # a host of up to 8, or full hosts


def _slice(name: str) -> Target | None:
    """The slice `name` names ("v5e-16", "h100x8"), None when it names none; a known device
    with an impossible size raises, listing the valid ones."""
    m = re.fullmatch(r"(?P<base>\w+?)(?P<sep>-|x)(?P<n>\d+)", name)
    base = next((t for t in _TARGETS if m and t.name == m["base"]), None)
    if m is None or base is None or (m["sep"] == "-") != (base.tpu is not None):
        return None
    if base.name == "tpu7x":
        raise UnknownNameError(
            f"no slice names for tpu7x ({name!r}): their count is not settled here; build a "
            "mesh on `runbook.target_devices('tpu7x', n)`, n TensorCores"
        )
    n, sizes = int(m["n"]), _slice_sizes(base)
    if n not in sizes:
        if base.gpu is not None:
            valid = (
                f"{base.name}x1 to {base.name}x8, then multiples of 8 to {base.name}x{sizes[-1]}"
            )
        else:
            valid = ", ".join(f"{base.name}-{k}" for k in sizes)
            valid += " (TensorCores, two per chip)" if base.name == "v5p" else " (chips)"
        raise UnknownNameError(f"no slice {name!r}; valid: {valid}")
    devices = n // 2 if base.name == "v5p" else n
    return dataclasses.replace(base, name=name, devices=devices, base=base.name)


# --- can this machine compile for it? --------------------------------------------------------

INSTALL_HINT = 'install the compilers with `pip install "jax-memory-runbook[targets]"`'


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def unavailable(name: str | Target) -> str | None:
    """Why this machine cannot compile for `name`, in one line; None when it can."""
    target = get_target(name)
    machine = f"{platform.system()} {platform.machine()}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            f"{target.kind} targets need XLA's {target.kind} compiler, which is published for "
            f"Linux x86-64 only; this machine is {machine}"
        )
    import jaxlib.version

    if target.platform == "cuda":
        plugin = _version("jax-cuda12-plugin")
        if plugin is None:
            return f"no GPU compiler: jax-cuda12-plugin is not installed; {INSTALL_HINT}"
        if plugin != jaxlib.version.__version__:
            return (
                f"jax-cuda12-plugin {plugin} does not match jaxlib {jaxlib.version.__version__}; "
                f"{INSTALL_HINT}"
            )
        return None
    if importlib.util.find_spec("libtpu") is None:
        return f"no TPU compiler: libtpu is not installed; {INSTALL_HINT}"
    return None


def resolve(name: str | Target | None) -> Target | None:
    """Where a target name enters the API: its `Target`, checked once (`require`); None stays
    None (this process's backend). Everything below takes the `Target`."""
    return None if name is None else require(name)


def require(name: str | Target) -> Target:
    """The target, or a `RunbookError` saying in one line why it cannot be compiled for here."""
    target = get_target(name)
    reason = unavailable(target)
    if reason:
        raise RunbookError(f"cannot compile for target {target.name!r}: {reason}")
    return target


# --- compile-only devices ---------------------------------------------------------------------

# libtpu reads these when it loads. Needed: a process that loads libtpu takes a lock file that
# makes every other process's load fail, which pages executing side by side and a test's child
# processes would hit. Not needed (checked by the tests), only quieter: the other two stop
# libtpu from asking a cloud metadata server about a TPU that is not there.
_TPU_SHARED = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
_TPU_QUIET = {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost"}


def own_env() -> dict[str, str]:
    """What this module sets in os.environ (read when called: the tests clear the tables).
    The cache leaves these out of its keys, or every lookup after a process's first TPU
    compile would miss."""
    return {**_TPU_SHARED, **_TPU_QUIET}


def _ensure_cuda_plugin() -> None:
    """Register the CUDA plugin's compiler where JAX's own start-up did not.

    Without a GPU, the plugin's start-up check fails unless ``JAX_PLATFORMS`` excludes CUDA;
    the plugin then never registers and JAX knows no "cuda" topology. Its compiler needs no
    GPU, so register it directly (JAX's private plugin API, checked by the tests).
    """
    from jax._src import xla_bridge as xb

    with plugin_chatter():
        xb._discover_and_register_pjrt_plugins()
    if "cuda" in xb._topology_factories:
        return
    # jax._src.lib imports xla_client without re-exporting it (JAX's private API)
    from jax._src.lib import xla_client  # type: ignore[attr-defined]
    from jax_plugins import xla_cuda12

    path = xla_cuda12._get_library_path()
    if path is None:
        raise RunbookError(f"jax-cuda12-plugin's library is missing; {INSTALL_HINT}")
    xb.register_plugin(
        "cuda",
        priority=500,
        library_path=str(path),
        options=xla_client.generate_pjrt_gpu_plugin_options(),
    )


def _gpu_topology(target: Target, shape: str) -> Any:
    from jax.experimental import topologies

    assert target.gpu is not None
    try:
        config = target.gpu.target_config(target.label, target.memory)
        return topologies.get_topology_desc(platform="cuda", target_config=config, topology=shape)
    except Exception as e:  # jaxlib's XlaRuntimeError, whose module moved between releases
        if "Failed to parse GpuTargetConfigProto" not in str(e):
            raise
    # An older compiler: the same facts without the fields it does not know.
    config = target.gpu.target_config(target.label, target.memory, thread_dims=False)
    return topologies.get_topology_desc(platform="cuda", target_config=config, topology=shape)


_DEVICES: dict[tuple[str, int], tuple[Any, ...]] = {}  # one topology per target and count
_TOPOLOGY_LOCK = threading.Lock()


def _devices(target: Target, count: int) -> tuple[Any, ...]:
    if target.base:  # a slice: the first `count` of its base's topology of the slice's size
        if count > target.devices:
            raise RunbookError(
                f"target {target.name!r} has {target.devices} devices; the program asks for {count}"
            )
        return _devices(get_target(target.base), target.devices)[:count]
    # One thread at a time: the first topology of a platform registers its compiler plugin,
    # and two threads doing so at once fail ("PJRT_Api already exists for device type tpu").
    with _TOPOLOGY_LOCK:
        if (target.name, count) not in _DEVICES:
            _DEVICES[target.name, count] = _topology_devices(require(target), count)
    return _DEVICES[target.name, count]


def _topology_devices(target: Target, count: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    name = target.name
    if target.gpu is not None:
        _ensure_cuda_plugin()
        hosts, per_host = (1, count) if count <= 8 else (count // 8, 8)
        topo = _gpu_topology(target, f"1x{hosts}x{per_host}")
    else:
        assert target.tpu is not None
        for key, value in own_env().items():
            os.environ.setdefault(key, value)
        generation, shapes = target.tpu
        fitting = [n for n in shapes if n >= count]
        if not fitting:
            raise RunbookError(f"target {name!r} has no topology of {count} devices here")
        with plugin_chatter():  # libtpu, loaded here, logs that this machine has no TPU
            topo = topologies.get_topology_desc(
                f"{generation}:{shapes[min(fitting)]}", platform="tpu"
            )
    devices = tuple(topo.devices[:count])
    if len(devices) < count:
        raise RunbookError(f"target {name!r}: asked for {count} devices, got {len(devices)}")
    return devices


def target_devices(name: str | Target, count: int = 1) -> list[Any]:
    """`count` compile-only devices of target `name`: place inputs on them to compile for it.

    For a slice, the first `count` of its devices (`slice_mesh` puts all of them in a mesh).
    """
    return list(_devices(get_target(name), count))


def slice_mesh(
    name: str | Target, axis_names: str | Sequence[str], shape: Sequence[int] | None = None
) -> Any:
    """A `jax.sharding.Mesh` over every compile-only device of the slice `name` (``"v5e-16"``,
    ``"h100x8"``, see `get_target`): shard a program's inputs on it, then measure it with
    ``target=name`` for its bytes per device.

    Args:
        name: the slice (a one-device target gives a mesh of one device).
        axis_names: the mesh's axis names, or one name.
        shape: the devices along each axis; with one axis name, all of them by default.

    The devices are laid out in their topology's order (not `mesh_utils`' physical layout,
    which changes the collectives, not the bytes per device).
    """
    import numpy as np
    from jax.sharding import Mesh

    target = require(name)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if shape is None:
        if len(names) != 1:
            raise RunbookError(f"slice_mesh: give the shape of the {len(names)} axes {names}")
        shape = (target.devices,)
    if len(shape) != len(names) or int(np.prod(shape)) != target.devices:
        raise RunbookError(
            f"slice_mesh: shape {tuple(shape)} for axes {names} does not hold the "
            f"{target.devices} devices of {target.name!r}"
        )
    return Mesh(np.array(target_devices(target, target.devices)).reshape(shape), names)


def mesh_hint(target: Target) -> str:
    """Where to build a mesh for `target`, for error messages."""
    if target.base:
        return f"`runbook.slice_mesh({target.name!r}, axis_names)`"
    return f"`runbook.target_devices({target.name!r}, n)`"


_ACTIVE: contextvars.ContextVar[Target | None] = contextvars.ContextVar("target", default=None)


@contextlib.contextmanager
def compiling_for(name: str | Target | None) -> Iterator[Target | None]:
    """Inside, `devices()` gives the target's compile-only devices (None: this process's).

    For a GPU target, stderr is filtered as `compiler_chatter` does: XLA's GPU compiler warns
    on every program larger than the device, which the site compiles on purpose. (A TPU
    compile's stderr is left alone: libtpu reports fatal errors there before it aborts.)
    """
    target = None if name is None else require(name)
    token = _ACTIVE.set(target)
    gpu = target is not None and target.platform == "cuda"
    quiet = compiler_chatter() if gpu else contextlib.nullcontext()
    provider = None if target is None else functools.partial(target_devices, target)
    try:
        with quiet, _case_types.devices_from(provider):
            yield target
    finally:
        _ACTIVE.reset(token)


def active() -> Target | None:
    """The target `compiling_for` set, or None."""
    return _ACTIVE.get()


def compiler_options(name: str | Target) -> dict[str, Any]:
    """XLA options every compile for this target gets.

    GPU: the PTX assembler from the ``nvidia-cuda-nvcc-cu12`` wheel, so that the figures do
    not depend on which CUDA toolkit (if any) this machine has. TPU: none. XLA's TPU
    compiler stops at its first memory check when a program cannot fit, in a fraction of a
    second, and names what it would need; ``{"xla_tpu_no_crash_on_oom": True}`` makes it go
    on and report the full breakdown past the limit (as long as no single buffer exceeds
    the chip), at several times the compile time.
    """
    target = get_target(name)
    if target.platform == "cuda":
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
        if spec is not None and spec.submodule_search_locations:
            return {"xla_gpu_cuda_data_dir": str(next(iter(spec.submodule_search_locations)))}
    return {}


# --- placing abstract inputs on a target -------------------------------------------------------


def place(args: Sequence[Any], name: str | Target, *, unsharded: bool = True) -> tuple[Any, ...]:
    """`args` as `jax.ShapeDtypeStruct`s on the target's devices, shardings kept.

    An input without a sharding goes to the target's first device (left as it is when not
    `unsharded`: a `jax.pmap` places its inputs itself); one sharded over a mesh of this
    process's devices is sharded the same way over a mesh of target devices (for a slice,
    only a mesh of as many devices as the slice has). A sharding's memory kind is kept.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    target = get_target(name)
    mine = {id(d) for d in target_devices(target, target.devices)}

    def one(leaf: Any) -> Any:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        # Where the input lives (`memory_kind="pinned_host"`: host offloading) is kept.
        kind = getattr(sharding, "memory_kind", None)
        where = {"memory_kind": kind} if kind is not None else {}
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            if not any(id(d) in mine for d in mesh.devices.flat):
                size = mesh.devices.size
                if target.base and size != target.devices:
                    raise RunbookError(
                        f"a {size}-device mesh for {target.name!r}, a slice of "
                        f"{target.devices} devices: build it with "
                        f"`runbook.slice_mesh({target.name!r}, {mesh.axis_names!r})`"
                    )
                devs = target_devices(target, size)
                mesh = Mesh(np.array(devs).reshape(mesh.devices.shape), mesh.axis_names)
            sharding = NamedSharding(mesh, sharding.spec, **where)
        elif not unsharded:
            return leaf
        else:
            mesh = Mesh(target_devices(target, 1), ("_",))
            sharding = NamedSharding(mesh, PartitionSpec(), **where)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    return tuple(jax.tree_util.tree_map(one, list(args)))


# --- what a target's compiler says when a program does not fit ---------------------------------

_SIZE = re.compile(r"([\d.]+)([KMGT]?)(?:i?B)?")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """XLA's human-readable bytes ("15.75G", "2.00T", "512B") as an integer.

    Examples:
        >>> parse_size("15.75G")
        16911433728
        >>> parse_size("512B")
        512
    """
    m = _SIZE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"not a size: {text!r}")
    return int(float(m[1]) * _UNITS[m[2]])


_NEEDS = re.compile(r"required for HLO temporaries \(([^)]+)\) exceeds available HBM \(([^)]+)\)")
_ALLOCATION = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")


def oom_figures(message: str) -> tuple[int, int, str] | None:
    """(bytes needed, bytes allowed, what) from a compiler's out-of-memory error, or None."""
    if (m := _NEEDS.search(message)) is not None:
        return parse_size(m[1]), parse_size(m[2]), "HLO temporaries"
    if (m := _ALLOCATION.search(message)) is not None:
        return int(m[1]), int(m[2]), "one buffer"
    return None


@functools.cache
def _tpu_usable_hbm(name: str) -> int:
    """Compile a program no chip can hold and read the limit XLA's refusal names."""
    import jax
    import jax.numpy as jnp

    (arg,) = place([jax.ShapeDtypeStruct((2**38,), jnp.float32)], name)
    try:
        jax.jit(lambda a: a * 2).lower(arg).compile()
    except Exception as e:
        found = oom_figures(str(e))
        if found is not None:
            return found[1]
        raise RunbookError(f"target {name!r}: could not read its usable memory: {e}") from e
    raise RunbookError(f"target {name!r}: a 1 TiB program compiled; cannot read its memory limit")
