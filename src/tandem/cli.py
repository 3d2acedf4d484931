"""The ``tandem`` command line: parse arguments, call the library, print results.

Each subcommand lives in ``tandem.commands.<name>`` and provides ``add_parser(subparsers)``,
which registers its arguments and sets ``run`` (a function of the parsed arguments returning
the exit status) as a default. The commands in ``CONFIG_COMMANDS`` also take ``--config FILE``,
a YAML file of their options (``tandem.commands.config_file``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, NoReturn, Optional, Sequence

from tandem.errors import Interrupted, UsageError, WorkerFailure, shown_on_stderr

COMMANDS = ("train", "demo", "pack", "export", "profile", "plan", "topology", "simulate", "search",
            "scale")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CONFIG_COMMANDS = ("train", "profile", "plan", "simulate", "search", "scale")
"""The commands that train or plan, which read options from ``--config FILE`` too."""


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser that reports a mistake in one line and exits with status 2."""

    commands: dict[str, ArgumentParser]
    """The top-level parser's subcommand parsers, by name (set by ``build_parser``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> ArgumentParser:
    """The parser of all subcommands, or of ``command`` alone: all that a command line naming
    it needs, without importing the other commands' modules (the planning commands' numpy)."""
    from tandem.commands.config_file import add_config_argument

    parser = ArgumentParser(
        prog="tandem", description="Train one neural network on many devices with PyTorch."
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=ArgumentParser
    )
    for name in COMMANDS if command is None else (command,):
        importlib.import_module(f"tandem.commands.{name}").add_parser(subparsers)
    parser.commands = subparsers.choices
    for name in CONFIG_COMMANDS:
        if name in parser.commands:
            add_config_argument(parser.commands[name])
    return parser


_this_process: str | None = None
"""The command this process runs as its own command line (``main()`` without ``argv``), e.g.
``"train"``; None in-process (a test's or a user's ``main([...])``)."""


def _stop(signum: int, frame: FrameType | None) -> None:
    """Raise :class:`Interrupted`, unless this process is the command line and the signal
    landed in an import: torch's imports call back into Python from C++, where an exception
    raised by a signal handler aborts the process (``terminate called after throwing an
    instance of 'pybind11::error_already_set'``). Nothing has started there that needs undoing,
    so the command ends at once, with its line and status."""
    if _this_process is not None and _importing(frame):
        _end_now(_this_process, signum)
    raise Interrupted(signum)


def _importing(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _end_now(command: str, signum: int) -> NoReturn:
    code = _interrupted(command, Interrupted(signum))
    if "tandem.runtime.zygote" in sys.modules:
        sys.modules["tandem.runtime.zygote"].stop()
    sys.stdout.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    SIGINT (Ctrl-C), SIGTERM and SIGHUP, at any moment from here on (reading the arguments,
    importing torch, starting or running the workers), stop every worker and end the command
    with one line and status ``128 + signal`` (130, 143, 129). SIGINT is always honoured (the
    elastic agent honours it once the workers run, so an ignored SIGINT inherited from a
    shell's background job would only be ignored until then); SIGTERM and SIGHUP only where
    they are not ignored already (``nohup``).
    """
    global _this_process
    handlers = _catch_stop_signals()
    words = list(sys.argv[1:] if argv is None else argv)
    command = words[0] if words and words[0] in COMMANDS else ""
    if argv is None:
        _this_process = command
    try:
        with shown_on_stderr(command):  # tandem's warnings and log records, one line each
            return _main(words)
    except KeyboardInterrupt as exc:  # before a command's own handling (e.g. in an import)
        return _interrupted(command, exc)
    finally:
        if argv is None and "tandem.runtime.zygote" in sys.modules:
            sys.modules["tandem.runtime.zygote"].stop()  # this process is the command: its
            # workers' forkserver ends with it
        _this_process = None
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


SignalHandler = Callable[[int, Optional[FrameType]], Any] | int | None
"""What ``signal.getsignal`` returns: a function, ``SIG_DFL``/``SIG_IGN``, or None (not set
from Python)."""


def _catch_stop_signals() -> dict[signal.Signals, SignalHandler]:
    """Turn the stop signals into :class:`Interrupted`; returns the handlers they replaced
    (none off the main thread, where Python lets no handler be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum, handler in handlers.items():
        if signum == signal.SIGINT or handler is signal.SIG_DFL:
            signal.signal(signum, _stop)
    return handlers


def _main(argv: list[str]) -> int:
    from tandem.commands.config_file import expand_config

    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    if argv and argv[0] in CONFIG_COMMANDS:
        try:
            argv = [argv[0], *expand_config(parser.commands[argv[0]], argv[1:])]
        except UsageError as exc:
            return _usage_error(argv[0], exc)
    args = parser.parse_args(argv)
    _find_user_modules()
    return _run(args)


def _find_user_modules() -> None:
    """Let ``--model mypkg.models:build`` find ``mypkg`` in the current directory, as
    ``python -m tandem`` does (the ``tandem`` script's own directory is on ``sys.path``
    instead); spawned workers inherit the path."""
    here = os.getcwd()
    if "" not in sys.path and here not in sys.path:
        sys.path.insert(0, here)


def _run(args: argparse.Namespace) -> int:
    from tandem.commands.config_file import SOURCES_DEST, located

    try:
        return int(args.run(args))
    except UsageError as exc:
        return _usage_error(args.command, located(exc, getattr(args, SOURCES_DEST, None)))
    except WorkerFailure as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a read or write that failed where no reader or writer named it
        from tandem.output_files import os_error_line

        print(f"tandem {args.command}: {os_error_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        return _interrupted(args.command, exc)


def _interrupted(command: str, exc: KeyboardInterrupt) -> int:
    """Report a stop signal in one line; the exit status ``128 + signal``."""
    signum = getattr(exc, "signum", signal.SIGINT)
    print(f"tandem{' ' + command if command else ''}: stopped by "
          f"{signal.Signals(signum).name}; every worker has ended", file=sys.stderr, flush=True)
    return 128 + signum


def _usage_error(command: str, exc: UsageError) -> int:
    """Report a user's mistake in one line; the exit status 2."""
    print(f"tandem {command}: error: {exc}", file=sys.stderr)
    return 2
