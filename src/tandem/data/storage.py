"""Where data files are read from: the local file system, an emulated busy shared file system
(a latency per file open and a bandwidth cap), and a local cache of files from a slow source.

The emulator exists to measure the small-files problem on one machine: a shared file system
serves each open after a round trip to its metadata server, so reading many small files is
bound by opens per second, not by bytes per second. ``EmulatedStorage(open_latency_s=0.002,
bandwidth_Bps=200e6)`` makes every open wait 2 ms and every read wait its bytes at 200 MB/s
(per reading process: each rank has its own share of the file system's bandwidth).

Usage::

    storage = EmulatedStorage(open_latency_s=0.002, bandwidth_Bps=200e6)
    with storage.open(path) as f:
        f.seek(offset)
        data = f.read(size)
    cached = CachedStorage(storage, Path("/tmp/cache"))   # one slow copy per file, then local
"""

from __future__ import annotations

import dataclasses
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, cast

from tandem.errors import UsageError
from tandem.output_files import cause, write_failure

COPY_CHUNK = 1 << 20
"""Bytes per read when a file is copied into a cache."""
SLACK_S = 0.001
"""How far an emulated read may run ahead of its bandwidth before it waits."""


@dataclasses.dataclass(frozen=True, slots=True)
class Storage:
    """The local file system, read without delay (also the base of the others)."""

    def open(self, path: Path) -> BinaryIO:
        """``path`` opened for reading bytes."""
        return open(path, "rb")

    def describe(self) -> str:
        """One phrase for messages and summaries."""
        return "local files"

    def copy_of(self, path: Path) -> Path | None:
        """The local copy ``path`` is read from, where it is not read itself."""
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class EmulatedStorage(Storage):
    """A busy shared file system: every open waits ``open_latency_s``, every read waits its
    bytes at ``bandwidth_Bps`` (0: no cap)."""

    open_latency_s: float = 0.0
    bandwidth_Bps: float = 0.0

    def __post_init__(self) -> None:
        if self.open_latency_s < 0 or self.bandwidth_Bps < 0:
            raise ValueError(f"the emulated file system needs a latency and a bandwidth of at "
                             f"least 0 (got {self.open_latency_s} s, {self.bandwidth_Bps} B/s)")

    def open(self, path: Path) -> BinaryIO:
        if self.open_latency_s:
            time.sleep(self.open_latency_s)
        handle = open(path, "rb")
        if not self.bandwidth_Bps:
            return handle
        return cast(BinaryIO, _Throttled(handle, self.bandwidth_Bps))  # read, seek, tell, close

    def describe(self) -> str:
        cap = f"{self.bandwidth_Bps / 1e6:g} MB/s" if self.bandwidth_Bps else "no bandwidth cap"
        return f"an emulated shared file system ({self.open_latency_s * 1e3:g} ms per open, {cap})"


class _Throttled(io.RawIOBase):
    """A file whose reads take their bytes over the bandwidth, shared by all the files this
    process reads: a clock of when the bytes read so far are through runs ahead of the real
    one, and a read waits once it is more than ``SLACK_S`` ahead (sleeping for every small read
    would charge the sleep's own overhead)."""

    through_at = 0.0
    """When this process's reads so far are through (a class attribute: one per process)."""

    def __init__(self, handle: BinaryIO, bandwidth_Bps: float) -> None:
        super().__init__()
        self.handle, self.bandwidth_Bps = handle, bandwidth_Bps

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self.handle.seek(offset, whence)

    def tell(self) -> int:
        return self.handle.tell()

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        count = self.handle.readinto(buffer) or 0  # type: ignore[attr-defined]
        now = time.perf_counter()
        through_at = max(_Throttled.through_at, now) + count / self.bandwidth_Bps
        _Throttled.through_at = through_at
        if through_at - now > SLACK_S:
            time.sleep(through_at - now)
        return count

    def close(self) -> None:
        self.handle.close()
        super().close()


@dataclasses.dataclass(frozen=True, slots=True)
class CachedStorage(Storage):
    """Files of ``source`` copied whole to ``cache_dir`` the first time they are opened, and read
    from there after (a copy is checked by size; writers on one machine do not collide). A copy
    that fails (a full disk) leaves no partial file and stops the run in one line naming it."""

    source: Storage
    cache_dir: Path

    def open(self, path: Path) -> BinaryIO:
        local = self.copy_of(path)
        expected = path.stat().st_size
        if not (local.is_file() and local.stat().st_size == expected):
            partial = local.with_name(f"{local.name}.{os.getpid()}.partial")
            try:
                local.parent.mkdir(parents=True, exist_ok=True)
                with self.source.open(path) as src, open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, COPY_CHUNK)
                os.replace(partial, local)
            except OSError as exc:
                partial.unlink(missing_ok=True)
                if exc.filename is not None and Path(exc.filename) == path:  # the source's
                    raise
                raise write_failure(local, exc) from None
        return open(local, "rb")

    def copy_of(self, path: Path) -> Path:
        return self.cache_dir / _cache_name(path)

    def describe(self) -> str:
        return f"{self.source.describe()}, cached in {self.cache_dir}"


def check_cache_dir(cache_dir: Path) -> None:
    """One line, before any shard is read, if ``--cache-dir`` cannot be made or written (a
    read-only file system, no permission)."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".tandem-check-"):
            pass
    except OSError as exc:
        raise UsageError(f"--cache-dir {cache_dir} cannot be written ({cause(exc)}); give a "
                         f"directory on a writable local disk, or drop --cache-dir") from None


def _cache_name(path: Path) -> str:
    """A file name in the cache unique to ``path`` (its parent folder's name and a hash of the
    full path, so shards of two datasets never share a cached copy)."""
    import hashlib

    resolved = str(path.resolve())
    digest = hashlib.sha1(resolved.encode()).hexdigest()[:12]
    return f"{path.parent.name}-{digest}-{path.name}"
