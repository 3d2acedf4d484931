"""Shards (``tandem pack``, ``--data shards:DIR``): the format against the WebDataset reader,
the order of an epoch as properties (every sample once, equal shares, each rank its own
shards), the storage emulator and cache, and training on shards against training in memory."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.data import load_data
from tandem.data.loader import PlannedLoader
from tandem.data.pack import pack
from tandem.data.shards import ShardBatchSampler, load_shards
from tandem.data.storage import CachedStorage, EmulatedStorage, Storage
from tandem.errors import UsageError
from tests.conftest import max_abs_diff, run_here, run_json
from tests.test_your_data import _write_digit_pngs


@pytest.fixture(scope="module")
def digit_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits packed into shards of about 40 KB (19 samples), so a run crosses many."""
    out = tmp_path_factory.mktemp("shards") / "digits"
    pack("digits", out, shard_size=40_000)
    return out


# -- the format --------------------------------------------------------------------------------

@pytest.mark.pure
def test_packed_digits_read_back_equal_to_the_in_memory_digits(digit_shards: Path) -> None:
    shards, memory = load_shards(f"shards:{digit_shards}"), load_data("digits")
    assert shards.info == memory.info
    for split in ("train", "test"):
        ours, theirs = getattr(shards, split), getattr(memory, split)
        batch = ours.take(torch.arange(len(ours)))
        assert torch.equal(batch.inputs, theirs.inputs)
        assert torch.equal(batch.targets, theirs.targets)
    index = json.loads((digit_shards / "index.json").read_text())
    sizes = [entry["samples"] for entry in index["splits"]["train"]]
    assert sum(sizes) == len(memory.train) and len(sizes) > 20


@pytest.mark.pure
def test_the_webdataset_reader_reads_our_shards(digit_shards: Path) -> None:
    webdataset = pytest.importorskip("webdataset")
    memory = load_data("digits").train
    urls = sorted(str(p) for p in digit_shards.glob("train-*.tar"))
    samples = list(webdataset.WebDataset(urls, shardshuffle=False).decode())
    assert len(samples) == len(memory)
    for number, sample in enumerate(samples[:50]):
        assert sample["__key__"] == f"{number:09d}"
        assert np.array_equal(sample["input.npy"], memory.inputs[number].numpy())
        assert int(sample["cls"]) == int(memory.targets[number])


@pytest.mark.pure
def test_an_image_folder_packs_its_files_and_decodes_as_folder_does(tmp_path: Path) -> None:
    _write_digit_pngs(tmp_path / "pngs")
    out = tmp_path / "shards"
    result = pack(str(tmp_path / "pngs"), out, shard_size=200_000)
    assert result.source == f"folder:{tmp_path / 'pngs'}"
    assert result.samples == {"train": 1438, "test": 359}
    members = __import__("tarfile").open(out / "train-000000.tar").getnames()
    assert members[:2] == ["000000000.png", "000000000.cls"]
    shards, folder = load_shards(f"shards:{out}"), load_data(f"folder:{tmp_path / 'pngs'}")
    assert shards.info == folder.info
    for split in ("train", "test"):
        batch = getattr(shards, split).take(torch.arange(len(getattr(folder, split))))
        assert torch.equal(batch.inputs, getattr(folder, split).inputs)
        assert torch.equal(batch.targets, getattr(folder, split).targets)


@pytest.mark.pure
def test_structured_samples_pack_as_pth_and_read_back(tmp_path: Path) -> None:
    pack("tests.user_data:digit_dicts", tmp_path / "dicts", shard_size=1 << 20)
    shards = load_shards(f"shards:{tmp_path / 'dicts'}")
    memory = load_data("tests.user_data:digit_dicts")
    rows = torch.tensor([0, 5, 77, 3])
    ours, theirs = shards.train.take(rows), memory.train.take(rows)
    assert ours.inputs.keys() == theirs.inputs.keys()
    for key in ours.inputs:
        assert torch.equal(ours.inputs[key], theirs.inputs[key])
    assert torch.equal(ours.targets, theirs.targets)


