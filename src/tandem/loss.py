"""The training loss: cross-entropy on the model's logits by default, or a user's function.

A loss is any callable ``loss(output, targets)`` that returns a scalar tensor, the **mean** over
the samples of the batch it is given (the convention of ``torch.nn.CrossEntropyLoss``). tandem
weights each batch's loss by its samples, so a global batch split over any number of workers
and micro-batches gives the same update as one process. ``output`` is whatever the model
returns (a tensor, a tuple, a dict, a Hugging Face ``ModelOutput``); ``targets`` whatever the
data gives.

Usage::

    loss_fn = load_loss("mypkg.losses:smooth_ce")      # or None: cross_entropy
    value = checked_loss(loss_fn, model(x), y, name="mypkg.losses:smooth_ce")
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn import functional as F

from tandem import structures
from tandem.errors import UsageError
from tandem.spec.options import user_function

LossFn = Callable[[Any, Any], torch.Tensor]
DEFAULT_LOSS = "cross_entropy"
IGNORED = -100
"""The target of a position that is no prediction (padding): ``F.cross_entropy``'s
``ignore_index``, which the default loss skips too."""


def cross_entropy(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits in ``output`` (:func:`tandem.structures.logits_of`)
    against class indices: one per sample, or one per position (a language model)."""
    logits = structures.logits_of(output)
    if logits is None:
        raise UsageError(f"the model returns {structures.describe(output)}, with no logits for "
                         f"the default loss (cross-entropy); return a logits tensor or give "
                         f"--loss package.module:function")
    if logits.dim() != 2 or targets.dim() != 1:  # per position: flatten (else no view)
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    return F.cross_entropy(logits.float(), targets)


def load_loss(spec: str | None) -> LossFn:
    """The loss named ``package.module:function`` (None or ``cross_entropy``: the default)."""
    if spec is None or spec == DEFAULT_LOSS:
        return cross_entropy
    if ":" not in spec or spec.count(":") > 1:
        raise UsageError(f"--loss {spec!r} is not package.module:function; e.g. "
                         f"--loss mypkg.losses:my_loss, or leave it out for cross-entropy")
    function, _ = user_function(spec, what="--loss")
    return function


def loss_name(loss: LossFn | str | None) -> str:
    """How a run's summary and messages name its loss."""
    if loss is None:
        return DEFAULT_LOSS
    if isinstance(loss, str):
        return loss
    module = getattr(loss, "__module__", None)
    name = getattr(loss, "__qualname__", type(loss).__name__)
    return f"{module}:{name}" if module and module != "tandem.loss" else name


def checked_loss(loss_fn: LossFn, output: Any, targets: Any, *, name: str) -> torch.Tensor:
    """``loss_fn(output, targets)``, refused (one line) unless it is a scalar (0-dimensional)
    float tensor: a loss per sample, even of one sample, is refused."""
    try:
        value = loss_fn(output, targets)
    except UsageError:
        raise
    except Exception as exc:  # the user's loss failed on the model's output: say where
        lines = str(exc).strip().splitlines()
        raise UsageError(f"--loss {name} fails on the model's output ({structures.describe(output)})"
                         f" and targets ({structures.describe(targets)}): {type(exc).__name__}: "
                         f"{lines[0] if lines else ''}") from None
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.is_floating_point():
        raise UsageError(f"--loss {name} returned {structures.describe(value)}; it must return "
                         f"a scalar float tensor, the mean loss over the batch (e.g. "
                         f"F.cross_entropy(logits, y) or loss.mean())")
    return value


def score_batch(output: Any, targets: Any, loss_fn: LossFn, size: int) -> torch.Tensor:
    """``[correct, predictions, summed loss, samples]`` of one evaluated batch, in float64.

    Accuracy counts where the output has logits whose argmax can be compared with integer
    targets of the logits' leading shape; otherwise ``correct`` and ``predictions`` are 0 and
    the run reports no accuracy. A target of ``IGNORED`` (-100, cross-entropy's
    ``ignore_index``: padding) is no prediction.
    """
    loss = loss_fn(output, targets).detach().double() * size
    logits = structures.logits_of(output)
    correct = predictions = 0.0
    if (logits is not None and isinstance(targets, torch.Tensor)
            and not targets.is_floating_point() and logits.dim() >= 1
            and tuple(logits.shape[:-1]) == tuple(targets.shape)):
        counted = targets != IGNORED
        correct = float(((logits.argmax(-1) == targets) & counted).sum())
        predictions = float(counted.sum())
    device = loss.device
    return torch.stack([torch.tensor(correct, dtype=torch.float64, device=device),
                        torch.tensor(predictions, dtype=torch.float64, device=device),
                        loss, torch.tensor(float(size), dtype=torch.float64, device=device)])


def evaluation(totals: torch.Tensor) -> dict[str, float | None]:
    """``test_accuracy`` (None when the model's output has no comparable logits) and
    ``test_loss`` (mean per sample) from summed :func:`score_batch` totals."""
    correct, predictions, loss, samples = totals.tolist()
    return {"test_accuracy": correct / predictions if predictions else None,
            "test_loss": loss / samples if samples else float("nan")}
