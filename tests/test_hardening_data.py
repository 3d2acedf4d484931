"""The data side fails in one line naming the path and the cause: ``tandem pack`` onto a full
disk, ``--cache-dir`` that cannot be written or fills up, an inconsistent shard index, a corrupt
shard (read here, through a cache or by a loader process), a folder that cannot be listed and a
user's dataset that raises; none leaves a partial file that a later run could take for whole."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tandem.data.folder import load_folder
from tandem.data.info import DataInfo
from tandem.data.loader import LoaderDied, PlannedLoader
from tandem.data.samples import DatasetSamples, samples_of
from tandem.data.shards import INDEX_NAME, ShardSamples, load_shards, read_index
from tandem.data.storage import CachedStorage, Storage
from tandem.errors import UsageError, WorkerFailure
from tandem.output_files import os_error_line, write_failure
from tests import user_data
from tests.conftest import run_here
from tests.test_hardening_resume import SOURCE
from tests.test_hardening_waits import finish, start

NO_SPACE = "No space left on device"
READ_ONLY = "Read-only file system"
TRAIN = ("train", "--nproc", "1", "--steps", "12", "--batch-size", "64", "--no-progress")


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits packed by ``tandem pack`` (1438 training samples in one shard)."""
    out = tmp_path_factory.mktemp("digits") / "shards"
    result = run_here("pack", "digits", "--out", str(out), "--no-progress")
    assert result.returncode == 0, result.stderr
    return out


def corrupted(shards: Path, target: Path, first: int) -> Path:
    """A copy of ``shards`` whose training samples from ``first`` on have damaged tar headers."""
    shutil.copytree(shards, target)
    tar = target / "train-000000.tar"
    offsets = json.loads((target / INDEX_NAME).read_text())["splits"]["train"][0]["offsets"]
    data = bytearray(tar.read_bytes())
    for offset in offsets[first:-1]:
        data[offset + 100:offset + 108] = b"XXXXXXXX"  # the mode field: the checksum fails
    tar.write_bytes(bytes(data))
    return target


# -- tandem pack --------------------------------------------------------------------------------


@pytest.fixture
def fills_after(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """``fills_after(n)``: the disk is full once the shards being packed hold ``n`` bytes (the
    tar writer's own writes fail with ``ENOSPC``, as a full file system's do)."""
    real = tarfile.TarFile.addfile

    def fill(room: int) -> None:
        used = [0]

        def addfile(self: tarfile.TarFile, member: tarfile.TarInfo, fileobj: Any = None) -> None:
            used[0] += tarfile.BLOCKSIZE + member.size  # its header and its data
            if used[0] > room:
                raise OSError(errno.ENOSPC, NO_SPACE)
            real(self, member, fileobj)

        monkeypatch.setattr(tarfile.TarFile, "addfile", addfile)

    return fill


@pytest.mark.pure
@pytest.mark.parametrize("existing", [False, True], ids=["new out", "existing out"])
def test_pack_onto_a_full_disk_is_one_line_and_leaves_nothing(
        tmp_path: Path, fills_after: Callable[[int], None], existing: bool) -> None:
    """Was: 26 lines (``OSError: [Errno 28]``), and ``train-000000.tar.partial`` and
    ``index.json.partial`` left behind."""
    out = tmp_path / "shards"
    if existing:
        out.mkdir()
    fills_after(1 << 20)
    result = run_here("pack", "digits", "--out", str(out), "--shard-size", "512KB",
                      "--no-progress")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tandem pack: cannot write {out / 'train-000002.tar'}: {NO_SPACE}; free space on its "
        f"file system, or write elsewhere"]  # the two shards before it, whole, are removed too
    assert (list(out.iterdir()) == []) if existing else not out.exists()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``tmpfs("size=1m")``: a real small (or ``ro``) file system (needs root and a kernel that
    lets this process mount; the simulated failures above hold without)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        point = tmp_path / f"fs{len(mounted)}"
        point.mkdir()
        if os.geteuid() != 0 or subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root; the simulated failures hold")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.mark.cli