# -- the order of an epoch -----------------------------------------------------------------------

@pytest.mark.pure
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [7, 64])
def test_every_sample_once_per_epoch_with_equal_shares_from_unequal_shards(
        ranks: int, batch: int) -> None:
    shard_samples = [13, 1, 40, 7, 29, 2, 55, 11]  # 158 samples, shards of unequal sizes
    sampler = ShardBatchSampler(shard_samples, global_batch_size=batch, seed=3,
                                partitions=ranks, shuffle_buffer=10)
    starts = np.cumsum([0] + shard_samples)
    for epoch in range(3):
        seen: list[int] = []
        for step in range(epoch * sampler.batches_per_epoch,
                          (epoch + 1) * sampler.batches_per_epoch):
            shares = [sampler.local_indices(step, rank=r, world_size=ranks).tolist()
                      for r in range(ranks)]
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            assert sum(map(len, shares)) == len(sampler.global_indices(step))
            seen += [i for share in shares for i in share]
        assert sorted(seen) == list(range(sum(shard_samples)))
        # each rank reads one contiguous run of the epoch's shard order: at most two shards
        # only in part, and no shard read by a rank that another reads whole
        owners: dict[int, set[int]] = {}
        for rank in range(ranks):
            stream = sampler.partition_stream(epoch, rank)
            for shard in set(np.searchsorted(starts, stream, side="right") - 1):
                owners.setdefault(int(shard), set()).add(rank)
        assert sum(len(o) > 1 for o in owners.values()) <= ranks - 1


@pytest.mark.pure
def test_the_order_depends_on_seed_and_epoch_only_and_the_buffer_shuffles() -> None:
    def order(seed: int, epoch: int, buffer: int) -> list[int]:
        sampler = ShardBatchSampler([30] * 10, global_batch_size=32, seed=seed, partitions=2,
                                    shuffle_buffer=buffer)
        return sampler.epoch_order(epoch).tolist()

    assert order(1, 0, 50) == order(1, 0, 50)
    assert order(1, 0, 50) != order(1, 1, 50) != order(2, 1, 50)
    in_shard_order = ShardBatchSampler([30] * 10, global_batch_size=300, seed=1, partitions=1,
                                       shuffle_buffer=1).partition_stream(0, 0)
    runs = np.diff(in_shard_order)
    assert (runs == 1).sum() == 300 - 10  # whole shards, one after another
    shuffled = ShardBatchSampler([30] * 10, global_batch_size=300, seed=1, partitions=1,
                                 shuffle_buffer=50).partition_stream(0, 0)
    assert (np.diff(shuffled) == 1).sum() < 30


@pytest.mark.pure
def test_fewer_shards_than_ranks_split_by_samples() -> None:
    sampler = ShardBatchSampler([100], global_batch_size=8, seed=0, partitions=4,
                                shuffle_buffer=5)
    streams = [sampler.partition_stream(0, rank) for rank in range(4)]
    assert [len(s) for s in streams] == [25] * 4
    assert sorted(np.concatenate(streams).tolist()) == list(range(100))


@pytest.mark.pure
def test_each_rank_opens_only_the_shards_of_its_range(digit_shards: Path) -> None:
    data = load_shards(f"shards:{digit_shards}")
    sampler = data.train.batch_sampler(global_batch_size=64, seed=0, partitions=4)
    starts = np.array(data.train.starts)
    for rank in range(4):
        samples = data.train.to(torch.device("cpu"))
        for step in range(sampler.batches_per_epoch):
            samples.take(sampler.local_indices(step, rank=rank, world_size=4))
        own = set(np.searchsorted(starts, sampler.partition_stream(0, rank), side="right") - 1)
        assert samples.opens == len(own) < len(data.train.shards) / 2


