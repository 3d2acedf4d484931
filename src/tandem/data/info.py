"""What a model needs to know about its data: task, input shape and number of classes."""

from __future__ import annotations

import dataclasses
from typing import Literal

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
