"""Checksums of checkpoints: a SHA-256 of a file's bytes appended to it as a trailer, and of
each file of a sharded checkpoint's folder kept in its ``checkpoint.pt``; verified on load.

A file tandem saves ends with :data:`MAGIC` and the hex digest of every byte before it (79
bytes that ``torch.load`` and zip readers skip: a zip is read from its central directory).
The digest is computed as the bytes are written (:class:`HashingWrites`, on a second thread, so
that hashing overlaps the disk) and checked before the file is read (:func:`verify_file`).
A sharded folder's files are hashed after DCP has written them, each rank a share
(:func:`folder_sums`), and every rank checks them all before it loads (:func:`verify_folder`).

Usage::

    writer = HashingWrites(fd); torch.save(state, writer); writer.finish()   # appends the trailer
    verify_file(path)               # True, False (corrupt) or None (no trailer: an older file)
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tandem.output_files import write_all

MAGIC = b"\nTANDEM-SHA256 "
"""What a checksum trailer starts with; the 64 hex digits of the digest follow."""
TRAILER_BYTES = len(MAGIC) + 64
CHUNK_BYTES = 1 << 20
"""How much of a file is read at a time to hash it (a buffer this size: no more memory)."""


class WholeWrites:
    """A file for ``torch.save`` whose writes are never short and whose failure is kept: torch
    reports a short or failed write as ``RuntimeError: [enforce fail at inline_container.cc]``,
    with neither the path nor the cause; this keeps the ``OSError`` (``ENOSPC``) it is."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        try:
            write_all(self.fd, view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        return view.nbytes

    def flush(self) -> None:
        """Nothing is buffered here."""

    def finish(self) -> None:
        """After the last write: nothing to add."""

    def close(self) -> None:
        """Nothing to release."""


class HashingWrites(WholeWrites):
    """:class:`WholeWrites` that hash what they write; :meth:`finish` appends the checksum
    trailer. hashlib lets go of the GIL on large buffers, so each buffer is hashed on a thread
    while it is written (this writer's own thread, which no forked process inherits)."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self.digest = hashlib.sha256()
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-checksum")

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        hashed: Future[None] = self.hasher.submit(self.digest.update, view)
        try:
            return super().write(view)
        finally:
            hashed.result()

    def finish(self) -> None:
        """Append the trailer: :data:`MAGIC` and the digest of everything written."""
        write_all(self.fd, MAGIC + self.digest.hexdigest().encode())

    def close(self) -> None:
        """End the hashing thread."""
        self.hasher.shutdown()


def file_digest(path: Path, size: int) -> str:
    """The SHA-256 hex digest of the first ``size`` bytes of ``path``."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        left = size
        while left:
            count = file.readinto(view[:min(left, CHUNK_BYTES)])
            if not count:
                break  # shorter than it was a moment ago: the digest will not match
            digest.update(view[:count])
            left -= count
    return digest.hexdigest()


def verify_file(path: Path) -> bool | None:
    """Whether ``path``'s bytes match the checksum trailer it ends with; None when it has none
    (a file of a tandem before checksums, or one whose trailer itself was damaged: the
    checkpoint it holds says which, :func:`tandem.runtime.checkpoint.load_checkpoint`)."""
    size = path.stat().st_size
    if size < TRAILER_BYTES:
        return None
    with open(path, "rb") as file:
        file.seek(size - TRAILER_BYTES)
        trailer = file.read(TRAILER_BYTES)
    if not trailer.startswith(MAGIC):
        return None
    return file_digest(path, size - TRAILER_BYTES) == trailer[len(MAGIC):].decode("ascii",
                                                                                 "replace")


def folder_sums(folder: Path, rank: int, world: int) -> dict[str, str]:
    """The digests of this ``rank``'s share (every ``world``-th file, by name) of the files in
    a sharded checkpoint's ``folder``, by name; the shares of all ranks cover the folder."""
    files = sorted(path for path in folder.iterdir() if path.is_file())
    return {path.name: file_digest(path, path.stat().st_size)
            for path in files[rank::world]}


def merged_sums(ranks: list[Any]) -> dict[str, str]:
    """Every rank's :func:`folder_sums`, taken out of their gathered parts (``"sums"``)."""
    sums: dict[str, str] = {}
    for part in ranks:
        if isinstance(part, dict):
            sums.update(part.pop("sums", {}))
    return sums


def verify_folder(folder: Path, sums: dict[str, str] | None) -> str | None:
    """The name of the first file of ``folder`` that is missing or does not match ``sums``
    (None if all match, or without sums: a checkpoint of a tandem before checksums)."""
    for name, expected in sorted((sums or {}).items()):
        path = folder / name
        if not path.is_file() or file_digest(path, path.stat().st_size) != expected:
            return name
    return None
