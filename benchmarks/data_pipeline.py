"""The small-files problem and its fix: 4 ranks read the same samples as small image files (each
opened alone, in random order: the reference) and as tar shards (``tandem pack``), through the
storage emulator of a busy shared file system (2 ms per open, 200 MB/s per process), then train
on the shards and measure the part of each step spent waiting for data.

The samples are the 1,797 real 8x8 digits written as PNG files (a few hundred bytes each, like
the thumbnails, audio clips and texts of real many-small-files datasets). Both readers decode
the PNGs the same way (:func:`tandem.data.shard_decode.decode_image`); the throughput is given for
reading each sample's bytes (the storage access the two differ in: ``shards_vs_files``) and
with decoding (CPU work the 4 ranks share this machine's 1.25 cores for). Training uses the emulated model (its layers sleep their time, so the 4
ranks and their loader processes do not compete for this machine's cores with real compute).

Prints a table, then one JSON object on the last line (``shards_vs_files``,
``data_wait_fraction``, ...).

    .venv/bin/python benchmarks/data_pipeline.py [--open-ms 2] [--bandwidth 200MB/s]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
BATCH = 64


def write_pngs(root: Path) -> list[tuple[Path, int]]:
    """The digits as 8-bit grayscale PNG files, one folder per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    raw = load_digits()
    files = []
    for index, (image, label) in enumerate(zip(raw.images, raw.target)):
        folder = root / f"digit{label}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{index:04d}.png"
        Image.fromarray((image * 255 / 16).astype(np.uint8), mode="L").save(path)
        files.append((path, int(label)))
    return files


def read_files(rank: int, files: list[tuple[str, int]], open_s: float, bandwidth: float,
               decode: bool, results: dict) -> None:
    """Rank ``rank``'s share of a random order of the files, each opened (and decoded) alone."""
    from tandem.data.shard_decode import decode_image
    from tandem.data.storage import EmulatedStorage

    storage = EmulatedStorage(open_latency_s=open_s, bandwidth_Bps=bandwidth)
    order = np.random.default_rng(0).permutation(len(files))
    mine = order[rank::RANKS]
    start = time.perf_counter()
    for number in mine:
        path, _ = files[number]
        with storage.open(Path(path)) as handle:
            data = handle.read()
        if decode:
            decode_image(data, mode="L", size=0)
    results[rank] = (len(mine), time.perf_counter() - start)


def read_shards(rank: int, spec: str, decode: bool, results: dict) -> None:
    """Rank ``rank``'s batches of one epoch of the shards, as training reads them (each sample's
    bytes, or decoded)."""
    from tandem.data.shards import load_shards

    data = load_shards(spec)
    sampler = data.train.batch_sampler(global_batch_size=BATCH, seed=0, partitions=RANKS)
    start = time.perf_counter()
    count = 0
    for step in range(sampler.batches_per_epoch):
        indices = sampler.local_indices(step, rank=rank, world_size=RANKS)
        count += (data.train.take(indices).size if decode
                  else len(data.train.read_parts(indices)))
    results[rank] = (count, time.perf_counter() - start, data.train.opens)


