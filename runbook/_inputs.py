"""What users pass, made into what `jax.jit` lowers: a function of arrays.

Real programs hand over objects, not only functions of arrays: an equinox Module or a flax
NNX module called as the function, an `equinox.filter_jit` function, arguments whose
pytrees hold functions, strings or flags beside their arrays. `jax.jit(fn).lower(*args)`
refuses most of these, and where it accepts a module as the function it bakes the module's
weights into the program as constants. Here, as `equinox.filter_jit` does, every array leaf
(a concrete array, a `jax.ShapeDtypeStruct`, a NumPy array) is traced and every other leaf
is static; a callable that holds arrays becomes the program's first argument, so that its
weights are inputs rather than constants. A plain function of arrays and numbers, and
JAX's own `jit` and `pmap` objects, pass through unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._errors import RunbookError


def _array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic)


def _number(leaf: Any) -> bool:
    return isinstance(leaf, bool | int | float | complex)


def staged(fn: Any) -> bool:
    """Whether `fn` is JAX's own `jit` or `pmap` object, which lowers itself as it is."""
    if not hasattr(fn, "lower"):
        return False
    return inspect.isfunction(fn) or type(fn).__module__.split(".")[0] in ("jax", "jaxlib")


def quiet_donation(fn: Any) -> bool:
    """Whether `fn` donates every argument and silences JAX's warning for those it cannot
    use, as `equinox.filter_jit(..., donate="all")` does."""
    return bool(getattr(fn, "filter_warning", False))


class _Split:
    """One pytree's array leaves (traced) apart from the rest (static), and how to rejoin."""

    def __init__(self, tree: Any) -> None:
        leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        self.mask = [_array(x) for x in leaves]
        self.arrays = [x for x, m in zip(leaves, self.mask, strict=True) if m]
        self.static = [x for x, m in zip(leaves, self.mask, strict=True) if not m]

    def join(self, arrays: Sequence[Any]) -> Any:
        traced, static = iter(arrays), iter(self.static)
        leaves = [next(traced) if m else next(static) for m in self.mask]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def as_jax(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """`fn` and `args` as `jax.jit` lowers them (unchanged where it already can).

    Returns ``(fn, args)`` or a `jax.jit` of a wrapper and the array leaves it takes: one
    list per argument, after one for the callable's own arrays where it holds any. The
    wrapper returns the array leaves of what `fn` returns. An `equinox.filter_jit`
    function keeps its donation.
    """
    if staged(fn):
        return fn, args
    if not callable(fn):
        raise RunbookError(f"`fn` must be a callable, got {type(fn).__name__}.")
    own = _Split(fn)
    holds = bool(own.arrays)
    leaves = jax.tree_util.tree_leaves(args)
    # What jax.jit(fn) takes as it is; an object with a `lower` of its own that is not
    # JAX's (equinox.filter_jit) lowers to something else, so it is wrapped like a module.
    if not holds and not hasattr(fn, "lower") and all(_array(x) or _number(x) for x in leaves):
        return fn, args
    splits = [_Split(a) for a in args]

    def program(*arrays: Any) -> Any:
        call = own.join(arrays[0]) if holds else fn
        rest = arrays[1:] if holds else arrays
        out = call(*(s.join(a) for s, a in zip(splits, rest, strict=True)))
        return [x for x in jax.tree_util.tree_leaves(out) if _array(x)]  # e.g. a new Module

    program.__name__ = str(getattr(fn, "__name__", type(fn).__name__))
    first = int(holds)  # the position of the first argument's arrays
    donate = [first] if getattr(fn, "donate_first", False) else []
    if getattr(fn, "donate_rest", False):
        donate += range(first + 1, first + len(args))
    inputs = ([own.arrays] if holds else []) + [s.arrays for s in splits]
    return jax.jit(program, donate_argnums=tuple(donate)), tuple(inputs)
