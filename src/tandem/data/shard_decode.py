"""A packed sample's bytes read back: whole tar members of consecutive samples, ``.npy`` arrays,
``.pth`` structures and image files, into its ``(input, target)``."""

from __future__ import annotations

import ast
import functools
import io
from typing import Any

import numpy as np
import torch

TAR_BLOCK = 512
"""Bytes of a tar header, and the unit member data is padded to."""


def tar_members(data: bytes, shard: str, *, expected: int) -> list[dict[str, bytes]] | None:
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

    with Image.open(io.BytesIO(data)) as opened:
        image = opened.convert(mode)
        if size:
            image = image.resize((size, size))
        array = np.asarray(image, dtype=np.float32) / 255.0
    channels_last = array[..., None] if array.ndim == 2 else array  # one channel ("L"): H x W
    return torch.from_numpy(channels_last.transpose(2, 0, 1).copy())
