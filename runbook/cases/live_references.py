"""`live-references`: device arrays kept alive by Python references grow memory every step.

A training loop that keeps what each step returns (a metrics log holding the loss and the
parameters as arrays, a closure or cache that remembers them, objects in a reference
cycle) keeps every one of those arrays on the device: JAX frees an array's buffer when
the last Python reference to it goes, not before. No compiled program shows it: the step
is the same program in the reproduction and in the fix. Reports: jax-ml/jax#1222,
#10007, #14934, #725, #12575 (with google/flax#2493), #11448. The functions below are the
loops, the reproductions and their fixes; copy the one you need. Their real runs (live
device bytes, step by step) are in `runbook.runs.live_references`; the page's measurements
in `runbook.site.live_references`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from .._case_types import Case, Params, Variant

LEARNING_RATE = 0.1
OnStep = Callable[[], None] | None


def loss_fn(params: jax.Array) -> jax.Array:
    """A loss of the parameters: their mean square."""
    return jnp.mean(params**2)


@jax.jit
def train_step(params: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One step of gradient descent: the new parameters and the loss before the step."""
    loss, grad = jax.value_and_grad(loss_fn)(params)
    return params - LEARNING_RATE * params.size * grad, loss


def train_keep_arrays(
    params: jax.Array, steps: int, on_step: OnStep = None
) -> tuple[jax.Array, list[dict[str, jax.Array]]]:
    """The reproduction: each step's parameters and loss, as arrays, appended to a log.

    Every entry holds a device array the size of the parameters: the log keeps all of
    them alive, so device memory grows by one copy of the parameters each step.
    """
    log = []
    for _ in range(steps):
        params, loss = train_step(params)
        log.append({"p": params, "loss": loss})
        if on_step is not None:
            on_step()
    return params, log


def train_keep_floats(
    params: jax.Array, steps: int, on_step: OnStep = None
) -> tuple[jax.Array, list[dict[str, float]]]:
    """The fix: the log keeps the loss as a Python float, and no arrays.

    ``float(loss)`` copies the scalar to the host; the step's arrays are then referenced
    only by ``params``, which the next step replaces, so the old ones are freed at once.
    """
    log = []
    for _ in range(steps):
        params, loss = train_step(params)
        log.append({"loss": float(loss)})
        if on_step is not None:
            on_step()
    return params, log


def make_cached_loss() -> Callable[[jax.Array], float]:
    """A loss memoised by the identity of its argument: the cache (a dict in the closure)
    keeps each argument alive, as it must for its ids to stay unique."""
    cache: dict[int, tuple[jax.Array, float]] = {}

    def cached_loss(params: jax.Array) -> float:
        if id(params) not in cache:
            cache[id(params)] = (params, float(loss_fn(params)))
        return cache[id(params)][1]

    return cached_loss


def train_cache_arrays(
    params: jax.Array, steps: int, on_step: OnStep = None
) -> tuple[jax.Array, list[dict[str, float]]]:
    """A reproduction: the log holds floats, but a closure's cache holds every step's
    parameters (google/flax#2493's mechanism: a cache that references the arrays)."""
    cached_loss = make_cached_loss()
    log = []
    for _ in range(steps):
        params, _ = train_step(params)
        log.append({"loss": cached_loss(params)})
        if on_step is not None:
            on_step()
    return params, log


class CyclicState:
    """A step's parameters and loss, with a callback that refers back to the state: the
    lambda's closure holds the state, the state holds the lambda (a reference cycle)."""

    def __init__(self, params: jax.Array, loss: jax.Array) -> None:
        self.params = params
        self.loss = loss
        self.restore: Callable[[], jax.Array] = lambda: self.params


class State:
    """The same state without the cycle: `restore` is a method, looked up on the class."""

    def __init__(self, params: jax.Array, loss: jax.Array) -> None:
        self.params = params
        self.loss = loss

    def restore(self) -> jax.Array:
        return self.params