def in_parallel(target, args_of) -> dict:
    """Run ``target(rank, *args_of(rank), results)`` in ``RANKS`` processes at once."""
    context = multiprocessing.get_context("fork")
    with context.Manager() as manager:
        results = manager.dict()
        processes = [context.Process(target=target, args=(*args_of(rank), results))
                     for rank in range(RANKS)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        return dict(results)


def write_profile(path: Path, step_ms: float) -> None:
    """Four equal emulated layers taking ``step_ms`` per step (backward twice the forward)."""
    layer_ms = step_ms / 12
    layers = [{"name": f"layer{i}", "forward_s": layer_ms / 1e3, "backward_s": 2 * layer_ms / 1e3,
               "activation_bytes": 4096.0, "parameter_bytes": 4096.0} for i in range(4)]
    path.write_text(json.dumps({"schema_version": 1, "model": "data-bench", "batch_size": None,
                                "layers": layers}))


def train(spec: str, profile: Path, steps: int, loader_workers: int) -> dict:
    command = [sys.executable, "-m", "tandem", "train", "--model", f"emulated:profile={profile}",
               "--data", spec, "--nproc", str(RANKS), "--steps", str(steps), "--batch-size",
               str(BATCH), "--lr", "0.01", "--loader-workers", str(loader_workers), "--json",
               "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise SystemExit(f"training failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--open-ms", type=float, default=2.0, help="emulated ms per open")
    parser.add_argument("--bandwidth", default="200MB/s", help="emulated bandwidth per process")
    parser.add_argument("--shard-size", default="256KB", help="tandem pack --shard-size")
    parser.add_argument("--step-ms", type=float, default=40.0,
                        help="emulated compute per training step")
    parser.add_argument("--steps", type=int, default=80, help="training steps")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from tandem.cluster import parse_bandwidth, parse_size
    from tandem.data.pack import pack

    bandwidth = parse_bandwidth(args.bandwidth)
    open_s = args.open_ms / 1e3
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = write_pngs(root / "pngs")
        packed = pack(str(root / "pngs"), root / "shards",
                      shard_size=int(parse_size(args.shard_size)))
        spec = f"shards:{root / 'shards'}:open_latency={args.open_ms}ms,bandwidth={args.bandwidth}"
        listed = [(str(path), label) for path, label in files]

        rates: dict[str, dict[str, float]] = {}
        opens: list[int] = []
        for decode in (False, True):
            key = "decoded" if decode else "read"
            file_results = in_parallel(read_files,
                                       lambda r: (r, listed, open_s, bandwidth, decode))
            shard_results = in_parallel(read_shards, lambda r: (r, spec, decode))
            rates[key] = {
                "files": sum(n for n, _ in file_results.values())
                / max(t for _, t in file_results.values()),
                "shards": sum(n for n, _, _ in shard_results.values())
                / max(t for _, t, _ in shard_results.values()),
            }
            opens = [o for _, _, o in shard_results.values()]
        shard_samples = sum(n for n, _, _ in shard_results.values())

        profile = root / "profile.json"
        write_profile(profile, args.step_ms)
        loaded = train(spec, profile, args.steps, loader_workers=1)
        inline = train(spec, profile, args.steps, loader_workers=0)

    ratio = rates["read"]["shards"] / rates["read"]["files"]
    decoded_ratio = rates["decoded"]["shards"] / rates["decoded"]["files"]
    print(f"{RANKS} ranks, emulated shared file system: {args.open_ms:g} ms per open, "
          f"{args.bandwidth} per process; {len(files)} digit PNGs ({len(files) - shard_samples} "
          f"held out as the test split of the shards), packed into {packed.shards} shards "
          f"({packed.bytes / 1e6:.2f} MB)")
    print(f"{'reader':<32}{'read samples/s':>16}{'decoded samples/s':>19}{'opens/rank':>12}")
    print(f"{'small files, one by one (ref.)':<32}{rates['read']['files']:>16.0f}"
          f"{rates['decoded']['files']:>19.0f}{len(files) / RANKS:>12.0f}")
    print(f"{'shards (tandem)':<32}{rates['read']['shards']:>16.0f}"
          f"{rates['decoded']['shards']:>19.0f}{np.mean(opens):>12.1f}")
    print(f"shards vs files: {ratio:.1f}x reading, {decoded_ratio:.1f}x with decoding (the PNG "
          f"decode is CPU work the {RANKS} ranks share this machine's cores for)")
    print(f"training on the shards, {args.step_ms:g} ms emulated compute per step, "
          f"{args.steps} steps of {BATCH}: waiting for data "
          f"{loaded['data_wait_fraction']:.2%} of the step with 1 loader process per rank "
          f"(first batch {loaded['data_first_wait_s']:.2f} s), "
          f"{inline['data_wait_fraction']:.2%} reading in the step")
    print(json.dumps({
        "ranks": RANKS, "open_ms": args.open_ms, "bandwidth": args.bandwidth,
        "samples": len(files), "shards": packed.shards,
        "files_samples_per_s": round(rates["read"]["files"], 1),
        "shards_samples_per_s": round(rates["read"]["shards"], 1),
        "shards_vs_files": round(ratio, 2),
        "decoded_files_samples_per_s": round(rates["decoded"]["files"], 1),
        "decoded_shards_samples_per_s": round(rates["decoded"]["shards"], 1),
        "decoded_shards_vs_files": round(decoded_ratio, 2),
        "shard_opens_per_rank": float(np.mean(opens)),
        "data_wait_fraction": loaded["data_wait_fraction"],
        "data_wait_fraction_without_loader": inline["data_wait_fraction"],
        "first_batch_wait_s": loaded["data_first_wait_s"],
        "step_time_s": loaded["step_time_s"], "step_ms_emulated": args.step_ms,
    }))


if __name__ == "__main__":
    main()
