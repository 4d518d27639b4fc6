"""`host-offloading`: what the gradient of a layer stack saves, kept in host memory instead.

Reverse mode through a `lax.scan` of layers keeps what every layer's backward pass needs on
the device until the backward pass reads it. A checkpoint policy can recompute part of it,
or (``offload_dst="pinned_host"``) move it to the host's memory between the two passes; the
weights themselves can live on the host too, each layer's brought over as the scan reaches
it. Reports: jax-ml/jax#23869 (openxla/xla#17541: a policy that names a value the backward
pass never reads offloads nothing), jax-ml/jax#17323 (the request for offloading
activations and parameters), AI-Hypercomputer/maxtext#987 (a remat policy choosing, tensor
by tensor, to recompute, keep on the device or offload); AI-Hypercomputer/maxtext#884 is
cited by the issue. Whether bytes really move depends on the compiler: XLA's GPU and TPU
compilers put offloaded values in a host memory space; XLA:CPU has one memory and keeps
them where it keeps everything (the page measures each). The functions below are the
reproduction and its fixes; copy the one you need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from .._case_types import Case, Variant, devices
from ._setup import host_offloading as _setup

Weights = dict[str, jax.Array]  # {"up": (layers, hidden, mlp), "down": (layers, mlp, hidden)}
Policy = Callable[..., Any]

# What the policies below move: the values of `block` named with `checkpoint_name`.
BLOCK_INPUT = "block_input"  # the scan's carry as a layer receives it: read by its backward
BLOCK_OUTPUT = "block_output"  # the carry a layer hands on: its own backward never reads it


def block(h: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """One residual MLP layer, ``h + gelu(h @ up) @ down``, with its values named.

    Its backward pass reads `h` (for ``up``'s gradient) and ``h @ up`` (for `gelu`'s
    derivative, and to recompute ``gelu(h @ up)`` for ``down``'s gradient).
    """
    h = checkpoint_name(h, BLOCK_INPUT)
    out: jax.Array = checkpoint_name(h + jax.nn.gelu(h @ up) @ down, BLOCK_OUTPUT)
    return out


def forward(weights: Weights, x: jax.Array, policy: Policy | None = None) -> jax.Array:
    """The layers as one `lax.scan` over the stacked weights; with `policy`, each layer is
    a `jax.checkpoint` with that policy (None: no checkpoint, every value saved)."""

    def layer(h: jax.Array, w: Weights) -> tuple[jax.Array, None]:
        return block(h, w["up"], w["down"]), None

    if policy is not None:
        layer = jax.checkpoint(layer, policy=policy)
    h, _ = lax.scan(layer, x, weights)
    return h


def loss(weights: Weights, x: jax.Array, policy: Policy | None = None) -> jax.Array:
    """The reproduction with no `policy`: the squared norm of the stack's output per token,
    averaged over the tokens, in float32.

    `jax.value_and_grad(loss)` keeps, for every layer, its input, ``h @ up`` and the
    intermediates of `gelu` its derivative reads: six ``(batch, tokens, width)`` arrays
    per layer (the measuring page lists them), on the device until the backward pass.
    """
    return _per_token_square(forward(weights, x, policy))


def _per_token_square(h: jax.Array) -> jax.Array:
    return jnp.mean(jnp.sum(jnp.square(h.astype(jnp.float32)), axis=-1))


def save_dots() -> Policy:
    """Fix on the device: keep each layer's matrix products (``h @ up``), recompute the rest."""
    policy: Policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return policy


def offload_dots() -> Policy:
    """Fix: keep the same matrix products as `save_dots`, in the host's pinned memory.

    The backward pass computes what it computed with `save_dots`; only where the saved
    products wait between the passes changes (copied out and back in by the program). The
    scan still keeps each layer's input on the device, as `recompute_all` does.
    """
    policy: Policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
    return policy


def offload_names(*names: str) -> Policy:
    """Fix: move the values named `names` to the host's pinned memory, recompute the rest.

    With `BLOCK_INPUT`, the device keeps nothing per layer: the backward pass copies a
    layer's input back and recomputes the layer from it.
    """
    policy: Policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(names),
        offload_src="device",
        offload_dst="pinned_host",
    )
    return policy


