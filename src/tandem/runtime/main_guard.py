"""Catch a script that starts local workers from its top level without the ``__main__`` guard,
before any worker starts.

Local workers start from a forkserver (or by spawning), and each one runs the main script again
as it starts (as ``__mp_main__``), so that what the script defines (a model class, a dataset)
can be unpickled there. A script that calls ``tandem.fit`` at its top level, outside ``if
__name__ == "__main__":``, would call it again in every worker, which fails far from the cause
(80 lines ending in a PyTorch URL). :func:`check_main_guard` finds the script's statement that
is running and reads the script's syntax to tell whether that statement is under the guard; if
not, it raises a :class:`~tandem.errors.UsageError` that, left uncaught, ends the script with
that one line on stderr instead of a traceback.

Usage::

    check_main_guard()      # in the launcher, before the workers start
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import FrameType, TracebackType

from tandem.errors import UsageError

GUARD = 'if __name__ == "__main__":'


def check_main_guard(frame: FrameType | None = None) -> None:
    """Raise a :class:`UsageError` naming the script and line if the running main script's
    top-level statement that led here is not under ``if __name__ == "__main__":`` (``frame``:
    where to start looking, this function's caller by default). Interactive sessions, ``-c``
    code, ``python -m package`` (its ``__main__.py`` is not run again) and scripts whose source
    cannot be read are left alone."""
    top = _main_module_frame(frame or sys._getframe(1))  # noqa: SLF001 - the caller's frame
    if top is None:
        return
    script = Path(top.f_code.co_filename)
    try:
        tree = ast.parse(script.read_text(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return
    if not _guarded(tree.body, top.f_lineno):
        error = UsageError(f"{script} starts tandem's workers from its top level (line "
                           f"{top.f_lineno}), and every worker runs the script again as it "
                           f"starts; put that call under {GUARD}")
        _one_line_if_uncaught(error)
        raise error


def _one_line_if_uncaught(error: UsageError) -> None:
    """Show ``error`` as ``tandem: error: <message>`` if it ends the script (the traceback would
    only repeat the line the message names); any other uncaught exception as before."""
    shown = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if value is error:
            print(f"tandem: error: {value}", file=sys.stderr, flush=True)
        else:
            shown(kind, value, tb)

    sys.excepthook = hook


def _main_module_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of the main script's top-level code, if it is on the stack and the workers
    run the script again (as ``multiprocessing`` decides: a main module run by name, unless it
    is a package's ``__main__``, or one with a file; a notebook's has neither)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name.rpartition(".")[2] == "__main__":
        return None
    path = getattr(main, "__file__", None)
    if path is None:
        return None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            here = Path(frame.f_code.co_filename)
            return frame if here.is_file() and here.resolve() == Path(path).resolve() else None
        frame = frame.f_back
    return None


def _guarded(body: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` lies in the body of an ``if __name__ == "__main__":`` among the
    statements ``body`` (or among those nested in them: a guard inside a ``try``)."""
    for statement in body:
        end = statement.end_lineno or statement.lineno
        if not statement.lineno <= line <= end:
            continue
        if isinstance(statement, ast.If) and _is_guard(statement.test):
            return any(child.lineno <= line <= (child.end_lineno or child.lineno)
                       for child in statement.body)
        nested = [getattr(statement, field) for field in ("body", "orelse", "finalbody")
                  if isinstance(getattr(statement, field, None), list)]
        nested += [handler.body for handler in getattr(statement, "handlers", [])]
        return any(_guarded(block, line) for block in nested)
    return False


def _is_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {_word(test.left), _word(test.comparators[0])}
    return sides == {"name:__name__", "text:__main__"}


def _word(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"name:{node.id}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return f"text:{node.value}"
    return ""
