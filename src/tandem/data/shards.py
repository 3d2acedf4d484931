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

import ast
import bisect
import functools
import dataclasses
import hashlib
import io
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils.data import default_collate

from tandem.data.info import DataInfo
from tandem.data.run_data import Data
from tandem.data.sampler import GlobalBatchSampler, shard_sizes
from tandem.data.samples import Batch, Samples
from tandem.data.storage import CachedStorage, EmulatedStorage, Storage
from tandem.errors import UsageError
from tandem.spec.options import path_spec

INDEX_NAME = "index.json"
INDEX_FORMAT = "tandem-shards/1"
SPLITS = ("train", "test")
TAR_BLOCK = 512
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
    with (storage or Storage()).open(index_path) as handle:
        raw = handle.read()
    try:
        doc = json.loads(raw)
        if doc.get("format") != INDEX_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}, not {INDEX_FORMAT!r}")
        info = None if doc["info"] is None else DataInfo(
            task=doc["info"]["task"], input_shape=tuple(doc["info"]["input_shape"]),
            num_classes=int(doc["info"]["num_classes"]))
        splits = {split: tuple(Shard(name=entry["name"], bytes=int(entry["bytes"]),
                                     offsets=tuple(int(o) for o in entry["offsets"]))
                               for entry in doc["splits"][split]) for split in SPLITS}
        decode = dict(doc["decode"])
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--data {spec}: {index_path} is not an index of tandem pack ({exc}); "
                         f"write the shards again with tandem pack") from None
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


def load_shards(spec: str, *, cache_dir: str | None = None) -> Data:
    """The train and test samples of ``shards:DIR`` as a :class:`tandem.data.Data`."""
    root, options = parse_shards_spec(spec)
    storage = options.storage()
    if cache_dir:
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
                      schedule: Sequence[tuple[int, int]] | None = None) -> GlobalBatchSampler:
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
        parts = _members(data, shard.name, expected=len(run)) if len(data) == size else None
        if parts is None:
            raise UsageError(f"shard {shard.name} in {self.index.root} is truncated or corrupt "
                             f"(samples {first}..{last} unreadable); copy it again or pack again")
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
        handle = self.storage.open(self.index.root / self.shards[shard_number].name)
        self.opens += 1
        self._open[shard_number] = handle
        return handle

    def _decode(self, sample: dict[str, bytes], shard: str) -> tuple[Any, Any]:
        try:
            return decode_sample(sample, self.index.decode)
        except (ValueError, KeyError, OSError, RuntimeError) as exc:
            raise UsageError(f"shard {shard} in {self.index.root}: a sample does not decode "
                             f"({type(exc).__name__}: {exc}); pack the dataset again") from None


def _members(data: bytes, shard: str, *, expected: int) -> list[dict[str, bytes]] | None:
    """The samples in ``data`` (whole tar members of consecutive samples), each as its parts by
    extension; None unless the bytes are ``expected`` whole samples with valid headers.

    Parsed here rather than by ``tarfile`` (a tenth of its time per member, which counts for
    small samples): 512-byte ustar headers, each checked by its checksum."""
    samples: list[dict[str, bytes]] = []
    key = None
    position, end = 0, len(data)
    while position + TAR_BLOCK <= end:
        header = data[position:position + TAR_BLOCK]
        if not header.strip(b"\0"):
            break
        try:
            checksum = int(header[148:156].strip(b"\0 ") or b"0", 8)
            size = int(header[124:136].strip(b"\0 ") or b"0", 8)
        except ValueError:
            return None
        if checksum != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            return None
        start = position + TAR_BLOCK
        position = start + -(-size // TAR_BLOCK) * TAR_BLOCK
        if header[156:157] not in (b"0", b"\0") or start + size > end:
            if start + size > end:
                return None
            continue  # not a regular file: directories, links, extended headers
        name = header[:100].split(b"\0", 1)[0].decode()
        prefix = header[345:500].split(b"\0", 1)[0].decode()
        base, _, part = (f"{prefix}/{name}" if prefix else name).rpartition("/")[2].partition(".")
        if base != key:
            samples.append({})
            key = base
        samples[-1][part] = data[start:start + size]
    return samples if len(samples) == expected else None


def decode_sample(parts: dict[str, bytes], decode: dict[str, Any]) -> tuple[Any, Any]:
    """The ``(input, target)`` of one sample's tar members."""
    if "input.npy" in parts:
        inputs: Any = torch.from_numpy(load_npy(parts["input.npy"]))
    elif "input.pth" in parts:
        inputs = torch.load(io.BytesIO(parts["input.pth"]), weights_only=True)
    else:
        image_part = next((part for part in parts if part not in ("cls", "target.npy",
                                                                  "target.pth")), None)
        if image_part is None or decode.get("kind") != "image":
            raise KeyError(f"no input among its parts {sorted(parts)}")
        inputs = decode_image(parts[image_part], mode=decode["mode"], size=int(decode["size"]))
    if "cls" in parts:
        targets: Any = torch.tensor(int(parts["cls"].decode()), dtype=torch.int64)
    elif "target.npy" in parts:
        targets = torch.from_numpy(load_npy(parts["target.npy"]))
    elif "target.pth" in parts:
        targets = torch.load(io.BytesIO(parts["target.pth"]), weights_only=True)
    else:
        raise KeyError(f"no target among its parts {sorted(parts)}")
    return inputs, targets


@functools.lru_cache(maxsize=256)
def _npy_header(header: bytes) -> tuple[np.dtype, tuple[int, ...], bool]:
    fields = ast.literal_eval(header.decode("latin1"))
    return np.dtype(fields["descr"]), tuple(fields["shape"]), bool(fields["fortran_order"])


def load_npy(data: bytes) -> np.ndarray:
    """The array of ``.npy`` bytes (as ``np.load``, with each distinct header parsed once: the
    samples of a dataset share theirs)."""
    if data[:6] != b"\x93NUMPY":
        raise ValueError("not .npy data")
    if data[6] == 1:
        length, start = int.from_bytes(data[8:10], "little"), 10
    else:
        length, start = int.from_bytes(data[8:12], "little"), 12
    dtype, shape, fortran = _npy_header(bytes(data[start:start + length]))
    if dtype.hasobject:
        raise ValueError("object arrays are not read")
    flat = np.frombuffer(data, dtype=dtype, offset=start + length,
                         count=int(np.prod(shape, dtype=np.int64)))
    array = flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)
    return array.copy()


