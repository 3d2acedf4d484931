"""Any traceable ``nn.Module`` as an ``nn.Sequential`` of blocks, for pipelines and profiles.

Usage::

    from tandem.split import split_model
    blocks = split_model(model, example_inputs)     # cuts between modules, automatically
    blocks = split_model(model, example_inputs, split_points=["transformer.h.1"])
    output = blocks(inputs)                          # the model's output, same gradients
    blocks.boundaries[0]                             # what block 0 passes to block 1
    blocks.model_state_dict()                        # under the model's own names

The model is traced with ``torch.export`` (batch dimension dynamic, and with ``vary=True`` the
inputs' other sizes too, for batches padded to their longest sample; training and evaluation
mode); each block is a stretch of the trace that takes the tuple of tensors live at its start
and returns the tuple live at its end, so a skip connection carries several tensors across a
cut. Parameters and buffers keep the model's names; a parameter used by two blocks (tied
weights) is the same ``nn.Parameter`` in both.
"""

from tandem.split.block import Block
from tandem.split.model import MAX_BLOCKS, SplitModel, split_model
from tandem.split.spec import BATCH, TensorSpec

__all__ = ["BATCH", "MAX_BLOCKS", "Block", "SplitModel", "TensorSpec", "split_model"]