@pytest.mark.multiprocess
def test_the_loader_hands_over_the_planned_batches_in_order(digit_shards: Path) -> None:
    data = load_shards(f"shards:{digit_shards}")
    sampler = data.train.batch_sampler(global_batch_size=32, seed=0, partitions=2)
    plan = [sampler.local_indices(step, rank=1, world_size=2) for step in range(12)]
    loader = PlannedLoader(data.train, plan, workers=2)
    for step, indices in enumerate(plan):
        if step == 5:  # a batch skipped (a server moved the worker on) is dropped
            continue
        batch = loader.take(indices)
        assert batch is not None
        assert torch.equal(batch.inputs, data.train.take(indices).inputs)
    assert loader.take(plan[0]) is None  # out of turn: the caller reads it itself
    loader.close()


# -- storage --------------------------------------------------------------------------------------

@pytest.mark.pure
def test_the_emulator_charges_each_open_and_caps_the_bandwidth(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 2_000_000)
    storage = EmulatedStorage(open_latency_s=0.05, bandwidth_Bps=20e6)
    start = time.perf_counter()
    handle = storage.open(path)
    opened = time.perf_counter()
    assert len(handle.read()) == 2_000_000
    done = time.perf_counter()
    handle.close()
    assert opened - start >= 0.05
    assert done - opened >= 0.1  # 2 MB at 20 MB/s


@pytest.mark.pure
def test_the_cache_copies_a_shard_once_and_reads_it_locally(tmp_path: Path) -> None:
    source = tmp_path / "remote" / "a.tar"
    source.parent.mkdir()
    source.write_bytes(bytes(range(256)) * 100)
    slow = EmulatedStorage(open_latency_s=0.2)
    cached = CachedStorage(slow, tmp_path / "cache")
    with cached.open(source) as first:
        assert first.read() == source.read_bytes()
    start = time.perf_counter()
    with cached.open(source) as again:
        assert again.read() == source.read_bytes()
    assert time.perf_counter() - start < 0.1
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert isinstance(Storage().open(source).read(1), bytes)


# -- bad input -----------------------------------------------------------------------------------

def _train_error(*args: str) -> str:
    result = run_here("train", "--steps", "2", "--no-progress", *args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.multiprocess
def test_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    line = _train_error("--data", f"shards:{tmp_path / 'nowhere'}")
    assert "is not a directory" in line and "tandem pack" in line


@pytest.mark.pure
def test_a_directory_without_shards_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="holds no shards; write the shards with tandem pack"):
        load_shards(f"shards:{tmp_path}")
    (tmp_path / "x.tar").write_bytes(b"")
    with pytest.raises(UsageError, match="1 tar files .* but no index.json"):
        load_shards(f"shards:{tmp_path}")


