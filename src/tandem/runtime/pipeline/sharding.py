"""A pipeline stage sharded over its replicas: FSDP2 on the ``data`` dimension of the job's mesh.

Usage::

    shards = StageShards(stage, mesh, level=2, ties=ties)  # after any tensor split
    ...                            # the step's backwards: gradients accumulate, unreduced
    sent = shards.reduce(forwards=2)   # the stage's AR: reduce-scatter over the replicas

The ``D`` replicas of a stage (``--strategy pipeline --shard D``) each hold ``1 / D`` of its
state: FSDP2's ``fully_shard`` over the ``data`` dimension of the ``data x pipeline x tensor``
mesh, restricted to the stage and tensor position, on each of the stage's blocks and then on
the stage (:func:`tandem.sync.sharded.shard_model`); with tensor parallelism it shards each
worker's DTensor shares, 2-D parameters as torchtitan lays them out.

A stage runs several backwards per step, one per micro-batch, and reduces once, as
``torch.distributed.pipelining``'s stages do with FSDP2: every backward runs with gradient
sync off, as not the step's last backward and without resharding after it (each unit's
unsharded gradients accumulate; its parameters stay gathered until the reduce, at level 3 until
its next forward frees them), and the stage's ``AR`` action then runs FSDP2's post-backward of
every unit by hand, its reduce-scatter among them, and the root's final callback (as
``PipelineStage.perform_reduce_grad`` does). FSDP2 averages
over the replicas, and the stage's loss is ``D`` times the global batch's share
(:attr:`StageShards.loss_factor`), so each shard ends with the global batch's gradient.

Parameters tied between stages (a Hugging Face GPT-2's input and output embeddings) are summed
over the tied stages' workers at the same replica, each holding the same shard of the tie
(:func:`tandem.runtime.pipeline.groups.tied_groups` builds those groups).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any, cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tandem.runtime.pipeline.update import Tie
from tandem.runtime.tensor_parallel import local_tensor
from tandem.sync.sharded import check_units, shard_model


class StageShards:
    """FSDP2 on one stage over its replicas (see the module docstring)."""

    def __init__(self, module: nn.Module, layout: DeviceMesh, *, level: int,
                 ties: Sequence[Tie] = ()) -> None:
        self.module, self.layout, self.level = module, layout, level
        self.mesh = layout["data"]
        """The stage's replicas at this worker's tensor position: the ``data`` dimension of
        the job's ``layout`` mesh restricted to them."""
        self.degree = self.mesh.size()
        """The stage's replicas, which shard it."""
        self.whole_bytes = sum(local_tensor(p).numel() * p.element_size()
                               for p in module.parameters())
        """The stage's parameter bytes before sharding (this worker's tensor shares)."""
        names = {id(p): name for name, p in module.named_parameters()}
        held = [[names[id(p)] for p in tie.params] for tie in ties]
        # the pipeline writes nothing into a stage's output in place (it sends it detached or
        # runs the backward from it), which is what FSDP2 warns of when that output is a view
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a "
                                r"view tensor", category=UserWarning)
        shard_model(module, self.mesh, units=check_units(module, None), level=level,
                    param_dtype=None)
        params = dict(module.named_parameters())
        self.ties = [dataclasses.replace(tie, params=[params[name] for name in tied])
                     for tie, tied in zip(ties, held)]
        """``ties`` with the sharded parameters (FSDP2 replaces every parameter)."""
        self._accumulate()

    @property
    def loss_factor(self) -> float:
        """What the stage's loss is multiplied by: FSDP2's reduce-scatter averages the
        replicas' gradients, where the pipeline's allreduce summed them."""
        return float(self.degree)

    def _accumulate(self, sync: bool = False) -> None:
        """Gradient sync, the last backward and resharding after a backward: all off while the
        step's backwards accumulate, on for the reduce."""
        fsdp = cast(Any, self.module)  # an FSDPModule once sharded
        fsdp.set_requires_gradient_sync(sync)
        fsdp.set_is_last_backward(sync)
        fsdp.set_reshard_after_backward(sync)

    def reduce(self, forwards: int) -> float:
        """Reduce-scatter the gradients the step's backwards accumulated (each unit's, FSDP2's
        post-backward run by hand as ``PipelineStage.perform_reduce_grad`` does) and start the
        next step's accumulation; returns the bytes this worker sent in the step's
        ``forwards`` forwards and this reduce (ring collectives, estimated)."""
        from torch.distributed.fsdp import fully_shard

        self._accumulate(sync=True)
        state = fully_shard.state(self.module)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:  # noqa: SLF001 - as torch's own stages do
            for group in each._fsdp_param_groups:  # noqa: SLF001
                group.post_backward()
        state._root_post_backward_final_callback()  # noqa: SLF001
        self._accumulate()
        gathers = forwards * (2 if self.level == 3 else 1) + 1  # + the reduce-scatter
        return gathers * self.whole_bytes * (self.degree - 1) / self.degree

    def reshard(self) -> None:
        """Free the parameters an evaluation's forwards gathered (level 2 keeps them until a
        backward, which an evaluation does not run)."""
        if self.level == 2:
            from torch.distributed.fsdp import FSDPModule

            for sub in self.module.modules():
                if isinstance(sub, FSDPModule):
                    sub.reshard()

