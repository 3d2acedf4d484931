"""Where gradient compression pays: measured encode/decode costs and the simulator on VGG-16.

(a) Times every codec's encode and decode on this machine, one CPU thread, doing the work the
runtime's DDP hook does per bucket (``tandem.compress.hooks``): encode every tensor (of summable
codecs after dividing it by the number of workers; error feedback included), serialize the
payloads of allgather codecs; then decode 16 workers' messages (allgather codecs: unpack and
average every message) or one summed message (fp16, bf16, randk). PowerSGD runs PyTorch's own
hook inside DDP on a one-process gloo group, timed from the hook's call until its future
completes, and that time is split 2 : 1 between encode and decode (two of its three matrix
products precede its last allreduce; on one process its rounds complete at once). The tensors
are VGG-16's 13 convolutions' weights and biases (14.7 M elements); the figures are nanoseconds
per gradient element (per element of one message for decoding).

(b) Simulates VGG-16's PipeDream profile (``tests/data/profiles/vgg16.graph.txt``, 128 samples
per minibatch) as data parallelism on 16 workers at 10 Gb/s and at 100 Gb/s (one flat level, no
latency), each worker computing one 128-sample minibatch, with each codec at the measured speed
and at 10x and 100x that speed. **The 10x and 100x rows are an assumption** (a GPU encodes much
faster than one CPU thread), not a measurement; the profile's compute times are a GPU's.

Prints the measured speeds, one table per bandwidth, then one JSON object on the last line.

    .venv/bin/python benchmarks/compression_sim.py [--repeats 5] [--messages 16] [--use-defaults]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tandem.cluster import flat_cluster
from tandem.spec.codec import ring_bytes
from tandem.planning.simulate.codecs import CodecSpeed, parse_codec
from tandem.planning.simulate.simulator import SimOptions, SimResult, data_parallel_plan, simulate
from tandem.profile import ModelProfile, load_profile

PROFILE = ROOT / "tests" / "data" / "profiles" / "vgg16.graph.txt"
PROFILE_BATCH = 128
WORKERS = 16
BANDWIDTHS = ("10Gb/s", "100Gb/s")
SPEEDUPS = (1.0, 10.0, 100.0)
"""Encode/decode speed relative to the measured one; 10 and 100 are assumptions (a GPU)."""

CODECS = ["fp16", "bf16", "qsgd:levels=7", "qsgd:levels=1,norm=max", "sign", "topk:ratio=0.01",
          "randk:ratio=0.01", "powersgd:rank=2"]

VGG16_CONVS = [(64, 3), (64, 64), (128, 64), (128, 128), (256, 128), (256, 256), (256, 256),
               (512, 256), (512, 512), (512, 512), (512, 512), (512, 512), (512, 512)]
"""``(out, in)`` channels of VGG-16's 3x3 convolutions."""


# -- (a) measured encode and decode -------------------------------------------------------------

def conv_shapes() -> list[tuple[int, ...]]:
    """Weights and biases of VGG-16's convolutions."""
    shapes: list[tuple[int, ...]] = []
    for out, inp in VGG16_CONVS:
        shapes += [(out, inp, 3, 3), (out,)]
    return shapes