@pytest.mark.multiprocess
def test_a_truncated_shard_is_named(digit_shards: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(digit_shards, copy)
    victim = copy / "train-000003.tar"
    victim.write_bytes(victim.read_bytes()[:5000])
    line = _train_error("--data", f"shards:{copy}")
    assert "shard train-000003.tar is truncated" in line
    # a shard damaged inside (same size) is named when it is read
    corrupt = copy / "train-000001.tar"
    raw = bytearray((digit_shards / "train-000001.tar").read_bytes())
    raw[100:120] = b"\xff" * 20
    corrupt.write_bytes(bytes(raw))
    victim.write_bytes((digit_shards / "train-000003.tar").read_bytes())
    data = load_shards(f"shards:{copy}")
    first = data.train.starts[1]
    with pytest.raises(UsageError, match="shard train-000001.tar .* truncated or corrupt"):
        data.train.take(torch.tensor([first]))


@pytest.mark.multiprocess
def test_options_that_do_not_apply_are_refused(digit_shards: Path, tmp_path: Path) -> None:
    assert "--loader-workers 2 reads batches ahead" in _train_error("--loader-workers", "2")
    assert "--cache-dir keeps local copies of shards" in _train_error(
        "--cache-dir", str(tmp_path))
    assert "shuffle=0 must be at least 1" in _train_error(
        "--data", f"shards:{digit_shards}:shuffle=0")
    line = run_here("pack", "digits", "--out", str(digit_shards))
    assert line.returncode == 2 and "already holds shards" in line.stderr


# -- training ------------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.statistical
def test_shards_train_to_the_in_memory_accuracy(digit_shards: Path) -> None:
    """The same runs on shards and in memory, over four seeds (the two read the samples in
    different orders, so single runs differ by a test sample or two either way)."""
    accuracy: dict[str, list[float]] = {"shards": [], "memory": []}
    for seed in range(4):
        common = ("--steps", "300", "--lr-schedule", "cosine", "--seed", str(seed))
        streamed = run_json("train", "--data", f"shards:{digit_shards}", *common)
        held = run_json("train", "--data", "digits", *common)
        assert streamed["loader_workers"] == 1 and held["loader_workers"] == 0
        assert 0 <= streamed["data_wait_fraction"] < 1
        accuracy["shards"].append(streamed["test_accuracy"])
        accuracy["memory"].append(held["test_accuracy"])
    means = {key: sum(values) / len(values) for key, values in accuracy.items()}
    assert means["memory"] > 0.95
    assert abs(means["shards"] - means["memory"]) <= 0.005, accuracy


@pytest.mark.multiprocess
def test_a_run_stopped_mid_epoch_resumes_to_the_uninterrupted_result(
        digit_shards: Path, tmp_path: Path) -> None:
    # 1,438 samples at 64 a step: an epoch is 23 steps, so stopping after 30 is mid-epoch 2
    common = ("--data", f"shards:{digit_shards}", "--nproc", "2", "--steps", "40",
              "--batch-size", "64", "--checkpoint-every", "10", "--loader-workers", "2")
    run_json("train", *common, "--out", str(tmp_path / "whole"))
    run_json("train", *common, "--out", str(tmp_path / "cut"), "--stop-after", "30")
    state = torch.load(tmp_path / "cut" / "checkpoint.pt", weights_only=False)
    assert state["data"]["epoch"] == 1 and state["data"]["samples_into_epoch"] == 7 * 64
    resized = tmp_path / "resized"
    shutil.copytree(tmp_path / "cut", resized, ignore=shutil.ignore_patterns(".tandem.lock"))
    resumed = run_json("train", *common, "--out", str(tmp_path / "cut"), "--resume", "auto",
                       "--cache-dir", str(tmp_path / "cache"))
    assert resumed["finished"]
    assert max_abs_diff(tmp_path / "whole" / "final.pt", tmp_path / "cut" / "final.pt") == 0.0
    assert any((tmp_path / "cache").iterdir())
    # on 4 workers from step 30, the rest of epoch 1 re-dealt (every sample once: see
    # test_grow_shrink.py); then on 2 again from step 40, into epoch 2
    grown = run_json("train", *common, "--out", str(resized), "--resume", "auto", "--nproc", "4")
    assert grown["finished"] and grown["world_size"] == 4
    state = torch.load(resized / "checkpoint.pt", weights_only=False)
    assert state["data"]["cuts"] == [[0, 2], [7 * 64, 4]] and state["data"]["partitions"] == 4
    shrunk = run_json("train", *common, "--out", str(resized), "--resume", "auto",
                      "--steps", "50")
    assert shrunk["finished"] and shrunk["world_size"] == 2
    state = torch.load(resized / "checkpoint.pt", weights_only=False)
    assert (state["data"]["epoch"], state["data"]["cuts"]) == (2, [[0, 2]])


@pytest.mark.multiprocess
@pytest.mark.statistical
@pytest.mark.parametrize("strategy", [
    ("--strategy", "ps", "--nproc", "3"),
    ("--strategy", "ps", "--mode", "async", "--nproc", "3"),
    ("--strategy", "gossip", "--nproc", "2"),
    ("--strategy", "localsgd", "--nproc", "2"),
    ("--strategy", "pipeline", "--nproc", "2", "--schedule", "gpipe"),
    ("--strategy", "pipeline", "--nproc", "2", "--schedule", "pipedream"),
])
def test_every_strategy_trains_on_shards(digit_shards: Path, strategy: tuple[str, ...]) -> None:
    """Synchronous strategies learn digits in 60 steps; the asynchronous ones (ps async,
    PipeDream) learn too slowly with the defaults for an accuracy bar that short (issue 14), so
    for them the loss must have fallen below chance (ln 10 = 2.30)."""
    summary = run_json("train", "--data", f"shards:{digit_shards}", *strategy, "--steps", "60")
    assert summary["finished"], summary
    if "async" in strategy or "pipedream" in strategy:
        assert summary["final_loss"] < 2.2, summary
    else:
        assert summary["test_accuracy"] > 0.5, summary


# -- the Python API ------------------------------------------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 3])
def test_shard_dataset_gives_each_rank_its_part_of_an_epoch(digit_shards: Path,
                                                            world: int) -> None:
    from torch.utils.data import DataLoader

    from tandem.data import ShardDataset

    memory = load_data("digits").train
    seen: list[int] = []
    for rank in range(world):
        dataset = ShardDataset(digit_shards, rank=rank, world_size=world, seed=4)
        dataset.set_epoch(2)
        loader = DataLoader(dataset, batch_size=50, num_workers=2 if rank == 0 else 0)
        count = 0
        for inputs, targets in loader:
            # each input is one of the digits: find which by its pixels
            flat = memory.inputs.flatten(1)
            for row, target in zip(inputs.flatten(1), targets):
                match = (flat == row).all(dim=1).nonzero().flatten().tolist()
                assert any(int(memory.targets[m]) == int(target) for m in match)
                seen.append(next(m for m in match if m not in seen or len(match) == 1))
            count += len(inputs)
        assert count == len(dataset)
    assert len(seen) == len(memory)
    assert len(set(seen)) >= len(memory) - 20  # a few digits have exact duplicates


@pytest.mark.multiprocess
@pytest.mark.statistical
def test_fit_streams_a_shard_dataset_as_it_streams_the_spec(digit_shards: Path,
                                                             tmp_path: Path) -> None:
    import tandem
    from tandem.data import ShardDataset

    train, test = ShardDataset(digit_shards), ShardDataset(digit_shards, "test")
    given = tandem.fit("mlp", train, test, steps=100, lr_schedule="cosine",
                       out=str(tmp_path / "given"), progress=False)
    named = tandem.fit("mlp", data=f"shards:{digit_shards}", steps=100, lr_schedule="cosine",
                       out=str(tmp_path / "named"), progress=False)
    assert given.summary["loader_workers"] == 1
    assert given.summary["test_accuracy"] > 0.6
    assert max_abs_diff(tmp_path / "given" / "final.pt", tmp_path / "named" / "final.pt") == 0


@pytest.mark.pure
def test_pack_on_the_command_line_reports_shards_samples_and_bytes(tmp_path: Path) -> None:
    result = run_here("pack", "digits", "--out", str(tmp_path / "s"), "--shard-size", "300KB",
                      "--json", "--no-progress")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["samples"] == {"train": 1438, "test": 359}
    tars = sorted(tmp_path.glob("s/*.tar"))
    assert summary["shards"] == len(tars) > 4
    assert summary["bytes"] == sum(p.stat().st_size for p in tars)
    bad = run_here("pack", "digits", "--out", str(tmp_path / "t"), "--shard-size", "64XB")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--shard-size '64XB' is not a size" in bad.stderr
