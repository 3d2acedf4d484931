"""Data as users load it: a ``collate_fn`` that pads sequences of different lengths (from
``tandem.fit`` and from a ``--data`` function), a sampler of the user's, ``DataLoader`` options,
and a collate that fails, named in one line before any worker starts (issue 29)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import (
    BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset,
    WeightedRandomSampler,
)

import tandem
from tandem.data import GlobalBatchSampler, load_data
from tandem.data.user_sampler import SamplerOrder, check_order
from tandem.errors import UsageError
from tandem.runtime.pipeline.shape_header import header_length, read_header, shape_header
from tandem.spec.loader import LoaderOptions
from tandem.split import BATCH, TensorSpec
from tests import padded_data
from tests.conftest import SharedRun, max_abs_diff, run_here

GPT2 = ("--model", "tests.hf_models:gpt2", "--data", "tests.padded_data:sequences",
        "--loss", "tests.padded_data:sequence_loss", "--steps", "4", "--batch-size", "8",
        "--lr", "0.05", "--momentum", "0.9", "--seed", "4")
"""GPT-2 from a config on sequences of 2 to 16 tokens, padded per batch by the data
function's collate; a loss that is a mean over sequences (as tandem weighs batches)."""
LAYOUTS = {
    "dp": ("--strategy", "dp", "--nproc", "2"),
    "pipeline-1f1b": ("--strategy", "pipeline", "--stages", "2", "--schedule", "1f1b",
                      "--microbatches", "2", "--split-points", "transformer.h.1",
                      "--nproc", "2"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_padded_sequences_train_gpt2_as_one_process_does(shared_run: SharedRun,
                                                         layout: str) -> None:
    """Each step's batch is padded to its own length (a data-parallel worker pads its share to
    its own, a pipeline sends every activation's shapes ahead of it), and the weights and the
    test scores equal one process's."""
    pytest.importorskip("transformers")
    train, _, pad = padded_data.sequences()
    sampler = GlobalBatchSampler(len(train), global_batch_size=8, seed=4)
    lengths = {pad([train[i] for i in sampler.global_indices(step).tolist()])[0].shape[1]
               for step in range(4)}
    assert len(lengths) > 1, lengths  # the steps' batches differ in shape
    one, single = shared_run(*GPT2, "--nproc", "1")
    out, summary = shared_run(*GPT2, *LAYOUTS[layout])
    assert max_abs_diff(one / "final.pt", out / "final.pt") <= 1e-5
    assert summary["test_loss"] == pytest.approx(single["test_loss"], abs=1e-5)
    assert summary["test_accuracy"] == pytest.approx(single["test_accuracy"], abs=1e-9)


@pytest.mark.multiprocess
def test_fit_takes_a_collate_a_sampler_and_loader_options_on_two_workers() -> None:
    """``tandem.fit`` with the collate, a sampler (longest sequences first) and ``drop_last``,
    its batches read ahead by a loader process: equal to a plain loop over the sampler's order
    in batches of 16, each epoch's short last batch dropped."""
    torch.manual_seed(0)
    model = padded_data.TokenNet()
    start = copy.deepcopy(model)
    train, test = padded_data.Sequences(40, seed=1), padded_data.Sequences(8, seed=2)
    sampler = padded_data.Longest(train)
    result = tandem.fit(model, train, test, loss=padded_data.sequence_loss,
                        collate_fn=padded_data.pad, sampler=sampler,
                        loader_options={"drop_last": True, "num_workers": 1,
                                        "prefetch_factor": 2},
                        nproc=2, steps=5, batch_size=16, lr=0.5, momentum=0.0, seed=3)
    assert result.summary["loader_workers"] == 1
    order = list(sampler)
    optimizer = torch.optim.SGD(start.parameters(), lr=0.5)
    for step in range(5):  # 40 samples: two batches of 16 an epoch, the last 8 dropped
        first = (step % 2) * 16
        inputs, targets = padded_data.pad([train[i] for i in order[first:first + 16]])
        optimizer.zero_grad()
        padded_data.sequence_loss(start(inputs), targets).backward()
        optimizer.step()
    for key, value in start.state_dict().items():
        assert torch.allclose(model.state_dict()[key], value, atol=1e-5), key


@pytest.mark.multiprocess
def test_gpipe_and_pipedream_with_vertical_sync_take_padded_batches() -> None:
    """A traced model (split before its output layer) on padded batches: GPipe's 4
    micro-batches equal a plain loop; PipeDream, whose activations carry the weight version
    ahead of their shapes, runs every step (asynchronous: its weights differ)."""
    torch.manual_seed(0)
    model = padded_data.TokenNet()
    start = copy.deepcopy(model)
    train, test = padded_data.Sequences(48, seed=1), padded_data.Sequences(8, seed=2)
    common = {"loss": padded_data.sequence_loss, "collate_fn": padded_data.pad, "steps": 6,
              "batch_size": 8, "lr": 0.5, "momentum": 0.0, "seed": 3, "strategy": "pipeline",
              "stages": 2, "nproc": 2, "split_points": "out"}
    tandem.fit(model, train, test, schedule="gpipe", microbatches=4, **common)
    sampler = GlobalBatchSampler(len(train), global_batch_size=8, seed=3)
    optimizer = torch.optim.SGD(start.parameters(), lr=0.5)
    for step in range(6):
        inputs, targets = padded_data.pad([train[i] for i in sampler.global_indices(step)])
        optimizer.zero_grad()
        padded_data.sequence_loss(start(inputs), targets).backward()
        optimizer.step()
    for key, value in start.state_dict().items():
        assert torch.allclose(model.state_dict()[key], value, atol=1e-5), key
    summary = tandem.fit(padded_data.TokenNet, train, test, schedule="pipedream",
                         vertical_sync=True, **common).summary
    assert summary["steps"] == 6 and summary["vertical_sync"]


@pytest.mark.pure
def test_a_collate_that_raises_is_one_line_before_launch() -> None:
    with pytest.raises(UsageError) as error:
        tandem.fit(padded_data.TokenNet(), padded_data.Sequences(32, seed=1),
                   collate_fn=padded_data.broken_pad, steps=2, batch_size=8)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("collate_fn tests.padded_data:broken_pad fails on 8 items of the "
                              "training data"), message
    assert "RuntimeError: stack expects each tensor to be equal size" in message
    assert message.endswith("fix it: it gets a list of the dataset's items and returns "
                            "(inputs, targets)")


@pytest.mark.multiprocess
def test_a_data_functions_collate_that_raises_is_one_line_and_status_2() -> None:
    """``tandem train --data`` whose function returns a collate that fails: one line, exit 2,
    before any worker starts (its forkserver aside)."""
    result = run_here("train", "--model", "tests.padded_data:TokenNet", "--data",
                      "tests.padded_data:broken_sequences", "--steps", "2", "--batch-size",
                      "4", "--nproc", "2", "--no-progress")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert ("collate_fn tests.padded_data:broken_pad fails on 4 items of the training data"
            in lines[0]), lines[0]


@pytest.mark.pure
def test_a_data_function_returns_its_collate_in_any_of_its_forms() -> None:
    data = load_data("tests.padded_data:sequences:n=12")
    assert data.train.collate is padded_data.pad and data.test.collate is padded_data.pad
    batch = data.train.take(torch.tensor([0, 1, 2]))
    lengths = [len(data.train.dataset[i]) - 1 for i in range(3)]
    assert batch.size == 3 and batch.inputs.shape == (3, max(lengths))
    assert (batch.targets == -100).sum() == sum(max(lengths) - n for n in lengths)
    assert load_data("tests.padded_data:broken_sequences").train.collate is \
        padded_data.broken_pad


@pytest.mark.pure
def test_a_dataloader_or_data_tandem_batches_itself_is_refused_with_a_collate() -> None:
    pairs = TensorDataset(torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(UsageError, match="is a DataLoader; tandem makes the batches itself"):
        tandem.fit(padded_data.TokenNet(), DataLoader(pairs, batch_size=2), steps=1)
    with pytest.raises(UsageError, match="collate_fn= with data=; give the datasets"):
        tandem.fit("mlp", data="digits", collate_fn=padded_data.pad, steps=1)
    with pytest.raises(UsageError, match="returned a float32 tensor of shape \\(2, 2\\) for 2 "
                                         "items"):
        tandem.fit(padded_data.TokenNet(), pairs, collate_fn=_one_tensor, steps=1,
                   batch_size=2)
    with pytest.raises(UsageError, match="every tensor needs one row per item"):
        tandem.fit(padded_data.TokenNet(), pairs, collate_fn=_rows_lost, steps=1,
                   batch_size=2)


def _one_tensor(items: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    return torch.stack([x for x, _ in items])


def _rows_lost(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    inputs = torch.stack([x for x, _ in items]).sum().reshape(1)
    return inputs, torch.stack([y for _, y in items])


@pytest.mark.pure
def test_a_sampler_orders_each_epoch_the_same_way_whenever_asked() -> None:
    """A ``WeightedRandomSampler`` without a generator draws from torch's random state, which
    tandem seeds by the run's seed and the epoch: every worker and a resumed run get the same
    order, another epoch another one; tandem batches it and shards each batch."""
    weights = torch.tensor([0.0, 1.0, 1.0, 8.0, 1.0, 1.0])
    order = SamplerOrder(WeightedRandomSampler(weights, 12), seed=7, num_items=6)
    check_order(order)
    first = order(0)
    assert order.length == 12 and len(first) == 12 and 0 not in first.tolist()
    torch.manual_seed(123)  # the caller's random state does not matter
    assert torch.equal(order(0), first) and not torch.equal(order(1), first)
    batches = GlobalBatchSampler(order.length, global_batch_size=5, seed=7, order=order)
    assert torch.equal(batches.global_indices(1), first[5:10])
    assert torch.equal(batches.local_indices(1, rank=1, world_size=2), first[8:10])
    assert torch.equal(batches.global_indices(3), order(1)[:5])  # epoch 1: 5, 5, then 2


@pytest.mark.pure
def test_a_sampler_tandem_cannot_repeat_or_use_is_one_line() -> None:
    own = torch.Generator().manual_seed(0)
    with pytest.raises(UsageError, match="another order when asked again for epoch 0"):
        check_order(SamplerOrder(WeightedRandomSampler([1.0] * 6, 6, generator=own), seed=0,
                                 num_items=6))
    pairs = TensorDataset(torch.zeros(6, 2))
    refused = {
        "splits every batch over the workers itself": DistributedSampler(pairs, num_replicas=2,
                                                                         rank=0),
        "which yields batches": BatchSampler(SequentialSampler(pairs), 2, drop_last=False),
        "not an iterable of dataset indices": 3,
    }
    for message, sampler in refused.items():
        with pytest.raises(UsageError, match=message):
            SamplerOrder(sampler, seed=0, num_items=6)
    with pytest.raises(UsageError, match="gave index 9, outside the 6 samples"):
        SamplerOrder([0, 9], seed=0, num_items=6)(0)
    with pytest.raises(UsageError, match="yields float values"):
        SamplerOrder([0.5], seed=0, num_items=6)(0)
    with pytest.raises(UsageError, match="shuffle=False conflicts with sampler"):
        tandem.fit(padded_data.TokenNet(), padded_data.Sequences(8, seed=1),
                   collate_fn=padded_data.pad, sampler=[0, 1, 2, 3, 4, 5, 6, 7],
                   loader_options={"shuffle": False}, steps=1, batch_size=4)


@pytest.mark.pure
def test_dataloader_options_apply_or_are_refused_in_one_line() -> None:
    options = LoaderOptions.parse({"shuffle": False, "drop_last": True, "prefetch_factor": 2})
    assert (options.shuffle, options.drop_last, options.prefetch) == (False, True, 2)
    assert LoaderOptions.parse(None).prefetch == 4
    refused = {
        "persistent_workers": (True, "does not apply: tandem's loader processes already live"),
        "batch_size": (32, "does not apply: give batch_size= \\(the global batch"),
        "pin_memory": ("yes", "pin_memory='yes' must be True or False"),
        "prefetch_factor": (0, "prefetch_factor=0 must be a whole number of batches"),
        "shuffel": (True, "unknown loader option 'shuffel'; tandem takes drop_last, "
                          "pin_memory, prefetch_factor, shuffle"),
    }
    for key, (value, message) in refused.items():
        with pytest.raises(UsageError, match=message):
            LoaderOptions.parse({key: value})
    data = padded_data.Sequences(8, seed=1)
    fits = {
        "prefetch_factor=2 tunes the loader processes that read batches ahead, and this run "
        "has none": {"prefetch_factor": 2},
        "pin_memory=True pins batches for their copy to a GPU, and this run's workers train "
        "on the CPU": {"pin_memory": True, "num_workers": 1},
        "drop_last drops each epoch's short last batch, which needs one batch size":
            {"drop_last": True, "batch_schedule": "4@0,8@2"},
        "loader_workers=2 and loader option num_workers=1; give one of them":
            {"num_workers": 1, "loader_workers": 2},
    }
    for message, given in fits.items():
        loader = {k: v for k, v in given.items() if k not in ("batch_schedule", "loader_workers")}
        rest = {k: v for k, v in given.items() if k in ("batch_schedule", "loader_workers")}
        with pytest.raises(UsageError, match=message.replace("(", "\\(")):
            tandem.fit(padded_data.TokenNet(), data, collate_fn=padded_data.pad,
                       loader_options=loader, steps=3, batch_size=4, backend="gloo", **rest)


@pytest.mark.pure
def test_a_shape_header_gives_the_receiver_each_tensors_shape() -> None:
    specs = (TensorSpec(shape=(BATCH, 1, BATCH, BATCH), dtype=torch.bool, requires_grad=False),
             TensorSpec(shape=(BATCH, 16, 32), dtype=torch.float32, requires_grad=True),
             TensorSpec(shape=(), dtype=torch.float32, requires_grad=True))
    tensors = [torch.zeros(3, 1, 7, 7, dtype=torch.bool), torch.zeros(3, 7, 32), torch.zeros(())]
    header = shape_header(tensors, None)
    assert header.tolist() == [3, 1, 7, 7, 3, 7, 32] and header_length(specs) == 7
    assert read_header(header, specs) == ((3, 1, 7, 7), (3, 7, 32), ())
    assert header_length(specs[2:]) == 1 and shape_header(tensors[2:], None).tolist() == [0]