def train_keep_last_cyclic(
    params: jax.Array, steps: int, on_step: OnStep = None
) -> tuple[jax.Array, list[dict[str, float]]]:
    """A reproduction: only the last step's state is kept, but each state is in a
    reference cycle, so a replaced one is freed only when Python's cycle collector runs
    (jax-ml/jax#725), not when the loop drops it."""
    state = CyclicState(params, jnp.zeros(()))
    log = []
    for _ in range(steps):
        params, loss = train_step(state.restore())
        state = CyclicState(params, loss)
        log.append({"loss": float(state.loss)})
        if on_step is not None:
            on_step()
    return state.params, log


def train_keep_last(
    params: jax.Array, steps: int, on_step: OnStep = None
) -> tuple[jax.Array, list[dict[str, float]]]:
    """The fix for the cycle: the same loop with `State`, which holds no reference to
    itself, so reference counting frees each replaced state at once."""
    state = State(params, jnp.zeros(()))
    log = []
    for _ in range(steps):
        params, loss = train_step(state.restore())
        state = State(params, loss)
        log.append({"loss": float(state.loss)})
        if on_step is not None:
            on_step()
    return state.params, log


# Each variant's loop, by name: what the real runs and the page run, what `runbook.watch` names.
LOOPS: dict[str, Callable[..., tuple[jax.Array, list[Any]]]] = {
    "keep-arrays": train_keep_arrays,
    "cache-arrays": train_cache_arrays,
    "cycle": train_keep_last_cyclic,
    "keep-floats": train_keep_floats,
    "cycle-broken": train_keep_last,
}


def initial_params(size: int) -> jax.Array:
    """The parameters the loops start from: `size` float32 values, all different."""
    return jnp.linspace(-1.0, 1.0, size, dtype=jnp.float32)


def param_bytes(scale: Mapping[str, Any]) -> int:
    """Bytes of the parameters at `scale` (one copy)."""
    return int(scale["size"]) * 4


def floor_bytes(scale: Mapping[str, Any]) -> int:
    """What one step must hold at the least: the parameters in, the new ones and the loss out."""
    return 2 * param_bytes(scale) + 4


def _floor(variant: Variant, scale: Mapping[str, Any], params: Params) -> int:
    return floor_bytes(scale)


def _args(scale: Mapping[str, Any], params: Params, concrete: bool) -> tuple[Any]:
    if concrete:
        return (initial_params(scale["size"]),)
    return (jax.ShapeDtypeStruct((scale["size"],), jnp.float32),)


def _step(params: Params) -> Callable[..., Any]:
    return train_step


CASE = Case(
    name="live-references",
    title="Device arrays kept alive by Python references",
    symptom="device memory grows every step of a training loop, though each step's program "
    "needs the same; memory_analysis shows nothing wrong",
    devices=1,
    scales={
        "seed": {"size": 2**20, "steps": 50},
        "small": {"size": 2**16, "steps": 20},
        "tiny": {"size": 256, "steps": 4},
    },
    variants=(
        Variant(
            "keep-arrays",
            "reproduction",
            "each step's parameters and loss kept as arrays in a log (train_keep_arrays)",
            _step,
        ),
        Variant(
            "cache-arrays",
            "reproduction",
            "a closure's cache keeps each step's parameters (train_cache_arrays)",
            _step,
        ),
        Variant(
            "cycle",
            "reproduction",
            "only the last state kept, each in a reference cycle (train_keep_last_cyclic)",
            _step,
        ),
        Variant(
            "keep-floats",
            "fix",
            "recommended: the log keeps the loss as a Python float (train_keep_floats)",
            _step,
        ),
        Variant(
            "cycle-broken",
            "fix",
            "the last state kept, with no reference cycle (train_keep_last)",
            _step,
        ),
    ),
    args=_args,
    grid=lambda s: [{"steps": s["steps"]}],
    floor=_floor,
    runnable_scale="seed",
    cause="the loop keeps Python references to each step's device arrays (or leaves them "
    "in cycles): their buffers live as long as the references",
    recommended="keep-floats",
    figures="runbook.runs.live_references:live_figures",
    key_figure="live_growth",
    runtime=True,
)
