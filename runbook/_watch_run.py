"""Running code under `runbook.watch`: the command line's ``watch`` and the cost per step."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import jax

from ._errors import RunbookError
from ._locator import load_callable, one_line
from ._watch import Watch, _Enough, watch


def overhead(steps: int = 40, arrays: int = 200, repeats: int = 3) -> dict[str, float]:
    """The watch's cost per step, measured: a steady loop over `arrays` small arrays, run
    with and without `watch` (the fastest of `repeats` runs each).

    Returns:
        ``seconds_without`` and ``seconds_with`` per step, ``overhead_seconds`` per step
        (their difference), and ``live_arrays`` (what each mark read).
    """
    import jax.numpy as jnp

    update = jax.jit(lambda xs: [x + 1 for x in xs])
    state = [jnp.zeros(256) for _ in range(arrays)]
    state = jax.block_until_ready(update(state))

    def loop(mark: Callable[[], None]) -> float:
        nonlocal state
        t = time.perf_counter()
        for _ in range(steps):
            state = update(state)
            mark()
        jax.block_until_ready(state)
        return (time.perf_counter() - t) / steps

    without = min(loop(lambda: None) for _ in range(repeats))
    timed = []
    live = 0
    for _ in range(repeats):
        with watch(holders=False) as w:
            timed.append(loop(w.step))
        live = w.records[-1].live_arrays
    with_ = min(timed)
    return {
        "seconds_without": without,
        "seconds_with": with_,
        "overhead_seconds": with_ - without,
        "live_arrays": float(live),
    }


def run_locator(
    locator: str, *, steps: int | None = None, step_on: str | None = None, **overrides: Any
) -> tuple[Watch, str | None]:
    """Run ``path/to/file.py:main`` under a watch, for ``python -m runbook watch``.

    The step is marked by a callback: when `main` takes a parameter it is called with
    ``mark_step``. Otherwise `step_on` names a module-level function of the file that is
    wrapped so that each call marks a step. `steps` stops the run after that many steps.

    Returns:
        The watch, and the one-line error that ended the run (the function raised, or no
        step was marked), or None. The watch's record is kept either way.

    Raises:
        RunbookError: the locator or `step_on` do not name what they should.
    """
    main = load_callable(locator)
    if steps is not None and steps < 1:
        raise RunbookError("--steps: at least 1")
    try:
        params = [
            p
            for p in inspect.signature(main).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        ]
    except (TypeError, ValueError):
        params = []
    g: dict[str, Any] | None = getattr(main, "__globals__", None)
    if step_on is not None:
        if g is None or not callable(g.get(step_on)):
            raise RunbookError(
                f"--step-on {step_on}: `{locator}`'s module has no function {step_on!r}"
            )
    elif not params:
        raise RunbookError(
            f"`{locator}` takes no parameter to receive mark_step: give it one, or name the "
            "module-level function called once per step with --step-on NAME"
        )
    w = watch(**overrides)

    def mark_step() -> None:
        w.step()
        if steps is not None and w.steps >= steps:
            raise _Enough

    original = g[step_on] if (g is not None and step_on is not None) else None
    if g is not None and step_on is not None:

        def marked(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)  # type: ignore[misc]
            mark_step()
            return out

        g[step_on] = marked
    error = None
    try:
        with w:
            if step_on is not None:
                main()
            else:
                main(mark_step)
    except RunbookError as e:  # no step marked
        error = str(e)
    except Exception as e:  # noqa: BLE001 - the user's code raised: the record is kept and shown
        error = f"`{locator}` raised {one_line(e)}"
    finally:
        if g is not None and step_on is not None:
            g[step_on] = original
    return w, error