def test_pack_onto_a_real_full_disk_and_a_read_only_cache_dir(
        tmpfs: Callable[..., Path], shards: Path) -> None:
    """A 1 MiB tmpfs for ``tandem pack`` (3.7 MB of digits), a read-only one for
    ``--cache-dir`` (was: 39 lines ending in ``OSError: [Errno 30]``)."""
    full = tmpfs("size=1m")
    result = run_here("pack", "digits", "--out", str(full / "shards"), "--no-progress")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"tandem pack: cannot write {full / 'shards' / 'train-000000.tar'}: {NO_SPACE}; free "
        f"space on its file system, or write elsewhere"]
    assert list(full.iterdir()) == []
    read_only = tmpfs("size=1m,ro")
    result = run_here(*TRAIN, "--data", f"shards:{shards}", "--cache-dir",
                      str(read_only / "cache"), "--out", str(full / "run"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tandem train: error: --cache-dir {read_only / 'cache'} cannot be written "
        f"({READ_ONLY}); give a directory on a writable local disk, or drop --cache-dir"]


# -- --cache-dir --------------------------------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(("code", "cause"), [(errno.EROFS, READ_ONLY),
                                             (errno.EACCES, "Permission denied")])
def test_a_cache_dir_that_cannot_be_written_is_refused_before_reading(
        shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int,
        cause: str) -> None:
    cache = tmp_path / "cache"
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self == cache:
            raise OSError(code, cause, str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(UsageError) as refused:
        load_shards(f"shards:{shards}", cache_dir=str(cache))
    assert str(refused.value) == (f"--cache-dir {cache} cannot be written ({cause}); give a "
                                  f"directory on a writable local disk, or drop --cache-dir")


@pytest.mark.pure
def test_a_cache_that_fills_up_keeps_no_partial_copy(
        shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def half_then_full(source: Any, target: Any, length: int = 0) -> None:
        target.write(source.read(1000))
        raise OSError(errno.ENOSPC, NO_SPACE)

    cache = tmp_path / "cache"
    monkeypatch.setattr(shutil, "copyfileobj", half_then_full)
    storage = CachedStorage(Storage(), cache)
    shard = shards / "train-000000.tar"
    with pytest.raises(WorkerFailure) as failed:
        storage.open(shard)
    assert str(failed.value) == (f"cannot write {storage.copy_of(shard)}: {NO_SPACE}; free "
                                 f"space on its file system, or write elsewhere")
    assert list(cache.iterdir()) == []


# -- the index and the shards -------------------------------------------------------------------


def _edit(field: str) -> Callable[[dict[str, Any]], Any]:
    first = "splits", "train", 0

    def entry(doc: dict[str, Any]) -> dict[str, Any]:
        return doc[first[0]][first[1]][first[2]]  # type: ignore[no-any-return]

    return {
        "num_classes 0": lambda doc: doc["info"].update(num_classes=0),
        "input shape with 0": lambda doc: doc["info"].update(input_shape=[1, 0, 8]),
        "unknown task": lambda doc: doc["info"].update(task="regress"),
        "offsets out of order": lambda doc: entry(doc)["offsets"].__setitem__(5, 10),
        "offsets beyond the shard": lambda doc: entry(doc).update(bytes=4096),
        "samples and offsets disagree": lambda doc: entry(doc).update(samples=3),
        "a path for a name": lambda doc: entry(doc).update(name="../train-000000.tar"),
        "bytes not a number": lambda doc: entry(doc).update(bytes="many"),
        "unknown decoding": lambda doc: doc.update(decode={"kind": "video"}),
        "missing splits": lambda doc: doc.pop("splits"),
    }[field]


INDEX_CASES = {
    "num_classes 0": "DataInfo num_classes 0 must be a whole number of at least 1 (labels, or "
                     "the vocabulary size)",
    "input shape with 0": "DataInfo input_shape (1, 0, 8) is not a tuple of sizes of at least 1",
    "unknown task": "DataInfo task 'regress' is not one of classify, lm",
    "offsets out of order": "shard train-000000.tar's sample offsets do not run up from 0 within "
                            "its 2949120 bytes",
    "offsets beyond the shard": "shard train-000000.tar's sample offsets do not run up from 0 "
                                "within its 4096 bytes",
    "samples and offsets disagree": "shard train-000000.tar lists 3 samples, its offsets 1438",
    "a path for a name": "shard name '../train-000000.tar' is not a file name",
    "bytes not a number": "bytes 'many' is not a whole number",
    "unknown decoding": "decode {'kind': 'video'} is not one tandem pack writes",
    "missing splits": "no 'splits' entry",
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_an_inconsistent_index_is_named_before_any_sample_is_read(
        shards: Path, tmp_path: Path, case: str) -> None:
    """``num_classes: 0`` was a 27-line ``ZeroDivisionError`` from the first loss."""
    root = tmp_path / "shards"
    root.mkdir()
    for tar in shards.glob("*.tar"):
        (root / tar.name).symlink_to(tar)
    doc = json.loads((shards / INDEX_NAME).read_text())
    _edit(case)(doc)
    (root / INDEX_NAME).write_text(json.dumps(doc))
    with pytest.raises(UsageError) as refused:
        read_index(root, spec=f"shards:{root}")
    message = str(refused.value)
    assert message.startswith(f"--data shards:{root}: {root / INDEX_NAME} is corrupt or not an "
                              f"index of tandem pack ({INDEX_CASES[case]}")
    assert message.endswith("; write the shards again with tandem pack")


@pytest.mark.multiprocess
def test_a_num_classes_0_index_stops_the_run_before_it_starts(shards: Path,
                                                              tmp_path: Path) -> None:
    root = tmp_path / "shards"
    shutil.copytree(shards, root)
    doc = json.loads((root / INDEX_NAME).read_text())
    doc["info"]["num_classes"] = 0
    (root / INDEX_NAME).write_text(json.dumps(doc))
    result = run_here(*TRAIN, "--data", f"shards:{root}", "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"tandem train: error: --data shards:{root}: {root / INDEX_NAME} is corrupt or not an "
        f"index of tandem pack ({INDEX_CASES['num_classes 0']}); write the shards again with "
        f"tandem pack"]


@pytest.mark.pure
def test_a_data_info_is_checked_where_it_is_made() -> None:
    assert DataInfo(task="lm", input_shape=[16], num_classes=50).input_shape == (16,)
    for bad in ({"num_classes": 0}, {"num_classes": 2.5}, {"input_shape": (1, -1)},
                {"task": "segment"}):
        with pytest.raises(UsageError, match="DataInfo"):
            DataInfo(**{"task": "classify", "input_shape": (1, 8, 8), "num_classes": 10, **bad})


@pytest.mark.pure
def test_a_corrupt_shard_is_named_with_the_samples_and_its_cached_copy(
        shards: Path, tmp_path: Path) -> None:
    root = corrupted(shards, tmp_path / "shards", first=700)
    index = read_index(root, spec=f"shards:{root}")
    samples = ShardSamples(index, "train", storage=Storage(), shuffle=1)
    samples.take(torch.arange(0, 700))
    with pytest.raises(UsageError) as direct:
        samples.take(torch.tensor([705]))
    assert str(direct.value) == (f"shard train-000000.tar in {root} is truncated or corrupt "
                                 f"(sample 705 unreadable); copy it again or pack again")
    storage = CachedStorage(Storage(), tmp_path / "cache")
    cached = ShardSamples(index, "train", storage=storage, shuffle=1)
    with pytest.raises(UsageError) as through_cache:
        cached.take(torch.arange(690, 720))
    copy = storage.copy_of(root / "train-000000.tar")
    assert str(through_cache.value) == (
        f"shard train-000000.tar in {root} is truncated or corrupt (samples 690..719 unreadable, "
        f"read from its copy {copy}); copy it again or pack again, then remove {copy}")


@pytest.mark.pure
def test_a_shard_that_cannot_be_opened_is_named(shards: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    index = read_index(shards, spec=f"shards:{shards}")
    samples = ShardSamples(index, "train", storage=Storage(), shuffle=1)

    def denied(self: Storage, path: Path) -> Any:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(Storage, "open", denied)
    with pytest.raises(UsageError, match=rf"^shard train-000000.tar in {shards} cannot be read "
                                         rf"\(Permission denied\); make it readable"):
        samples.take(torch.arange(4))
    with pytest.raises(UsageError, match=rf"^--data shards:{shards}: cannot read "
                                         rf"{shards / INDEX_NAME} \(Permission denied\); make "
                                         rf"it readable$"):
        read_index(shards, spec=f"shards:{shards}")


@pytest.mark.cli
def test_a_corrupt_shard_read_by_a_loader_process_is_one_line_naming_it(
        shards: Path, tmp_path: Path) -> None:
    """The issue's case, through the command line: was ``Caught UsageError in DataLoader worker
    process 0.`` (no shard, no cause, no fix). The launching process's checks read the first
    batch (the shuffle buffer's thousand samples and more); the loader process reaches the
    samples from 1200 on a few steps in."""
    root = corrupted(shards, tmp_path / "shards", first=1200)
    process, mark = start(*TRAIN, "--data", f"shards:{root}", "--loader-workers", "1",
                          "--out", str(tmp_path / "run"), env=SOURCE)
    code, _, err = finish(process, mark, timeout_s=120)
    assert code == 2
    line, = err.splitlines()
    sample = int(line.partition("(sample ")[2].partition(" ")[0])  # the shuffle buffer's pick
    assert sample >= 1200 and line == (
        f"tandem train: error: shard train-000000.tar in {root} is truncated or corrupt "
        f"(sample {sample} unreadable); copy it again or pack again")


# -- a folder of images, a user's dataset ------------------------------------------------------


@pytest.mark.pure
def test_a_folder_that_cannot_be_listed_is_named(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from PIL import Image

    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for index in range(3):
            Image.new("L", (4, 4), index * 40).save(tmp_path / label / f"{index}.png")
    locked: list[Path] = []

    def denied(real: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def listing(path: Any) -> Any:  # as for another user's folder without read permission
            if Path(path) in locked:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path)
        return listing

    monkeypatch.setattr(os, "scandir", denied(os.scandir))
    monkeypatch.setattr(os, "listdir", denied(os.listdir))
    for folder in (tmp_path / "b", tmp_path):  # a class's folder (was: "has no images"), all
        locked[:] = [folder]
        with pytest.raises(UsageError) as refused:
            load_folder(f"folder:{tmp_path}")
        assert str(refused.value) == (f"--data folder:{tmp_path}: cannot list {folder} "
                                      f"(Permission denied); make it readable")


@pytest.mark.pure
def test_a_users_dataset_that_raises_is_named_with_its_item() -> None:
    samples = DatasetSamples(user_data.MissingFiles("train", at=5), what="the training data")
    samples.take(torch.arange(5))
    with pytest.raises(UsageError) as failed:
        samples.take(torch.tensor([1, 7]))
    assert str(failed.value) == (
        "the training data: MissingFiles[7] raised FileNotFoundError: [Errno 2] No such file or "
        "directory: '/data/digits/7.png'; fix the dataset or the files it reads")

    class NoLength(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(UsageError, match=r"^the test data: len\(NoLength\) raised OSError: "
                                         r"\[Errno 5\] Input/output error; fix"):
        samples_of(NoLength(), what="the test data")

    def stream() -> Iterator[tuple[torch.Tensor, int]]:
        yield torch.zeros(2), 0
        raise ValueError("bad record 1")

    with pytest.raises(UsageError, match=r"^the training data: iter\(generator\) raised "
                                         r"ValueError: bad record 1; fix"):
        samples_of(stream(), what="the training data")


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["launcher", "worker"])
def test_a_users_dataset_failing_before_the_start_and_in_a_worker(tmp_path: Path,
                                                                   where: str) -> None:
    """Was a 60-line traceback from the launching process (counting the classes reads every
    target: ``info=False``); in a worker (the first batch holds an item from 1000 on), the same
    line."""
    data = ("tests.user_data:missing_files:at=1200,info=False" if where == "launcher" else
            "tests.user_data:missing_files:at=1000")
    result = run_here(*TRAIN, "--data", data, "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    line, = result.stderr.splitlines()
    item = int(line.partition("MissingFiles[")[2].partition("]")[0])
    assert line == (f"tandem train: error: the training data ({data}): MissingFiles[{item}] "
                    f"raised FileNotFoundError: [Errno 2] No such file or directory: "
                    f"'/data/digits/{item}.png'; fix the dataset or the files it reads")
    assert item == 1200 if where == "launcher" else item >= 1000


# -- loader processes ---------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_what_fails_in_a_loader_process_comes_back_as_itself(shards: Path,
                                                              tmp_path: Path) -> None:
    """A corrupt shard and a failing dataset as their own one-line errors (was: ``Caught
    UsageError in DataLoader worker process 0.`` and PyTorch's traceback of it), a loader
    process that dies as :class:`LoaderDied` naming it."""
    root = corrupted(shards, tmp_path / "shards", first=100)
    index = read_index(root, spec=f"shards:{root}")
    cases: list[tuple[Any, type[Exception], str]] = [
        (ShardSamples(index, "train", storage=Storage(), shuffle=1), UsageError,
         rf"^shard train-000000.tar in {root} is truncated or corrupt \(samples 96..111 "
         rf"unreadable\); copy it again or pack again$"),
        (DatasetSamples(user_data.MissingFiles("train", at=100), what="the training data"),
         UsageError, r"^the training data: MissingFiles\[100\] raised FileNotFoundError: "),
        (DatasetSamples(user_data.KilledInLoader(at=100), what="the training data"),
         LoaderDied, r"^its loader process \(pid \d+, --loader-workers\) died before handing "
                     r"over a batch: killed, or out of memory$"),
    ]
    plan = [torch.arange(start, start + 16) for start in range(0, 160, 16)]
    for samples, kind, message in cases:
        loader = PlannedLoader(samples, plan, workers=1, prefetch=1)
        for indices in plan[:6]:
            assert loader.take(indices) is not None
        with pytest.raises(kind, match=message):
            for indices in plan[6:]:
                loader.take(indices)
        assert loader.batches is None  # its processes are stopped


# -- writes the command line names ----------------------------------------------------------


@pytest.mark.pure
@pytest.mark.parametrize(("code", "cause", "fix"), [
    (errno.ENOSPC, NO_SPACE, "free space on its file system, or write elsewhere"),
    (errno.EROFS, READ_ONLY, "its file system is mounted read-only: write elsewhere"),
    (errno.EACCES, "Permission denied", "make it writable for this user, or write elsewhere"),
])
def test_a_failed_write_says_what_to_do_by_its_cause(code: int, cause: str, fix: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each writer's line (checkpoints, logs, shards, cached copies) and the command line's own
    for an ``OSError`` no writer named (a figure that matplotlib writes, say)."""
    assert str(write_failure("/x/final.pt", OSError(code, cause))) == (
        f"cannot write /x/final.pt: {cause}; {fix}")
    from tandem.commands import export

    def fails(args: Any) -> int:
        raise OSError(code, cause, "/x/final.pt")

    monkeypatch.setattr(export, "run", fails)
    result = run_here("export", "/x")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"tandem export: {os_error_line(OSError(code, cause, '/x/final.pt'))}"]
    assert os_error_line(OSError(code, cause, "/x/final.pt")).startswith(f"/x/final.pt: {cause}; ")
