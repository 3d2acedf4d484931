"""Where rank 0's metrics lines go (``--log-to``): ``metrics.jsonl``, ``metrics.csv`` and
TensorBoard's event files in ``tensorboard/``, each a sink that
:class:`~tandem.runtime.reporting.Reporter` hands every line to.

Usage::

    sinks = open_sinks(("jsonl", "tensorboard"), out, first_step=0)
    for sink in sinks:
        sink.write({"step": 1, "loss": 2.3, "lr": 0.05}, section="train")
    close_sinks(sinks)

A line is a dict with its ``step``; its ``section`` is ``train`` (a ``--log-every`` line) or
``eval`` (an evaluation). Every field a line has reaches every sink, whatever its name (a new
metric needs no change here); the csv and TensorBoard sinks write the numbers, and only the
csv sink writes what is not a number (as text).
"""

from __future__ import annotations

import csv
import io
import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tandem import strict_json
from tandem.errors import UsageError
from tandem.output_files import AppendLog, atomic, write_failure
from tandem.runtime.config import TENSORBOARD_MISSING

TENSORBOARD_DIR = "tensorboard"
"""The folder of ``OUT`` that holds TensorBoard's event files (``tensorboard --logdir``)."""
NOT_SCALARS = ("step", "time_s")
"""Fields that are no TensorBoard scalar: the step is the scalars' ``global_step``, and
TensorBoard records each event's wall time itself."""


class LogSink(Protocol):
    """One place the metrics lines go."""

    name: str
    """Its ``--log-to`` name."""
    path: Path
    """The file or folder it writes (the summary's ``logs`` lists them)."""

    def write(self, fields: dict[str, Any], section: str) -> None:
        """Write one line (``fields`` holds its ``step``)."""

    def close(self) -> None:
        """Write what is buffered and release the file."""


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool, None or text): what TensorBoard plots."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class JsonlSink:
    """``metrics.jsonl``: one strict JSON line per line (a non-finite number is ``null``),
    written whole or not at all; a resumed run appends to it."""

    name = "jsonl"

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.jsonl"
        self._log = AppendLog(self.path)

    def write(self, fields: dict[str, Any], section: str) -> None:
        self._log.write_line(strict_json.dumps(fields))

    def close(self) -> None:
        self._log.close()


class CsvSink:
    """``metrics.csv``: one row per line, in the order written (as ``metrics.jsonl``), under one
    header: ``step``, then every field any line has had, in the order each first appeared.

    Training and evaluation lines share the file; a row leaves the fields its line lacks empty
    (and a None). A float is written as Python writes it (it reads back exactly), a non-finite
    one as ``nan``/``inf``, a list or dict as JSON. A line with a field the header lacks (the
    first evaluation, a metric that starts later) widens it: the file is written again whole,
    with the earlier rows' new cells empty (atomically, once per new field; new fields come in
    the first lines). A resumed run continues the file under its header, which it reads back.
    """

    name = "csv"

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.csv"
        self.columns = _header(self.path)
        self._log = AppendLog(self.path)

    def write(self, fields: dict[str, Any], section: str) -> None:
        new = [key for key in fields if key not in self.columns]
        if new:
            self._widen(sorted(new, key=lambda key: key != "step"))  # step first, else in order
        self._log.write_line(_row([_cell(fields.get(key)) for key in self.columns]))

    def _widen(self, new: list[str]) -> None:
        """Add columns ``new``: the file again, with the new header over the rows so far."""
        rows = list(csv.reader(io.StringIO(self.path.read_text(encoding="utf-8"))))[1:]
        self.columns += new
        self._log.close()
        with atomic(self.path) as tmp:
            tmp.write_text("".join(_row(self.columns) + "\n" + "".join(
                _row(row + [""] * (len(self.columns) - len(row))) + "\n" for row in rows)),
                encoding="utf-8")
        self._log = AppendLog(self.path)

    def close(self) -> None:
        self._log.close()


def _header(path: Path) -> list[str]:
    """The columns of an existing ``metrics.csv`` (none for a new or empty file)."""
    try:
        with path.open(encoding="utf-8", newline="") as file:
            return next(csv.reader(file), [])
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise write_failure(path, exc) from None


def _row(cells: Sequence[str]) -> str:
    """One CSV row without its line end (a cell with a comma, quote or line end is quoted)."""
    text = io.StringIO()
    csv.writer(text, lineterminator="").writerow(cells)
    return text.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):  # numpy's float64 too: written as Python's float
        return repr(float(value)) if math.isfinite(value) else str(float(value))
    if isinstance(value, (dict, list, tuple)):
        return strict_json.dumps(value)
    return json.dumps(value) if isinstance(value, bool) else str(value)


class TensorBoardSink:
    """TensorBoard's event files in ``OUT/tensorboard/`` (``torch.utils.tensorboard``'s
    ``SummaryWriter``): every number of a line as the scalar ``SECTION/FIELD``
    (``train/loss``, ``eval/test_accuracy``) at the line's step. A resumed run writes a new
    event file beside the old ones, and hides the steps after its checkpoint that the run
    before it had logged (the writer's ``purge_step``), which it logs again."""

    name = "tensorboard"

    def __init__(self, out: Path, first_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a worker where the launcher's check did not run (torchrun)
            raise UsageError(TENSORBOARD_MISSING) from None
        self.path = out / TENSORBOARD_DIR
        self._writer = SummaryWriter(log_dir=str(self.path), flush_secs=10,
                                     purge_step=first_step + 1 if first_step else None)

    def write(self, fields: dict[str, Any], section: str) -> None:
        step = fields.get("step")
        for key, value in fields.items():
            if key not in NOT_SCALARS and is_number(value):
                self._writer.add_scalar(f"{section}/{key}", float(value), global_step=step)

    def close(self) -> None:
        self._writer.close()  # flushes


def open_sinks(names: Sequence[str], out: Path, *, first_step: int) -> list[LogSink]:
    """The sinks ``names`` (from :data:`tandem.runtime.config.LOG_SINKS`) writing into ``out``,
    for a run that starts after ``first_step`` steps; if one cannot open, those opened are
    closed."""
    sinks: list[LogSink] = []
    try:
        for name in names:
            sinks.append(JsonlSink(out) if name == "jsonl" else CsvSink(out) if name == "csv"
                         else TensorBoardSink(out, first_step))
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def close_sinks(sinks: Sequence[LogSink]) -> None:
    """Close every sink, even where an earlier one fails to (the first failure is raised)."""
    failure: BaseException | None = None
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # close the others first
            failure = failure or exc
    if failure is not None:
        raise failure
