"""A command's options read from a YAML file (``--config run.yaml``) and turned into argv tokens.

    tandem train --config run.yaml --steps 10
    tandem train --config - < run.yaml             # the file from standard input

Each ``key: value`` of the file becomes ``--key=value`` in front of the command line, so argparse
converts and checks it as it does a typed flag, and a flag given on the command line wins (the
file's value is checked all the same). An error found once the options are parsed (a range:
``--steps must be at least 1``) names the file and line of the option it names. A
value is read as its command-line spelling (``steps: 010`` is 10, as ``--steps 010`` is); a
switch (``--json``) takes ``true`` or ``false``; an option of ``KEY=VALUE`` words
(``--optimizer-options``) takes a mapping too (``optimizer-options: {betas: [0.9, 0.95]}``).

argparse has no public way to list a parser's options or to convert one value, so this module
reads its long-stable private tables (``_option_string_actions``, ``_mutually_exclusive_groups``)
and calls ``_get_values``, the conversion ``parse_args`` itself uses.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from typing import Any, Sequence

import yaml

from tandem.errors import UsageError

CONFIG_DEST = "config"
"""Where ``--config`` lands in the parsed arguments."""
SOURCES_DEST = "config_sources"
"""Where the parsed arguments keep the file and line of each option the file gave (flag ->
``run.yaml:3``), for the errors found later (:func:`located`)."""
STDIN = "<stdin>"
"""How locations name standard input (``--config -``)."""
KEY_VALUE = "KEY=VALUE"
"""The metavar of an option of ``KEY=VALUE`` words (``--optimizer-options``), which a file
may give as a mapping (``optimizer-options: {betas: [0.9, 0.95], eps: 1.0e-8}``), a list of
words or one line of them."""


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """Register ``--config FILE`` on a command's parser."""
    parser.add_argument(f"--{CONFIG_DEST}", metavar="FILE",
                        help="YAML file of this command's options, keyed by flag name "
                        "(batch-size: 64, json: true); flags on the command line override it")


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One ``key: value`` of a config file."""

    key: str
    """The key as written."""
    value: Any
    """The value as YAML reads it (``True``, ``None``, a list, ...)."""
    text: str | None
    """A scalar value as written, without quotes; None for a list or a mapping."""
    line: int
    """The key's line, from 1."""