def recompute_all() -> Policy:
    """Plain `jax.checkpoint` per layer: the scan still saves each layer's input, on the
    device; everything else is recomputed."""
    policy: Policy = jax.checkpoint_policies.nothing_saveable
    return policy


def host_weights_step(device: Any) -> Callable[..., Any]:
    """Fix for the weights: they and their gradients stay in `device`'s host memory.

    Each layer's weights are copied to the device inside the scan, as the scan reaches
    them, so the device holds one layer's at a time; the gradients go back to host memory.
    The saved activations are offloaded as in ``offload_names(BLOCK_INPUT)``. Call the step
    with weights placed in host memory (``jax.device_put(w, host_sharding(device))``).
    """
    host, on_device = host_sharding(device), host_sharding(device, "device")
    policy = offload_names(BLOCK_INPUT)

    def streamed(weights: Weights, x: jax.Array) -> jax.Array:
        def layer(h: jax.Array, w: Weights) -> tuple[jax.Array, None]:
            w = jax.device_put(w, jax.memory.Space.Device)  # this layer's, to the device
            return block(h, w["up"], w["down"]), None

        h, _ = lax.scan(jax.checkpoint(layer, policy=policy), x, weights)
        return _per_token_square(h)

    step: Callable[..., Any] = jax.jit(
        jax.value_and_grad(streamed),
        in_shardings=(host, on_device),
        out_shardings=(on_device, host),
    )
    return step


def host_sharding(device: Any, memory_kind: str = "pinned_host") -> jax.sharding.Sharding:
    """An array whole on `device`, in its memory `memory_kind` (default: pinned host memory,
    where `host_weights_step` takes its weights)."""
    mesh = jax.sharding.Mesh(np.array([device]), ("d",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=memory_kind)


def _grad(policy: Callable[[], Policy] | None) -> Callable[[Any], Callable[..., Any]]:
    if policy is None:
        return lambda p: jax.value_and_grad(loss)
    return lambda p: jax.value_and_grad(lambda w, x: loss(w, x, policy()))


CASE = Case(
    name="host-offloading",
    title="Offloading that moves nothing to host memory",
    symptom="a remat policy that offloads to pinned_host compiles and runs, yet the device "
    "holds as much as with no offloading, and the host holds nothing",
    devices=1,
    scales=_setup.SCALES,
    variants=(
        Variant("forward", "baseline", "the loss alone, no gradient", lambda p: loss),
        Variant("save-all", "baseline", "value_and_grad, no checkpoint", _grad(None)),
        Variant(
            "offload-output",
            "reproduction",
            "offload the layer's output (offload_names(BLOCK_OUTPUT)): not a saved value",
            _grad(lambda: offload_names(BLOCK_OUTPUT)),
            since="jax.checkpoint_policies.save_and_offload_only_these_names",
        ),
        Variant(
            "remat",
            "fix",
            "jax.checkpoint per layer (nothing_saveable): the inputs stay on the device",
            _grad(recompute_all),
        ),
        Variant(
            "save-dots",
            "fix",
            "jax.checkpoint per layer, dots_with_no_batch_dims_saveable",
            _grad(save_dots),
        ),
        Variant(
            "offload-dots",
            "fix",
            "the same products offloaded (offload_dot_with_no_batch_dims)",
            _grad(offload_dots),
            since="jax.checkpoint_policies.offload_dot_with_no_batch_dims",
        ),
        Variant(
            "offload-input",
            "fix",
            "recommended: each layer's input offloaded (save_and_offload_only_these_names)",
            _grad(lambda: offload_names(BLOCK_INPUT)),
            since="jax.checkpoint_policies.save_and_offload_only_these_names",
        ),
        Variant(
            "host-weights",
            "fix",
            "offload-input, with the weights and their gradients in pinned host memory",
            lambda p: host_weights_step(devices(1)[0]),
            since="jax.memory.Space",
            args=_setup.host_weight_args(host_sharding),
            unavailable=_setup.no_host_memory,
        ),
    ),
    args=_setup.args,
    grid=_setup.grid,
    floor=_setup.floor,
    tolerance=_setup.TOLERANCE,
    runnable_scale="small",
    cause="the policy offloads a value the backward pass never reads, so nothing is saved to "
    "move: what the backward pass reads (each layer's input) stays on the device",
    recommended="offload-input",
    shown_on="h100",
)
