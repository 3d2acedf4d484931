"""``--data shards:DIR``: a dataset packed by ``tandem pack`` into tar shards (the WebDataset
layout), streamed so that each rank reads only its own part of the shards.

``DIR`` holds ``train-000000.tar``, ..., ``test-000000.tar``, ... and ``index.json``, which
lists each shard's samples and the byte offset of each sample in it (:mod:`tandem.data.pack`
writes both). A sample ``000000123`` is the consecutive tar members ``000000123.<part>``:
``input.npy`` (a tensor), ``input.pth`` (any structure of tensors, ``torch.save``), or the
image file's own bytes (``png``, ``jpg``, ...) for a packed image folder; and ``cls`` (a class
index, as text) or ``target.npy``/``target.pth``. Any WebDataset reader reads them.

How an epoch is read (:class:`ShardBatchSampler`): the shards are put in an order that depends
only on the seed and the epoch; the samples of that order, end to end, are cut into one
contiguous range per data-parallel rank, each as long as the rank's share of every global
batch, so every sample is read exactly once per epoch and every rank gets the same number of
samples per step whatever the shards' sizes (a range may start or end inside a shard: shards
are split by samples, so fewer shards than ranks works too). Each rank passes its range
through a shuffle buffer (``shuffle=`` samples, seeded by the seed, the epoch and the rank)
and reads only the shards its range covers. The order is a function of the seed, the epoch,
the step and the number of ranks, so a checkpoint's step is its position: a resumed run
continues mid-epoch exactly where it stopped (with the same number of ranks).

Options: ``shards:DIR[:shuffle=1000,open_latency=2ms,bandwidth=200MB/s]``; the last two read
through the emulated shared file system of :mod:`tandem.data.storage`.

Usage::

    data = load_shards("shards:/data/digits-shards")
    sampler = data.train.batch_sampler(global_batch_size=64, seed=0, partitions=4)
    batch = data.train.take(sampler.local_indices(0, rank=1, world_size=4))
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import default_collate

from tandem.data.info import DataInfo
from tandem.data.run_data import Data
from tandem.data.sampler import GlobalBatchSampler
from tandem.data.samples import Batch, Samples
from tandem.data.shard_decode import decode_sample, tar_members
from tandem.data.shard_sampler import ShardBatchSampler
from tandem.data.storage import CachedStorage, EmulatedStorage, Storage, check_cache_dir
from tandem.errors import UsageError
from tandem.output_files import cause
from tandem.spec.options import path_spec

INDEX_NAME = "index.json"
INDEX_FORMAT = "tandem-shards/1"
SPLITS = ("train", "test")
MAX_OPEN_SHARDS = 64
"""Shard files a reader keeps open at once (closing the least recently used)."""
DEFAULT_SHUFFLE = 1000
READ_CHUNK = 64
"""Samples :class:`ShardDataset` reads at once."""


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """One tar file of a split: its name, size, and where each of its samples starts."""

    name: str
    bytes: int
    offsets: tuple[int, ...]
    """Byte offset of each sample's first tar header, then the end of the last sample."""

    @property
    def samples(self) -> int:
        return len(self.offsets) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class ShardIndex:
    """What ``index.json`` says of a directory of shards."""

    root: Path
    name: str
    info: DataInfo | None
    """None where the packed data could not tell (structured inputs: a user's own model)."""
    splits: dict[str, tuple[Shard, ...]]
    decode: dict[str, Any]
    """How inputs decode: ``{"kind": "tensor"}``, or ``{"kind": "image", "mode": "L"|"RGB",
    "size": S}`` for image files (``size`` 0: keep theirs)."""
    fingerprint: str
    """Hash of ``index.json``: a checkpoint names the shards it was trained on."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as ``index.json``."""
        return {
            "format": INDEX_FORMAT, "name": self.name,
            "info": None if self.info is None else {
                "task": self.info.task, "input_shape": list(self.info.input_shape),
                "num_classes": self.info.num_classes},
            "decode": self.decode,
            "splits": {split: [{"name": s.name, "bytes": s.bytes, "samples": s.samples,
                                "offsets": list(s.offsets)} for s in shards]
                       for split, shards in self.splits.items()},
        }


@dataclasses.dataclass(kw_only=True, slots=True)
class ShardOptions:
    """Options of ``--data shards:DIR:key=value,...``."""

    shuffle: int = DEFAULT_SHUFFLE
    """Samples in each rank's shuffle buffer (1: read in shard order)."""
    open_latency: str = "0"
    """Emulated seconds per file open (``2ms``), for measurements (0: none)."""
    bandwidth: str = "0"
    """Emulated read bandwidth per process (``200MB/s``), for measurements (0: no cap)."""

    def __post_init__(self) -> None:
        if self.shuffle < 1:
            raise UsageError(f"shards option shuffle={self.shuffle} must be at least 1 (1 reads "
                             f"each rank's samples in shard order), e.g. shuffle=1000")

    def storage(self) -> Storage:
        """Local files, or the emulated shared file system these options name."""
        from tandem.cluster import parse_bandwidth, parse_latency

        latency = parse_latency(self.open_latency) if self.open_latency not in ("0", "") else 0.0
        bandwidth = parse_bandwidth(self.bandwidth) if self.bandwidth not in ("0", "") else 0.0
        if latency or bandwidth:
            return EmulatedStorage(open_latency_s=latency, bandwidth_Bps=bandwidth)
        return Storage()


