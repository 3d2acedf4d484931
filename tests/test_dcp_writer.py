"""tandem's DCP writer (``write_shards``): one file per rank for CPU tensors, one file per tensor
where tensors are off the CPU (so that host memory holds one tensor's copy at a time), and both
layouts read back by DCP on any world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.runtime.sharded_checkpoint import one_file_per_tensor
from tests.distributed import run_distributed

@pytest.mark.pure
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


@pytest.mark.multiprocess
@pytest.mark.parametrize("per_tensor", [False, True])
def test_both_layouts_read_back_on_another_world(tmp_path: Path, per_tensor: bool) -> None:
    folder = str(tmp_path / "checkpoint-1.dcp")
    files = run_distributed(_write, 2, folder, per_tensor, timeout_s=60)
    # one rank also writes the whole tensor "c" (DCP keeps one copy of what ranks hold alike)
    assert sorted(files) == ([2, 3] if per_tensor else [1, 1])
    expected = [*range(8), *range(12), 5.0, 5.0]
    assert run_distributed(_read, 1, folder, timeout_s=60) == [expected]


def _lamb_round_trip(rank: int, world: int, folder: str) -> list[int]:
    """LAMB on a layer saved and loaded as a tensor-parallel ``heads`` layer is (the model's
    order, :class:`NaturalRows`): its ``step`` counts, a Python int, come back."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    from tandem.runtime.natural_rows import load_planner
    from tandem.runtime.optimizers import Lamb
    from tandem.runtime.sharded_checkpoint import write_shards
    from tandem.runtime.tensor_checkpoint import dcp_state

    orders: dict[str, int | dict[str, int]] = {"weight": 2, "bias": 2}
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    optimizer = Lamb(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
    write_shards(dcp_state(model, optimizer, [], None, orders)[0], Path(folder))
    again = nn.Linear(4, 6)
    fresh = Lamb(again.parameters(), lr=0.1)
    state, model_state, optimizer_state = dcp_state(again, fresh, [], None, orders)
    load(state, checkpoint_id=folder, planner=load_planner())
    set_state_dict(again, fresh, model_state_dict=model_state, optim_state_dict=optimizer_state)
    assert torch.equal(again.weight, model.weight)
    return [int(fresh.state[p]["step"]) for p in again.parameters()]


@pytest.mark.multiprocess
def test_an_optimizers_scalar_state_comes_back_through_the_models_order(tmp_path: Path) -> None:
    steps = run_distributed(_lamb_round_trip, 1, str(tmp_path / "checkpoint-5.dcp"),
                            timeout_s=60)
    assert steps == [[5, 5]]


@pytest.mark.pure
def test_copy_from_whole_copies_scalars_and_refuses_other_sizes() -> None:
    from tandem.errors import UsageError
    from tandem.runtime.natural_rows import NaturalRows, copy_from_whole

    held = {"w": {"exp_avg": NaturalRows(torch.zeros(6, 2), 2), "step": 1}, "b": torch.zeros(2)}
    whole = {"w": {"exp_avg": torch.arange(12.0).reshape(6, 2), "step": 5}, "b": torch.ones(2)}
    copy_from_whole(held, whole, "optimizer")
    assert held["w"]["step"] == 5 and torch.equal(held["b"], torch.ones(2))
    rows = held["w"]["exp_avg"]
    assert isinstance(rows, NaturalRows)
    for offsets, view in rows.chunks.items():
        assert torch.equal(view, whole["w"]["exp_avg"][offsets[0]:offsets[0] + len(view)])
    with pytest.raises(UsageError, match=r"the checkpoint's optimizer.b is \(1,\), and this "
                                         r"run's is \(2,\)"):
        copy_from_whole(held, {"b": torch.ones(1)}, "optimizer")


@pytest.mark.pure
def test_a_channels_share_is_one_chunk_at_its_place_in_the_layer() -> None:
    """Tensor rank 2 of 4 holds rows 6-8 of a 12-row convolution: one chunk at row 6, a view of
    its own tensor (written and read in place); copied from the whole layer, those rows."""
    from tandem.runtime.natural_rows import NaturalRows, copy_from_whole

    share = torch.zeros(3, 2, 1, 1)
    rows = NaturalRows.row_share(share, 2, 4)
    assert rows.size() == torch.Size((12, 2, 1, 1))
    assert list(rows.chunks) == [torch.Size((6, 0, 0, 0))]
    assert rows.chunks[torch.Size((6, 0, 0, 0))].data_ptr() == share.data_ptr()
    whole = torch.arange(24.0).reshape(12, 2, 1, 1)
    copy_from_whole({"w": rows}, {"w": whole})
    assert torch.equal(share, whole[6:9])
    assert NaturalRows.row_share(torch.zeros(0, 2), 1, 2).chunks == {}  # an empty FSDP shard
