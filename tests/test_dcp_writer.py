"""tandem's DCP writer (``write_shards``): one file per rank for CPU tensors, one file per tensor
where tensors are off the CPU (so that host memory holds one tensor's copy at a time), and both
layouts read back by DCP on any world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.runtime.sharded_checkpoint import one_file_per_tensor
from tests.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


def test_tensors_off_the_cpu_are_written_one_file_each() -> None:
    on_cpu = {"model": {"w": torch.ones(3)}, "optimizer": {"state": {0: {"step": 1.0}}}}
    assert not one_file_per_tensor(on_cpu)
    off_cpu = {"model": {"w": torch.ones(3), "v": torch.empty(3, device="meta")}}
    assert one_file_per_tensor(off_cpu)
    assert one_file_per_tensor({"optimizer": {"state": {0: [torch.empty(2, device="meta")]}}})


def _write(rank: int, world: int, folder: str, per_tensor: bool) -> int:
    """Write two tensors sharded over the ranks (and one whole) with ``write_shards``, the
    layout forced; return the files this rank wrote."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tandem.runtime import sharded_checkpoint

    mesh = init_device_mesh("cpu", (world,))
    state = {"a": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)]),
             "c": torch.full((2,), 5.0)}
    sharded_checkpoint.one_file_per_tensor = lambda _state: per_tensor  # type: ignore[assignment]
    sharded_checkpoint.write_shards(state, Path(folder))
    return sum(1 for path in Path(folder).glob(f"__{rank}_*.distcp"))


def _read(rank: int, world: int, folder: str) -> list[float]:
    """Read the folder's tensors whole on each rank of another world."""
    from torch.distributed.checkpoint.state_dict_loader import load

    state = {"a": torch.zeros(8), "b": torch.zeros(4, 3), "c": torch.zeros(2)}
    load(state, checkpoint_id=folder)
    return [*state["a"].tolist(), *state["b"].flatten().tolist(), *state["c"].tolist()]


@pytest.mark.parametrize("per_tensor", [False, True])
def test_both_layouts_read_back_on_another_world(tmp_path: Path, per_tensor: bool) -> None:
    folder = str(tmp_path / "checkpoint-1.dcp")
    files = run_distributed(_write, 2, folder, per_tensor, timeout_s=60)
    # one rank also writes the whole tensor "c" (DCP keeps one copy of what ranks hold alike)
    assert sorted(files) == ([2, 3] if per_tensor else [1, 1])
    expected = [*range(8), *range(12), 5.0, 5.0]
    assert run_distributed(_read, 1, folder, timeout_s=60) == [expected]