def measure_codec(spec: str, messages: int, repeats: int) -> dict[str, float]:
    """Best-of-``repeats`` seconds of the hook's encode of one worker's gradients and of its
    decode of ``messages`` workers' messages (one summed message for summable codecs)."""
    import torch

    from tandem.compress import Codec, build_compression
    from tandem.compress.hooks import from_bytes, to_bytes

    codec = build_compression(spec)
    assert isinstance(codec, Codec)
    shapes = conv_shapes()
    keys = [f"p{index}" for index in range(len(shapes))]

    def gradients(seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return [torch.randn(shape, generator=generator) for shape in shapes]

    def encode(grads: list[torch.Tensor]) -> tuple[torch.Tensor, list[Any]]:
        if codec.summable:
            payloads = [codec.encode(g / messages, k) for g, k in zip(grads, keys)]
            return torch.cat([p[0].reshape(-1) for p in payloads]), [p[0].shape for p in payloads]
        payloads = [codec.encode(g, k) for g, k in zip(grads, keys)]
        template = [[(t.shape, t.dtype) for t in payload] for payload in payloads]
        return to_bytes([t for payload in payloads for t in payload]), template

    def decode(sent: list[torch.Tensor], template: list[Any], grads: list[torch.Tensor]) -> None:
        result = torch.empty(sum(g.numel() for g in grads))
        offset = 0
        if codec.summable:
            chunks = sent[0].split([shape.numel() for shape in template])
            for grad, key, chunk, shape in zip(grads, keys, chunks, template):
                mean = codec.decode([chunk.view(shape)], grad, key)
                result[offset:offset + grad.numel()].copy_(mean.reshape(-1))
                offset += grad.numel()
            return
        per_worker = [from_bytes(data, template) for data in sent]
        for index, (grad, key) in enumerate(zip(grads, keys)):
            mean = codec.decode_mean([worker[index] for worker in per_worker], grad, key)
            result[offset:offset + grad.numel()].copy_(mean.reshape(-1))
            offset += grad.numel()

    codec.start(0, messages)
    mine = gradients(0)
    sent = []
    for worker in range(1 if codec.summable else messages):
        flat, template = encode(mine if worker == 0 else gradients(worker))
        sent.append(flat)
    encode_s = decode_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        flat, template = encode(mine)
        encode_s = min(encode_s, time.perf_counter() - start)
        sent[0] = flat
        start = time.perf_counter()
        decode(sent, template, mine)
        decode_s = min(decode_s, time.perf_counter() - start)
    return {"encode_s": encode_s, "decode_s": decode_s, "messages": len(sent),
            "payload_bytes": float(sent[0].numel() * sent[0].element_size())}


def measure_powersgd(spec: str, repeats: int) -> dict[str, float]:
    """PyTorch's PowerSGD hook inside DDP on one gloo process: seconds per step from each
    bucket's hook call to its return (encode) and from there to its future's result (decode)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from tandem.compress import ByteMeter, build_compression
    from tandem.compress.powersgd import counting_powersgd_hook

    class Parameters(nn.Module):
        """VGG-16's convolution parameters; the backward fills their gradients."""

        def __init__(self) -> None:
            super().__init__()
            self.tensors = nn.ParameterList(nn.Parameter(torch.randn(s)) for s in conv_shapes())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum((p * x).sum() for p in self.tensors)  # type: ignore[return-value]

    spent = [0.0]

    def timed(state, bucket):  # type: ignore[no-untyped-def]
        # (No annotations: DDP checks a hook's as objects, and this module's are strings.)
        start = time.perf_counter()
        future = counting_powersgd_hook(state, bucket)
        future.wait()
        spent[0] += time.perf_counter() - start
        return future

    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        module = Parameters()
        ddp = DistributedDataParallel(module)
        options = spec if "start=" in spec else f"{spec},start=2"
        state, _ = build_compression(options).ddp_hook(module, ByteMeter(world_size=1))
        ddp.register_comm_hook(state, timed)
        x = torch.tensor(1.0)
        for _ in range(3):  # two plain steps, then the first compressed one (allocations)
            ddp(x).backward()
        best = float("inf")
        for _ in range(repeats):
            spent[0] = 0.0
            ddp(x).backward()
            best = min(best, spent[0])
    finally:
        dist.destroy_process_group()
    # On one process every allreduce completes at once, so the hook's callbacks run before it
    # returns. Two of its three matrix products (M Q, then M^T P) precede its last allreduce
    # and one (P Q^T) follows it: its time is split 2 : 1 between encode and decode.
    return {"encode_s": best * 2 / 3, "decode_s": best / 3, "messages": 1, "hook_s": best}


def measure(messages: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per codec spec: seconds and nanoseconds per element of encode and decode."""
    import torch

    torch.set_num_threads(1)
    numel = sum(math_prod(shape) for shape in conv_shapes())
    results = {}
    for spec in CODECS:
        if spec.startswith("powersgd"):
            timing = measure_powersgd(spec, repeats)
        else:
            timing = measure_codec(spec, messages, repeats)
        timing["encode_ns"] = timing["encode_s"] / numel * 1e9
        timing["decode_ns"] = timing["decode_s"] / numel / timing["messages"] * 1e9
        results[spec] = timing
        print(f"measured {spec:<24} encode {timing['encode_ns']:7.3f} ns/elem, decode "
              f"{timing['decode_ns']:7.3f} ns/elem/message ({timing['messages']:.0f} messages)",
              file=sys.stderr, flush=True)
    return results


def math_prod(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


# -- (b) the simulator --------------------------------------------------------------------------

def sync_bytes(profile: ModelProfile, spec: str | None) -> tuple[float, float]:
    """``(payload, wire)`` bytes one worker hands to collectives and sends (rings) per step."""
    from tandem.planning.simulate.costs import stage_costs

    plan = data_parallel_plan(profile, WORKERS)
    if spec is None:
        total = sum(layer.parameter_bytes for layer in profile.layers)
        return total, ring_bytes("allreduce", total, WORKERS)
    model = parse_codec(spec)
    payload = wire = 0.0
    for tensors in stage_costs(plan, profile)[0].bucket_tensors:
        for collective, num_bytes in model.rounds([max(1, round(b / 4)) for b in tensors]):
            payload += num_bytes
            wire += ring_bytes(collective, num_bytes, WORKERS)
    return payload, wire


def simulate_codecs(profile: ModelProfile, speeds: dict[str, CodecSpeed],
                    bandwidths: list[str]) -> list[dict[str, Any]]:
    """One row per bandwidth, codec and speed-up: bytes, communication, codec time, step."""
    rows = []
    plan = data_parallel_plan(profile, WORKERS)
    base = SimOptions(batch_scale=WORKERS, record=False)  # each worker: one 128-sample minibatch
    for bandwidth in bandwidths:
        cluster = flat_cluster(num_devices=WORKERS, bandwidth=bandwidth)
        plain = simulate(plan, profile, cluster, base)
        payload, wire = sync_bytes(profile, None)
        rows.append(_row(bandwidth, "none", None, plain, plain, payload, wire))
        for spec in CODECS:
            payload, wire = sync_bytes(profile, spec)
            for speedup in SPEEDUPS:
                options = dataclasses.replace(base, compress=spec, codec_speed=speeds[spec],
                                              codec_speedup=speedup)
                result = simulate(plan, profile, cluster, options)
                rows.append(_row(bandwidth, spec, speedup, result, plain, payload, wire))
    return rows


def _row(bandwidth: str, spec: str, speedup: float | None, result: SimResult, plain: SimResult,
         payload: float, wire: float) -> dict[str, Any]:
    return {"bandwidth": bandwidth, "codec": spec, "codec_speedup": speedup,
            "collective": parse_codec(spec).collective if speedup else "allreduce",
            "payload_bytes": payload, "wire_bytes": wire,
            "communication_s": result.communication_s, "codec_s": result.codec_s,
            "compute_s": result.compute_s, "step_time_s": result.step_time_s,
            "speedup": plain.step_time_s / result.step_time_s}


def speed_label(speedup: float | None) -> str:
    if speedup is None:
        return "-"
    return "measured (CPU)" if speedup == 1 else f"{speedup:g}x (assumed)"


def print_speeds(measured: dict[str, dict[str, float]]) -> None:
    numel = sum(math_prod(shape) for shape in conv_shapes())
    print(f"(a) encode and decode on one CPU thread, VGG-16's convolutions ({numel / 1e6:.1f} M "
          f"elements), best of the repeats")
    print(f"{'codec':<24} {'collective':>10} {'encode ns/el':>13} {'decode ns/el/msg':>17} "
          f"{'messages':>9}")
    for spec, timing in measured.items():
        print(f"{spec:<24} {parse_codec(spec).collective:>10} {timing['encode_ns']:>13.3f} "
              f"{timing['decode_ns']:>17.3f} {timing['messages']:>9.0f}")


def print_table(rows: list[dict[str, Any]], bandwidth: str) -> None:
    shown = [row for row in rows if row["bandwidth"] == bandwidth]
    plain = shown[0]
    print(f"\n(b) VGG-16 data parallelism, {WORKERS} workers at {bandwidth} (simulated; "
          f"{PROFILE_BATCH} samples per worker, compute {plain['compute_s'] * 1e3:.1f} ms "
          f"per step)")
    print(f"{'codec':<24} {'encode speed':<15} {'payload MB':>10} {'wire MB':>8} {'comm ms':>8} "
          f"{'enc+dec ms':>10} {'step ms':>8} {'speedup':>8}")
    for row in shown:
        print(f"{row['codec']:<24} {speed_label(row['codec_speedup']):<15} "
              f"{row['payload_bytes'] / 1e6:>10.1f} {row['wire_bytes'] / 1e6:>8.1f} "
              f"{row['communication_s'] * 1e3:>8.1f} {row['codec_s'] * 1e3:>10.1f} "
              f"{row['step_time_s'] * 1e3:>8.1f} {row['speedup']:>7.2f}x")
    for speedup in SPEEDUPS:
        paying = [row["codec"] for row in shown
                  if row["codec_speedup"] == speedup and row["speedup"] > 1.01]
        print(f"pays ({speed_label(speedup)}): {', '.join(paying) or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings per codec (best kept)")
    parser.add_argument("--messages", type=int, default=WORKERS,
                        help="workers' messages an allgather codec decodes when measured")
    parser.add_argument("--bandwidths", default=",".join(BANDWIDTHS))
    parser.add_argument("--use-defaults", action="store_true",
                        help="skip (a): simulate with tandem.planning.simulate.codecs.DEFAULT_SPEEDS")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.use_defaults:
        from tandem.planning.simulate.codecs import DEFAULT_SPEEDS

        measured: dict[str, dict[str, float]] = {}
        speeds = {spec: DEFAULT_SPEEDS[spec.partition(":")[0]] for spec in CODECS}
    else:
        measured = measure(args.messages, args.repeats)
        speeds = {spec: CodecSpeed(encode_ns=t["encode_ns"], decode_ns=t["decode_ns"])
                  for spec, t in measured.items()}
        print_speeds(measured)
    profile = load_profile(str(PROFILE))
    bandwidths = [b.strip() for b in args.bandwidths.split(",") if b.strip()]
    rows = simulate_codecs(profile, speeds, bandwidths)
    for bandwidth in bandwidths:
        print_table(rows, bandwidth)
    print("\n10x and 100x rows assume a device that encodes and decodes that much faster than "
          "one CPU thread (a GPU, say): an assumption, not a measurement.")
    print(json.dumps({"benchmark": "compression_sim", "profile": "vgg16", "workers": WORKERS,
                      "samples_per_worker": PROFILE_BATCH, "repeats": args.repeats,
                      "messages": args.messages,
                      "measured": measured, "speeds": {k: dataclasses.asdict(v)
                                                      for k, v in speeds.items()},
                      "simulated": rows, "wall_s": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