def expand_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` (a command's arguments, without its name) with the options of its ``--config``
    file put in front; ``argv`` itself when it has no ``--config``.

    A file's option that the command line also gives (or one of its mutually exclusive
    alternatives) is left out. ``false`` for a switch whose default is already on turns its
    default off on ``parser``. Raises UsageError, naming the file, line and fix, for a file that
    cannot be read, is not YAML or not a mapping, and for a key that is not an option of the
    command, is given twice, is ``config``, or has a value its option refuses.
    """
    argv = list(argv)
    path = _config_path(parser, argv)
    if path is None:
        return argv
    options = _long_options(parser)
    given = [action for _, action in _flags(parser, argv)]
    chosen: dict[str, Entry] = {}
    tokens: list[str] = []
    sources: dict[str, str] = {}
    for entry in read_config(path):
        where = f"{_label(path)}:{entry.line}"
        option, action = _lookup(options, entry, where, parser.prog, path)
        _check_unique(parser, action, entry, chosen, where)
        chosen[action.dest] = entry
        overridden = any(_same_choice(parser, action, other) for other in given)
        words = _tokens(parser, option, action, entry, where, checking=overridden)
        if not overridden:  # checked all the same: a bad value is a mistake in the file
            tokens += words
            sources.update(dict.fromkeys(action.option_strings, where))
    parser.set_defaults(**{SOURCES_DEST: sources})
    return tokens + argv


def located(exc: UsageError, sources: dict[str, str] | None) -> UsageError:
    """``exc``, raised once the arguments were parsed (a range check: ``--steps must be at
    least 1``), with the file and line of the first option it names that a config file gave
    (``sources``: :data:`SOURCES_DEST`)."""
    message = str(exc)
    for flag in re.findall(r"--[a-z][a-z0-9-]*", message):
        if sources and flag in sources:
            return UsageError(f"{sources[flag]}: {message}")
    return exc


def read_config(path: str) -> list[Entry]:
    """The entries of the YAML mapping in ``path``, in file order (none for an empty file)."""
    text = _read_text(path)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return []
        if not isinstance(node, yaml.MappingNode):
            kind = "a list" if isinstance(node, yaml.SequenceNode) else "a single value"
            raise UsageError(f"--config {path} holds {kind}; it must hold one 'option: value' "
                             f"per line, e.g. 'steps: 100'")
        return [_entry(loader, key, value, path) for key, value in node.value]
    except yaml.MarkedYAMLError as exc:
        raise UsageError(f"--config {path} is not valid YAML: {_describe(exc)}; fix the file") \
            from None
    except yaml.YAMLError as exc:
        raise UsageError(f"--config {path} is not valid YAML: {' '.join(str(exc).split())}; "
                         f"fix the file") from None
    finally:
        loader.dispose()


def _label(path: str) -> str:
    """How locations name the file: ``<stdin>`` for ``--config -``."""
    return STDIN if path == "-" else path


def _read_text(path: str) -> str:
    if path == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("--config - reads the options from standard input, which is a "
                             "terminal here; pipe them in (tandem train --config - < run.yaml) "
                             "or give the file's path")
        try:
            return sys.stdin.read()
        except UnicodeDecodeError:
            raise UsageError("--config - read standard input, which is not UTF-8 text; give "
                             "YAML") from None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file; check the path (a relative one starts "
                         f"at the current directory)") from None
    except IsADirectoryError:
        raise UsageError(f"--config {path} is a directory; give a YAML file") from None
    except UnicodeDecodeError:
        raise UsageError(f"--config {path} is not UTF-8 text; give a YAML file") from None
    except OSError as exc:
        raise UsageError(f"cannot read --config {path}: {exc.strerror}; check its "
                         f"permissions") from None


def _describe(exc: yaml.MarkedYAMLError) -> str:
    """``line 3: could not find expected ':' (while scanning a simple key at line 2)``."""
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}: " if mark is not None else ""
    what = exc.problem or exc.context or "unreadable"
    if exc.problem and exc.context:
        at = f" at line {exc.context_mark.line + 1}" if exc.context_mark is not None else ""
        what += f" ({exc.context}{at})"
    return where + what


def _entry(loader: yaml.SafeLoader, key: yaml.Node, value: yaml.Node, path: str) -> Entry:
    line = key.start_mark.line + 1
    if not isinstance(key, yaml.ScalarNode):
        raise UsageError(f"{path}:{line}: a key must be an option name, e.g. 'steps', not a "
                         f"list or a mapping")
    text = value.value if isinstance(value, yaml.ScalarNode) else None
    return Entry(key=key.value, value=loader.construct_object(value, deep=True), text=text,
                 line=line)


def _normal(name: str) -> str:
    """``batch_size`` and ``batch-size`` are the same key."""
    return name.replace("_", "-")


def _long_options(parser: argparse.ArgumentParser) -> dict[str, tuple[str, argparse.Action]]:
    """Key -> (its long flag, its action), for every option but ``--help``."""
    return {_normal(option[2:]): (option, action)
            for option, action in parser._option_string_actions.items()
            if option.startswith("--") and action.dest != "help"}


def _flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[tuple[int, argparse.Action]]:
    """The flags of ``argv`` (up to a ``--``): their positions and actions."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = [(index, _resolve(parser, token)) for index, token in enumerate(argv[:end])
             if token.startswith("-") and token != "-"]
    return [(index, action) for index, action in found if action is not None]


def _resolve(parser: argparse.ArgumentParser, token: str) -> argparse.Action | None:
    """The action of a flag as argparse reads it (``--batch=64`` is ``--batch-size``)."""
    table = parser._option_string_actions
    name = token.split("=", 1)[0] if token.startswith("--") else token[:2]
    if name in table:
        return table[name]
    if not token.startswith("--") or not parser.allow_abbrev:
        return None
    matches = {table[option] for option in table if option.startswith(name)}
    return matches.pop() if len(matches) == 1 else None


def _config_path(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The ``--config`` value, None when absent or missing (argparse then reports it)."""
    indices = [index for index, action in _flags(parser, argv) if action.dest == CONFIG_DEST]
    if len(indices) > 1:
        raise UsageError(f"--config is given {len(indices)} times; give one file")
    if not indices:
        return None
    token = argv[indices[0]]
    if "=" in token:
        return token.split("=", 1)[1]
    following = argv[indices[0] + 1:indices[0] + 2]
    if following and (following[0] == "-" or not following[0].startswith("-")):
        return following[0]  # "-": standard input
    return None


def _lookup(options: dict[str, tuple[str, argparse.Action]], entry: Entry, where: str,
            prog: str, path: str) -> tuple[str, argparse.Action]:
    name = _normal(entry.key)
    if name == CONFIG_DEST:
        raise UsageError(f"{where}: a config file cannot name another one (no nesting); move "
                         f"that file's options into {path}")
    if name not in options:
        close = difflib.get_close_matches(name, [key for key in options if key != CONFIG_DEST],
                                          n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"see {prog} --help"
        raise UsageError(f"{where}: '{entry.key}' is not an option of {prog}; {hint}")
    return options[name]


def _check_unique(parser: argparse.ArgumentParser, action: argparse.Action, entry: Entry,
                  chosen: dict[str, Entry], where: str) -> None:
    """Refuse a second key for one option, or two keys that exclude each other."""
    if action.dest in chosen:
        first = chosen[action.dest]
        raise UsageError(f"{where}: '{entry.key}' repeats '{first.key}' of line {first.line}; "
                         f"keep one")
    for group in parser._mutually_exclusive_groups:
        if action in group._group_actions:
            for other in group._group_actions:
                if other is not action and other.dest in chosen:
                    first = chosen[other.dest]
                    raise UsageError(f"{where}: '{entry.key}' and '{first.key}' (line "
                                     f"{first.line}) exclude each other; keep one")


def _same_choice(parser: argparse.ArgumentParser, action: argparse.Action,
                 other: argparse.Action) -> bool:
    """Whether ``other`` on the command line overrides ``action`` from the file: the same
    setting, or its alternative in a mutually exclusive group."""
    if other.dest == action.dest:
        return True
    return any(action in group._group_actions and other in group._group_actions
               for group in parser._mutually_exclusive_groups)


def _tokens(parser: argparse.ArgumentParser, option: str, action: argparse.Action, entry: Entry,
            where: str, *, checking: bool = False) -> list[str]:
    """The argv tokens of one entry, checked by argparse's own conversion (only ``checking``:
    the command line overrides it, so a switch's ``false`` changes no default)."""
    if action.nargs == 0:
        return _switch(parser, option, action, entry, where, checking=checking)
    value, key = entry.value, entry.key
    many = action.nargs not in (None, "?")
    if value is None:
        raise UsageError(f"{where}: '{key}' has no value; give one or remove the line")
    if isinstance(value, bool):
        if action.nargs == "?":
            return [option] if value else []
        raise UsageError(f"{where}: YAML reads {key}: {entry.text} as {str(value).lower()}, but "
                         f"{option} takes a value; write {key}: \"{entry.text}\" for the word")
    if (isinstance(value, dict) and action.metavar != KEY_VALUE) or (
            isinstance(value, list) and not many):
        kind = "a mapping" if isinstance(value, dict) else "a list"
        raise UsageError(f"{where}: '{key}' is {kind}, but {option} takes one value; give "
                         f"{_example(action)}")
    if isinstance(value, dict):
        words = [f"{name}={_word(item)}" for name, item in value.items()]
    elif isinstance(value, list):
        words = [str(item) for item in value]
    else:
        words = str(entry.text).split() if action.metavar == KEY_VALUE else [str(entry.text)]
    try:
        parser._get_values(action, list(words))
    except argparse.ArgumentError as exc:
        fix = "" if action.choices is not None else f"; give {_example(action)}"
        raise UsageError(f"{where}: {key}: {exc.message}{fix}") from None
    return [option, *words] if many else [f"{option}={words[0]}"]


def _word(value: Any) -> str:
    """A mapping's value as a ``KEY=VALUE`` word's value: a list joined by commas."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    return str(value)


def _switch(parser: argparse.ArgumentParser, option: str, action: argparse.Action, entry: Entry,
            where: str, *, checking: bool = False) -> list[str]:
    """A flag without a value: the flag for ``true``; for ``false`` nothing, its opposite
    (``--no-x``), or its default turned off when the default is the flag's value."""
    if not isinstance(entry.value, bool):
        shown = entry.text if entry.text is not None else type(entry.value).__name__
        raise UsageError(f"{where}: {option} is a switch; give {entry.key}: true or "
                         f"{entry.key}: false (got {shown!r})")
    if isinstance(action, argparse.BooleanOptionalAction):
        opposite = next(other for other in action.option_strings
                        if other.startswith("--") and other != option)
        return [option if entry.value else opposite]
    if entry.value:
        return [option]
    if checking:
        return []
    if isinstance(action.const, bool) and action.default == action.const:
        parser.set_defaults(**{action.dest: not action.const})
    return []


def _example(action: argparse.Action) -> str:
    """What an option's value looks like, for an error's fix."""
    if action.choices is not None:
        return "one of " + ", ".join(map(str, action.choices))
    if action.type is int:
        return "a whole number"
    if action.type is float:
        return "a number"
    return "one value"


__all__ = ["CONFIG_DEST", "SOURCES_DEST", "Entry", "add_config_argument", "expand_config",
           "located", "read_config"]
