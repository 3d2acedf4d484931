"""``tandem pack``: write a dataset as tar shards in the WebDataset layout, with the index that
``--data shards:DIR`` reads (:mod:`tandem.data.shards` describes both).

An image folder (``folder:PATH``, or a bare directory) is packed as its image files' own bytes,
decoded when read exactly as ``folder:PATH`` decodes them; any other ``--data`` form is packed
sample by sample as tensors (``.npy``) or structures of tensors (``.pth``). A shard is closed
once it holds ``shard_size`` bytes; the index is written last, so an interrupted pack leaves no
index and no directory that ``shards:DIR`` would take for whole. A pack that fails (a full disk,
a file it cannot read, an error in the source, a stop signal) removes what it wrote (the
directory too, if it made it) and says so in one line naming the file and the cause.

Usage::

    result = pack("digits", Path("digits-shards"), shard_size=64 << 20)
    print(result.shards, result.samples, result.bytes)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from tandem.data.info import DataInfo
from tandem.data.shards import INDEX_NAME, SPLITS, Shard, ShardIndex
from tandem.errors import UsageError
from tandem.output_files import cause, write_failure

DEFAULT_SHARD_SIZE = 64 << 20
ROWS_PER_READ = 256
"""Samples of a non-image source read at once while packing."""
NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                          torch.int32, torch.int64, torch.uint8, torch.bool})

class Progress(Protocol):
    """What ``pack`` reports as it goes."""

    def begin(self, total: int) -> None:
        """The source holds ``total`` samples (both splits)."""

    def advance(self, count: int) -> None:
        """``count`` more samples written."""


@dataclasses.dataclass(frozen=True, slots=True)
class PackResult:
    """What ``pack`` wrote."""

    out: Path
    source: str
    """The ``--data`` form packed (a bare directory becomes ``folder:DIR``)."""
    shards: int
    samples: dict[str, int]
    bytes: int


def pack(source: str, out: Path, *, shard_size: int = DEFAULT_SHARD_SIZE,
         progress: Progress | None = None) -> PackResult:
    """Write ``source`` (a ``--data`` form or an image directory) as shards in ``out``."""
    if shard_size < 1:
        raise UsageError(f"--shard-size must be positive (got {shard_size} bytes); e.g. 64MB")
    _check_out(out)
    spec = f"folder:{source}" if Path(source).is_dir() and ":" not in source else source
    info: DataInfo | None
    if spec.partition(":")[0] == "folder":
        files, info, decode = _image_folder(spec)
        samples = {split: _image_samples(files[split]) for split in SPLITS}
        counts = {split: len(files[split]) for split in SPLITS}
        name = spec
    else:
        from tandem.data.load import load_data

        data = load_data(spec)
        decode, name = {"kind": "tensor"}, data.name
        try:
            info = data.info
        except UsageError:  # structures, float targets: only the user's own model can tell
            info = None
        samples = {"train": _tensor_samples(data.train), "test": _tensor_samples(data.test)}
        counts = {"train": len(data.train), "test": len(data.test)}
    made = _make_out(out)
    if progress is not None:
        progress.begin(sum(counts.values()))
    tick = progress.advance if progress is not None else (lambda count: None)
    try:
        splits = {split: tuple(_write_split(out, split, samples[split], shard_size, tick))
                  for split in SPLITS}
        index = ShardIndex(root=out, name=name, info=info, splits=splits, decode=decode,
                           fingerprint="")
        _write_index(out, json.dumps(index.to_json()) + "\n")
    except BaseException:
        _remove_written(out, made)
        raise
    total = sum(shard.bytes for shards in splits.values() for shard in shards)
    return PackResult(out=out, source=spec, shards=sum(len(s) for s in splits.values()), samples=counts,
                      bytes=total)


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory for the shards")
    if out.is_dir() and ((out / INDEX_NAME).exists() or any(out.glob("*.tar"))):
        raise UsageError(f"--out {out} already holds shards; remove them or choose another "
                         f"directory")


def _make_out(out: Path) -> bool:
    """Make ``out`` (and mark it as being written); whether it was made here."""
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{INDEX_NAME}.partial").touch()
    except OSError as exc:
        raise UsageError(f"--out {out} is not a writable directory ({cause(exc)}); choose "
                         f"one you can write") from None
    return made


def _write_index(out: Path, text: str) -> None:
    """``index.json``, written last: it makes the directory whole."""
    partial = out / f"{INDEX_NAME}.partial"
    try:
        partial.write_text(text)
        os.replace(partial, out / INDEX_NAME)
    except OSError as exc:
        raise write_failure(out / INDEX_NAME, exc) from None


def _remove_written(out: Path, made: bool) -> None:
    """Remove the shards and partial files a failed pack wrote in ``out`` (which held none
    before: ``_check_out``), and ``out`` itself if it was made for them and is empty now."""
    written = [path for split in SPLITS for pattern in ("*.tar", "*.tar.partial")
               for path in out.glob(f"{split}-{pattern}")]
    for path in [*written, out / f"{INDEX_NAME}.partial"]:
        path.unlink(missing_ok=True)
    if made:
        try:
            out.rmdir()
        except OSError:  # something else was put there meanwhile: it stays
            pass


def _write_split(out: Path, split: str, samples: Iterator[dict[str, bytes]], shard_size: int,
                 tick: Any) -> Iterator[Shard]:
    """Write the samples as ``split-000000.tar``, ... of at most about ``shard_size`` bytes."""
    number, key = 0, 0
    writer: _ShardWriter | None = None
    for sample in samples:
        if writer is None:
            writer = _ShardWriter(out / f"{split}-{number:06d}.tar")
        writer.add(f"{key:09d}", sample)
        key += 1
        tick(1)
        if writer.size >= shard_size:
            yield writer.close()
            writer, number = None, number + 1
    if writer is not None:
        yield writer.close()


class _ShardWriter:
    """One tar shard being written, with the offset where each sample starts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        try:
            self.file = open(self.partial, "wb")
        except OSError as exc:
            raise write_failure(path, exc) from None
        self.archive = tarfile.open(fileobj=self.file, mode="w", format=tarfile.USTAR_FORMAT)
        self.offsets = [0]

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def add(self, key: str, parts: dict[str, bytes]) -> None:
        try:
            for part, content in parts.items():
                member = tarfile.TarInfo(f"{key}.{part}")
                member.size, member.mtime, member.mode = len(content), 0, 0o644
                self.archive.addfile(member, io.BytesIO(content))
        except OSError as exc:
            self.abandon()
            raise write_failure(self.path, exc) from None
        self.offsets.append(self.file.tell())

    def abandon(self) -> None:
        """Close the file after a failed write (what is still buffered cannot be written either;
        the partial file is removed by the caller)."""
        with contextlib.suppress(OSError):
            self.file.close()

    def close(self) -> Shard:
        try:
            self.archive.close()
            self.file.flush()
            os.fsync(self.file.fileno())  # a full disk shows here, not after the rename
            self.file.close()
            os.replace(self.partial, self.path)
        except OSError as exc:
            self.abandon()
            raise write_failure(self.path, exc) from None
        return Shard(name=self.path.name, bytes=self.path.stat().st_size,
                     offsets=tuple(self.offsets))