def parse_shards_spec(spec: str) -> tuple[Path, ShardOptions]:
    """The directory and options of ``shards:DIR[:key=value,...]``."""
    path, options = path_spec(spec, ShardOptions, what="directory",
                              example="shards:./digits-shards (made by tandem pack)")
    return Path(path).expanduser(), options


def read_index(root: Path, *, spec: str, storage: Storage | None = None) -> ShardIndex:
    """The index of the shards in ``root``, checked against the files (each shard present and
    whole); raises ``UsageError`` naming what is wrong and the fix."""
    if not root.is_dir():
        raise UsageError(f"--data {spec}: {root} is not a directory; give the --out directory "
                         f"of tandem pack")
    index_path = root / INDEX_NAME
    if not index_path.is_file():
        tars = sorted(p.name for p in root.glob("*.tar"))
        found = (f"it has {len(tars)} tar files ({tars[0]}, ...) but no {INDEX_NAME}" if tars
                 else "it holds no shards")
        raise UsageError(f"--data {spec}: {found}; write the shards with tandem pack SOURCE "
                         f"--out {root}")
    try:
        with (storage or Storage()).open(index_path) as handle:
            raw = handle.read()
    except OSError as exc:
        raise UsageError(f"--data {spec}: cannot read {index_path} ({cause(exc)}); make it "
                         f"readable") from None
    try:
        doc = json.loads(raw)
        if doc.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, not {INDEX_FORMAT!r}")
        info = None if doc["info"] is None else DataInfo(
            task=doc["info"]["task"], input_shape=tuple(doc["info"]["input_shape"]),
            num_classes=doc["info"]["num_classes"])
        splits = {split: tuple(_shard_entry(entry) for entry in doc["splits"][split])
                  for split in SPLITS}
        decode = dict(doc["decode"])
        _check_entries(splits, decode)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UsageError(f"--data {spec}: {index_path} is corrupt or not an index of tandem "
                         f"pack ({_reason(exc)}); write the shards again with tandem pack"
                         ) from None
    for split in SPLITS:
        if not any(shard.samples for shard in splits[split]):
            raise UsageError(f"--data {spec}: the index lists no {split} samples; pack a "
                             f"dataset with both splits")
        for shard in splits[split]:
            path = root / shard.name
            if not path.is_file():
                raise UsageError(f"--data {spec}: shard {shard.name} of the index is missing "
                                 f"from {root}; copy it back or pack again")
            size = path.stat().st_size
            if size < shard.bytes:
                raise UsageError(f"--data {spec}: shard {shard.name} is truncated ({size:,} of "
                                 f"{shard.bytes:,} bytes); copy it again or pack again")
    return ShardIndex(root=root, name=str(doc.get("name", root.name)), info=info, splits=splits,
                      decode=decode, fingerprint=hashlib.sha1(raw).hexdigest()[:16])


def _shard_entry(entry: dict[str, Any]) -> Shard:
    """One shard of the index, its numbers checked to be whole numbers."""
    shard = Shard(name=entry["name"], bytes=_whole(entry["bytes"], "bytes"),
                  offsets=tuple(_whole(o, "offsets") for o in entry["offsets"]))
    if "samples" in entry and _whole(entry["samples"], "samples") != shard.samples:
        raise ValueError(f"shard {shard.name} lists {entry['samples']} samples, its offsets "
                         f"{shard.samples}")
    return shard


def _whole(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} {value!r} is not a whole number")
    return value


def _check_entries(splits: dict[str, tuple[Shard, ...]], decode: dict[str, Any]) -> None:
    """The index agrees with itself: plain, distinct shard names; each shard's samples start
    at 0 and follow one another within its size; a known way to decode."""
    names = [shard.name for shards in splits.values() for shard in shards]
    for shard in (shard for shards in splits.values() for shard in shards):
        if not isinstance(shard.name, str) or shard.name in ("", ".", "..") or "/" in shard.name:
            raise ValueError(f"shard name {shard.name!r} is not a file name")
        offsets = shard.offsets
        if not offsets or offsets[0] != 0 or offsets[-1] > shard.bytes or any(
                later <= earlier for earlier, later in zip(offsets, offsets[1:])):
            raise ValueError(f"shard {shard.name}'s sample offsets do not run up from 0 "
                             f"within its {shard.bytes} bytes")
    if len(set(names)) != len(names):
        raise ValueError("a shard is listed twice")
    kind = decode.get("kind")
    if kind not in ("tensor", "image") or (kind == "image" and (
            decode.get("mode") not in ("L", "RGB")
            or not isinstance(decode.get("size"), int) or decode["size"] < 0)):
        raise ValueError(f"decode {decode} is not one tandem pack writes")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]!r} entry"
    if isinstance(exc, json.JSONDecodeError):
        return f"not JSON: {exc.msg} at line {exc.lineno}"
    return str(exc)


