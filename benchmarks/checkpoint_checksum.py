"""What the checksums of checkpoints cost: saving and loading a state of ``--mb`` megabytes
(float32 tensors of 4 MB, as a model's and optimizer's state) with and without the SHA-256
trailer (:mod:`tandem.runtime.checksum`), each the best of ``--repeats``, in one process.

- save: ``save_atomic`` (write, fsync, rename) against ``save_checkpoint`` (the same, hashing
  every buffer on a second thread as it is written, the trailer appended, the file it
  replaces kept as ``previous/`` by a hard link);
- load: ``torch.load`` against ``load_checkpoint`` (the file hashed, then read);
- a sharded checkpoint's folder of the same bytes in 4 files: hashing it after DCP wrote it
  (``folder_sums``, one rank alone; each of N ranks hashes a 1/N share) and checking it before
  a load (``verify_folder``, every rank all of it).

Prints a table, then one JSON object on the last line.

    .venv/bin/python benchmarks/checkpoint_checksum.py [--mb 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.runtime.checkpoint import CHECKPOINT_VERSION, load_checkpoint, save_atomic, \
    save_checkpoint
from tandem.runtime.checksum import folder_sums, verify_folder


def best_of(repeats: int, work: Callable[[], object]) -> tuple[float, float]:
    """The shortest of ``repeats`` timings of ``work()``: wall seconds, and CPU seconds of this
    process (all its threads: what the work costs on a machine shared with others)."""
    walls, cpus = [], []
    for _ in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        work()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tensors = {f"t{i}": torch.randn(1 << 20) for i in range(args.mb // 4)}
    state = {"version": CHECKPOINT_VERSION, "step": 1, "fingerprint": {}, "model": tensors}
    folder = Path(tempfile.mkdtemp(prefix="tandem-checksum-"))
    try:
        plain, summed = folder / "plain" / "checkpoint.pt", folder / "summed" / "checkpoint.pt"
        plain.parent.mkdir()
        summed.parent.mkdir()
        r = args.repeats
        figures = {
            "save_s": best_of(r, lambda: save_atomic(state, plain)),
            "save_checksum_s": best_of(r, lambda: save_checkpoint(state, summed, resume=None)),
            "load_s": best_of(r, lambda: torch.load(plain, weights_only=False)),
            "load_checksum_s": best_of(r, lambda: load_checkpoint(summed, {})),
        }
        shards = folder / "checkpoint-1.dcp"
        shards.mkdir()
        data = plain.read_bytes()
        quarter = len(data) // 4 + 1
        for rank in range(4):  # four ranks' files of the same bytes
            (shards / f"__{rank}_0.distcp").write_bytes(data[rank * quarter:(rank + 1) * quarter])
        del data
        sums = folder_sums(shards, 0, 1)
        figures["folder_sums_one_rank_s"] = best_of(r, lambda: folder_sums(shards, 0, 1))
        figures["verify_folder_s"] = best_of(r, lambda: verify_folder(shards, sums))
        folder_mb = plain.stat().st_size / 1e6
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    shown: dict[str, float] = {"mb": args.mb, "folder_mb": round(folder_mb, 1)}
    for key, (wall, cpu) in figures.items():
        shown[key] = round(wall, 3)
        shown[key[:-2] + "_cpu_s"] = round(cpu, 3)
    print(f"{'':24}{'plain':>10}{'checksum':>10}{'overhead':>10}  (wall; CPU)", file=sys.stderr)
    for what in ("save", "load"):
        for unit in ("s", "cpu_s"):
            base, more = shown[f"{what}_{unit}"], shown[f"{what}_checksum_{unit}"]
            label = f"{what} {args.mb} MB" + (" CPU" if unit == "cpu_s" else "")
            print(f"{label:24}{base:>9.3f}s{more:>9.3f}s{more - base:>+9.3f}s", file=sys.stderr)
    print(f"a {shown['folder_mb']} MB DCP folder: hashed by one rank in "
          f"{shown['folder_sums_one_rank_s']:.3f} s (each of N ranks: 1/N of it), verified in "
          f"{shown['verify_folder_s']:.3f} s", file=sys.stderr)
    print(json.dumps(shown))


if __name__ == "__main__":
    main()