def _tensor_samples(samples: Any) -> Iterator[dict[str, bytes]]:
    for start in range(0, len(samples), ROWS_PER_READ):
        batch = samples.rows(start, min(start + ROWS_PER_READ, len(samples)))
        for row in range(batch.size):
            inputs = _row(batch.inputs, row)
            targets = _row(batch.targets, row)
            yield {**_encode("input", inputs), **_encode_target(targets)}


def _row(tree: Any, row: int) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda x: x[row].clone() if isinstance(x, torch.Tensor) else x, tree)


def _encode(name: str, value: Any) -> dict[str, bytes]:
    if isinstance(value, torch.Tensor) and value.dtype in NUMPY_DTYPES:
        buffer = io.BytesIO()
        np.save(buffer, value.cpu().numpy(), allow_pickle=False)
        return {f"{name}.npy": buffer.getvalue()}
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return {f"{name}.pth": buffer.getvalue()}


def _encode_target(value: Any) -> dict[str, bytes]:
    if (isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.int64):
        return {"cls": str(int(value)).encode()}
    return _encode("target", value)


# -- image folders -------------------------------------------------------------------------------

def _image_folder(spec: str) -> tuple[dict[str, list[tuple[Path, int]]], DataInfo,
                                       dict[str, Any]]:
    """The image files of each split of ``folder:PATH`` (split as ``folder:PATH`` splits them),
    what they decode to, and how."""
    from PIL import Image, UnidentifiedImageError

    from tandem.data.folder import folder_splits

    _, options, classes, files = folder_splits(spec)
    modes, sizes = set(), set()
    for path, _ in (item for split in SPLITS for item in files[split]):
        try:
            with Image.open(path) as image:
                modes.add(image.mode)
                sizes.add(image.size)
        except (OSError, UnidentifiedImageError) as exc:
            raise UsageError(f"tandem pack {spec}: cannot read image {path} ({exc}); remove or "
                             f"replace it") from None
    if not options.size and len(sizes) > 1:
        shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:4])
        raise UsageError(f"tandem pack {spec}: the images have different sizes ({shown}); "
                         f"resize them all with folder:PATH:size=S, e.g. size=32")
    grayscale = modes <= {"L", "1", "I", "I;16", "F"}
    mode, channels = ("L", 1) if grayscale else ("RGB", 3)
    width, height = (options.size, options.size) if options.size else next(iter(sizes))
    info = DataInfo(task="classify", input_shape=(channels, height, width),
                    num_classes=len(classes))
    return files, info, {"kind": "image", "mode": mode, "size": options.size}


def _image_samples(files: list[tuple[Path, int]]) -> Iterator[dict[str, bytes]]:
    for path, label in files:
        extension = path.suffix.lower().lstrip(".")
        try:
            content = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"tandem pack: cannot read image {path} ({cause(exc)}); make it "
                             f"readable, or remove it") from None
        yield {extension: content, "cls": str(label).encode()}
