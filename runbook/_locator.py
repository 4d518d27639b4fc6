"""Locators: the ``path/to/file.py:name`` strings that name a user's function on the command
line (``python -m runbook diagnose train.py:step --args train.py:make_args``, ``python -m
runbook watch train.py:main``), and the one loader of them."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ._errors import RunbookError

_T = TypeVar("_T")


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def load_callable(locator: str, what: str = "function") -> Callable[..., Any]:
    """The callable named by ``path/to/file.py:name`` (the file is imported as a module).

    Raises:
        RunbookError: the locator is malformed, the file is missing or fails to import, or it
            has no callable of that name; the message is one line.
    """
    path_text, sep, name = locator.rpartition(":")
    if not sep or not path_text or not name:
        raise RunbookError(f"`{locator}`: expected path/to/file.py:{what}")
    path = pathlib.Path(path_text)
    if not path.is_file():
        raise RunbookError(f"`{locator}`: no such file {path_text!r}")
    module_name = f"_runbook_user_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, path)
        if loader is None or loader.loader is None:
            raise RunbookError(f"`{locator}`: {path_text!r} is not a Python file")
        module = importlib.util.module_from_spec(loader)
        sys.path.insert(0, str(path.resolve().parent))  # its own imports of its neighbours
        try:
            loader.loader.exec_module(module)
        except Exception as e:  # the user's file: whatever it raises, say so in one line
            raise RunbookError(f"`{locator}`: importing {path_text!r} failed: {one_line(e)}") from e
        finally:
            sys.path.remove(str(path.resolve().parent))
        sys.modules[module_name] = module
    found: object = getattr(module, name, None)
    if found is None:
        raise RunbookError(f"`{locator}`: {path_text!r} has no {what} named {name!r}")
    if not callable(found):
        raise RunbookError(f"`{locator}`: {name!r} is a {type(found).__name__}, not a {what}")
    return found


def load_args(locator: str | None) -> tuple[Any, ...]:
    """The arguments the function named by ``path/to/file.py:make_args`` returns when called
    with none: a tuple is the arguments, anything else the one argument; none without a
    locator.

    Raises:
        RunbookError: the locator does not load, or `make_args` fails; the message is one
            line.
    """
    if not locator:
        return ()
    make_args = load_callable(locator, "make_args function")
    try:
        made = make_args()
    except Exception as e:  # the user's code
        raise RunbookError(f"`{locator}` failed: {one_line(e)}") from e
    return made if isinstance(made, tuple) else (made,)


def call_located(
    locator: str,
    args_locator: str | None,
    run: Callable[[Callable[..., Any], tuple[Any, ...], str], _T],
) -> _T:
    """``run(fn, args, name)`` for the function a locator names, its arguments from
    `args_locator` (see `load_args`) and its name: how the command line's ``diagnose`` and
    ``timeline`` call a user's code. Every failure of that code (import, `make_args`,
    tracing) is a `RunbookError` with a one-line message."""
    fn = load_callable(locator)
    args = load_args(args_locator)
    try:
        return run(fn, args, locator.rpartition(":")[2])
    except RunbookError as e:
        raise RunbookError(str(e).strip().splitlines()[0]) from e
    except Exception as e:  # a failure inside the user's function while JAX traces it
        raise RunbookError(f"could not trace `{locator}`: {one_line(e)}") from e