def decode_image(data: bytes, *, mode: str, size: int) -> torch.Tensor:
    """An image file's bytes as a float tensor ``C x H x W`` in [0, 1] (as ``folder:PATH``
    reads it)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        image = image.convert(mode)
        if size:
            image = image.resize((size, size))
        array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array[None] if mode == "L" else array.transpose(2, 0, 1).copy())


class ShardBatchSampler(GlobalBatchSampler):
    """Global batches over shards: partition ``p`` (data-parallel rank ``p``) reads one
    contiguous range of the epoch's shard order through its shuffle buffer (see the module
    docstring); ``local_indices(step, rank=p, world_size=partitions)`` is its share."""

    def __init__(self, shard_samples: list[int], *, global_batch_size: int, seed: int,
                 partitions: int, shuffle_buffer: int,
                 schedule: Sequence[tuple[int, int]] | None = None) -> None:
        super().__init__(sum(shard_samples), global_batch_size=global_batch_size, seed=seed,
                         schedule=schedule)
        if partitions < 1:
            raise ValueError(f"need at least one partition (got {partitions})")
        self.shard_samples = list(shard_samples)
        self.partitions = partitions
        self.shuffle_buffer = shuffle_buffer
        self.shard_starts = np.cumsum([0] + self.shard_samples)

    def local_indices(self, step: int, *, rank: int, world_size: int) -> torch.Tensor:
        if world_size != self.partitions:
            raise ValueError(f"the shard order was cut for {self.partitions} ranks, not "
                             f"{world_size}")
        return super().local_indices(step, rank=rank, world_size=world_size)

    def partition_lengths(self, epoch: int) -> list[int]:
        """Samples each partition reads in ``epoch``: its share of every global batch (the
        batches of an epoch differ in size under a batch schedule)."""
        lengths = [0] * self.partitions
        for size in self.epoch_batch_sizes(epoch):
            for p, share in enumerate(shard_sizes(size, self.partitions)):
                lengths[p] += share
        return lengths

    def shard_order(self, epoch: int) -> list[int]:
        """The order of the shards in ``epoch``."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.shard_samples), generator=gen).tolist()

    def partition_stream(self, epoch: int, partition: int) -> np.ndarray:
        """Sample numbers partition ``partition`` reads in ``epoch``, in order."""
        order = self.shard_order(epoch)
        sequence = np.concatenate([np.arange(self.shard_starts[s], self.shard_starts[s + 1])
                                   for s in order]) if order else np.zeros(0, dtype=np.int64)
        lengths = self.partition_lengths(epoch)
        start = sum(lengths[:partition])
        own = sequence[start:start + lengths[partition]]
        rng = np.random.default_rng([self.seed, epoch, partition])
        return _buffer_shuffle(own, self.shuffle_buffer, rng)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """The epoch's global batches end to end, each the partitions' shares in rank order."""
        if self._epoch_order is not None and self._epoch_order[0] == epoch:
            return self._epoch_order[1]
        streams = [self.partition_stream(epoch, p) for p in range(self.partitions)]
        taken = [0] * self.partitions
        pieces = []
        for size in self.epoch_batch_sizes(epoch):
            for p, share in enumerate(shard_sizes(size, self.partitions)):
                pieces.append(streams[p][taken[p]:taken[p] + share])
                taken[p] += share
        order = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        self._epoch_order = (epoch, order)
        return order


def _buffer_shuffle(items: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """``items`` through a shuffle buffer of ``size``: fill it, then for each new item emit a
    random one of the buffer and put the new one in its place; at the end, emit the rest in a
    random order. Samples read close together in the output come from a window of about
    ``size`` samples of the input, so a rank reads its shards nearly in order."""
    if size <= 1 or len(items) <= 1:
        return items.copy()
    buffer = list(items[:size])
    out = np.empty(len(items), dtype=items.dtype)
    picks = rng.integers(0, size, len(items))
    written = 0
    for item, pick in zip(items[size:], picks):
        out[written] = buffer[pick]
        buffer[pick] = item
        written += 1
    rest = np.array(buffer, dtype=items.dtype)
    out[written:] = rest[rng.permutation(len(rest))]
    return out


class ShardDataset(torch.utils.data.IterableDataset):
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
        self.tandem_samples: ShardSamples = data.train if split == "train" else data.test
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