def load_shards(spec: str, *, cache_dir: str | None = None) -> Data:
    """The train and test samples of ``shards:DIR`` as a :class:`tandem.data.Data`."""
    root, options = parse_shards_spec(spec)
    storage = options.storage()
    if cache_dir:
        check_cache_dir(Path(cache_dir).expanduser())
        storage = CachedStorage(storage, Path(cache_dir).expanduser())
    index = read_index(root, spec=spec, storage=options.storage())
    train = ShardSamples(index, "train", storage=storage, shuffle=options.shuffle)
    test = ShardSamples(index, "test", storage=storage, shuffle=options.shuffle)
    return Data(f"shards:{root}", train, test, index.info)


class ShardSamples(Samples):
    """The samples of one split of a shard directory, read by sample number (numbered in the
    index's shard order) through ``storage``; each process opens the files it needs itself."""

    streams = True

    def __init__(self, index: ShardIndex, split: str, *, storage: Storage, shuffle: int,
                 device: torch.device | None = None) -> None:
        self.index, self.split, self.storage = index, split, storage
        self.shuffle, self.device = shuffle, device
        self.shards = index.splits[split]
        self.starts = list(np.cumsum([0] + [s.samples for s in self.shards]))
        self._open: OrderedDict[int, BinaryIO] = OrderedDict()
        self._pid = os.getpid()
        self.opens = 0
        """Files this process has opened (for measurements)."""

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # open files stay with their process
        return {key: getattr(self, key) for key in
                ("index", "split", "storage", "shuffle", "device", "shards", "starts")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
        self._open, self.opens, self._pid = OrderedDict(), 0, os.getpid()

    def to(self, device: torch.device) -> ShardSamples:
        return ShardSamples(self.index, self.split, storage=self.storage, shuffle=self.shuffle,
                            device=device)

    def batch_sampler(self, *, global_batch_size: int, seed: int, partitions: int,
                      schedule: Sequence[tuple[int, int]] | None = None,
                      order: Callable[[int], torch.Tensor] | None = None,
                      num_samples: int | None = None, shuffle: bool = True,
                      drop_last: bool = False) -> GlobalBatchSampler:
        assert order is None and shuffle and not drop_last, "refused by Task for shards"
        return ShardBatchSampler([s.samples for s in self.shards],
                                 global_batch_size=global_batch_size, seed=seed,
                                 partitions=partitions, shuffle_buffer=self.shuffle,
                                 schedule=schedule)

    def take(self, indices: torch.Tensor) -> Batch:
        wanted = [int(i) for i in indices.tolist()]
        found = self._read(sorted(set(wanted)), decode=True)
        items = [found[i] for i in wanted]
        inputs, targets = default_collate(items)
        batch = Batch(inputs, targets, len(items))
        return batch.to(self.device) if self.device is not None else batch

    def read_parts(self, indices: torch.Tensor) -> list[dict[str, bytes]]:
        """The samples ``indices`` as their undecoded tar members (measuring storage alone)."""
        wanted = [int(i) for i in indices.tolist()]
        found = self._read(sorted(set(wanted)), decode=False)
        return [found[i] for i in wanted]

    def close(self) -> None:
        """Close the files this process has open."""
        while self._open:
            self._open.popitem()[1].close()

    # -- reading ---------------------------------------------------------------------------------

    def _read(self, numbers: list[int], *, decode: bool) -> dict[int, Any]:
        """Samples ``numbers`` (sorted), each run of consecutive samples of a shard read at
        once."""
        found: dict[int, tuple[Any, Any]] = {}
        run: list[int] = []
        for number in numbers + [-1]:
            if run and (number != run[-1] + 1 or self._shard_of(number) != self._shard_of(run[0])):
                found.update(self._read_run(run, decode=decode))
                run = []
            if number >= 0:
                if not 0 <= number < len(self):
                    raise IndexError(f"sample {number} outside the {len(self)} {self.split} "
                                     f"samples of {self.index.root}")
                run.append(number)
        return found

    def _shard_of(self, number: int) -> int:
        return bisect.bisect_right(self.starts, number) - 1 if number >= 0 else -1

    def _read_run(self, run: list[int], *, decode: bool) -> dict[int, Any]:
        shard_number = self._shard_of(run[0])
        shard = self.shards[shard_number]
        first, last = run[0] - self.starts[shard_number], run[-1] - self.starts[shard_number]
        handle = self._handle(shard_number)
        handle.seek(shard.offsets[first])
        size = shard.offsets[last + 1] - shard.offsets[first]
        data = handle.read(size)
        parts = tar_members(data, shard.name, expected=len(run)) if len(data) == size else None
        if parts is None:
            copy = self.storage.copy_of(self.index.root / shard.name)
            which = f"sample {first}" if first == last else f"samples {first}..{last}"
            read, then = ((f", read from its copy {copy}", f", then remove {copy}")
                          if copy is not None else ("", ""))
            raise UsageError(f"shard {shard.name} in {self.index.root} is truncated or corrupt "
                             f"({which} unreadable{read}); copy it again or pack again{then}")
        return {number: self._decode(sample, shard.name) if decode else sample
                for number, sample in zip(run, parts)}

    def _handle(self, shard_number: int) -> BinaryIO:
        if self._pid != os.getpid():  # a forked loader process: its parent's files share their
            self._open, self._pid = OrderedDict(), os.getpid()  # offsets; open its own
        if shard_number in self._open:
            self._open.move_to_end(shard_number)
            return self._open[shard_number]
        if len(self._open) >= MAX_OPEN_SHARDS:
            self._open.popitem(last=False)[1].close()
        path = self.index.root / self.shards[shard_number].name
        try:
            handle = self.storage.open(path)
        except OSError as exc:
            raise UsageError(f"shard {path.name} in {self.index.root} cannot be read "
                             f"({cause(exc)}); make it readable, or copy it again") from None
        self.opens += 1
        self._open[shard_number] = handle
        return handle

    def _decode(self, sample: dict[str, bytes], shard: str) -> tuple[Any, Any]:
        try:
            return decode_sample(sample, self.index.decode)
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            raise UsageError(f"shard {shard} in {self.index.root}: a sample does not decode "
                             f"({type(exc).__name__}: {exc}); pack the dataset again") from None


class ShardDataset(torch.utils.data.IterableDataset[tuple[Any, Any]]):
    """One split of a shard directory as a PyTorch ``IterableDataset`` of ``(input, target)``
    pairs: in a plain training loop, this rank's part of one epoch (rank and world size from
    ``torch.distributed`` when it is initialized; ranks differ by at most one sample), in the
    order ``--data shards:DIR`` would read it, split among a ``DataLoader``'s worker processes;
    :meth:`set_epoch` picks the epoch. Given to :func:`tandem.fit`, tandem streams it as it
    streams ``--data shards:DIR``.

    Usage::

        train = ShardDataset("digits-shards")
        loader = DataLoader(train, batch_size=32, num_workers=2)
        tandem.fit(model, ShardDataset("digits-shards"), ShardDataset("digits-shards", "test"))
    """

    def __init__(self, path: str | Path, split: str = "train", *, seed: int = 0,
                 shuffle: int = DEFAULT_SHUFFLE, cache_dir: str | None = None,
                 rank: int | None = None, world_size: int | None = None) -> None:
        super().__init__()
        if split not in SPLITS:
            raise UsageError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        data = load_shards(f"shards:{path}:shuffle={shuffle}", cache_dir=cache_dir)
        samples = data.train if split == "train" else data.test
        if not isinstance(samples, ShardSamples):  # load_shards gives shard samples
            raise TypeError(f"{path}: the {split} split is not read from shards")
        self.tandem_samples: ShardSamples = samples
        """The samples tandem streams when this dataset is given to it."""
        self.info = data.info
        self.seed, self.shuffle, self.epoch = seed, shuffle, 0
        self.rank, self.world_size = rank, world_size

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` next (its shard order and shuffle)."""
        self.epoch = epoch

    def _place(self) -> tuple[int, int]:
        if self.rank is not None and self.world_size is not None:
            return self.rank, self.world_size
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _stream(self) -> np.ndarray:
        rank, world = self._place()
        samples = self.tandem_samples
        sampler = ShardBatchSampler([s.samples for s in samples.shards], global_batch_size=world,
                                    seed=self.seed, partitions=world, shuffle_buffer=self.shuffle)
        return sampler.partition_stream(self.epoch, rank)

    def __len__(self) -> int:
        return len(self._stream())

    def __iter__(self) -> Any:
        stream = self._stream()
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            stream = stream[worker.id::worker.num_workers]
        from tandem import structures

        for low in range(0, len(stream), READ_CHUNK):
            batch = self.tandem_samples.take(torch.from_numpy(stream[low:low + READ_CHUNK]))
            for row in range(batch.size):
                yield structures.take(batch.inputs, row), structures.take(batch.targets, row)
