"""What a model needs to know about its data: task, input shape and number of classes."""

from __future__ import annotations

import dataclasses
import operator
from typing import Literal, get_args

from tandem.errors import UsageError

Task = Literal["classify", "lm"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DataInfo:
    """Shape of one sample and the prediction target of a dataset."""

    task: Task
    """``classify``: one label per sample; ``lm``: next-token prediction at every position."""
    input_shape: tuple[int, ...]
    """Shape of one input sample (without the batch dimension)."""
    num_classes: int
    """Number of labels (``classify``) or vocabulary size (``lm``)."""

    def __post_init__(self) -> None:
        if self.task not in get_args(Task):
            raise UsageError(f"DataInfo task {self.task!r} is not one of "
                             f"{', '.join(get_args(Task))}")
        if isinstance(self.input_shape, list):  # as JSON gives it
            object.__setattr__(self, "input_shape", tuple(self.input_shape))
        if not isinstance(self.input_shape, tuple) or not all(
                _whole(size) and size > 0 for size in self.input_shape):
            raise UsageError(f"DataInfo input_shape {self.input_shape!r} is not a tuple of sizes "
                             f"of at least 1 (one sample's shape, e.g. (1, 28, 28))")
        if not _whole(self.num_classes) or self.num_classes < 1:
            raise UsageError(f"DataInfo num_classes {self.num_classes!r} must be a whole number "
                             f"of at least 1 (labels, or the vocabulary size)")


def _whole(value: object) -> bool:
    """An integer of any kind (numpy's too), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
