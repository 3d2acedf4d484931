"""Throughput of tandem's sharded data parallelism on one GPU in bf16 (``--strategy dp --shard 1
--precision bf16``: FSDP2 with its mixed precision) against plain ``fully_shard`` code doing the
same, gpt with Adam.

Both run inside one process on one CUDA device (NCCL, a world of one), alternating blocks of
steps so that the device's clocks and the host's load hit both alike. tandem's side is the
trainer's real loop (``Trainer.train_steps``: sampling, loss watch, tracing, logging, heartbeat,
the schedule's interpreter); the reference is what a user writes by hand: ``fully_shard`` on each
block of the model and then on the whole of it, with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32, output_dtype=fp32 at the root)``, ``torch.optim.Adam`` and a
forward/backward/step loop over the same batches (the dataset on the device, as tandem keeps it).
Each block is timed between two ``torch.cuda.synchronize()``; the first block of each is warm-up.
Prints a table, then one JSON object on the last line (``throughput_ratio``: tandem's samples per
second over the reference's; the target is at least 0.9).

    python3 benchmarks/sharded_gpu.py [--blocks 7] [--block-steps 20] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from same_run import run_workers  # benchmarks/ is on sys.path when a script runs

MODEL = "gpt:layers=12,dim=768,heads=12,dropout=0"
"""GPT-2 small's shape (about 85 M parameters besides the embeddings)."""
DATA = "tokens:n=4096,seq=256,vocab=8192"


def reference_model(model, device):
    """The hand-written FSDP2 wrapping: each child that holds parameters, then the root."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    model = model.to(device)
    inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=inner)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32)
    return fully_shard(model, mesh=mesh, mp_policy=root)


def reference_steps(model, optimizer, inputs, targets, order, first: int, last: int,
                    batch_size: int) -> None:
    """The hand-written loop: index a batch, forward, loss, backward, step."""
    from torch.nn import functional as F

    per_epoch = len(inputs) // batch_size
    for step in range(first, last):
        start = (step % per_epoch) * batch_size
        batch = order[start : start + batch_size]
        logits = model(inputs[batch])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[batch].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def worker(args: argparse.Namespace) -> None:
    """Run under torchrun (one process): alternate blocks of tandem steps and reference steps."""
    import torch
    import torch.distributed as dist

    from tandem.models import build_model
    from tandem.runtime.dist import init_worker
    from tandem.runtime.run import make_job
    from tandem.runtime.trainer import Trainer
    from tandem.runtime.watchdog import Heartbeat

    total = args.blocks * args.block_steps
    env = init_worker(backend=args.backend, timeout_s=300, threads=4)
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    job = make_job("dp", {"--shard": 1}, nproc=1, model=args.model, data=args.data, steps=total,
                   lr=1e-3, optimizer="adam", precision="bf16", batch_size=args.batch_size,
                   progress=False)
    store = dist.distributed_c10d._get_default_store()
    with Heartbeat(store, env.rank, env.world_size) as beat:
        trainer = Trainer(job, env, beat)
        torch.manual_seed(0)
        plain = reference_model(build_model(args.model, trainer.feed.data.info), env.device)
        optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
        train = trainer.feed.train
        order = torch.randperm(len(train), device=env.device,
                               generator=torch.Generator(env.device).manual_seed(0))
        pairs = []
        for block in range(args.blocks):
            first, last = block * args.block_steps, (block + 1) * args.block_steps
            sync()
            start = time.perf_counter()
            trainer.train_steps(first, last)
            sync()
            tandem_s = (time.perf_counter() - start) / args.block_steps
            start = time.perf_counter()
            reference_steps(plain, optimizer, train.inputs, train.targets, order, first, last,
                            args.batch_size)
            sync()
            plain_s = (time.perf_counter() - start) / args.block_steps
            if block > 0:
                pairs.append((tandem_s, plain_s))
        summary = trainer.strategy.summary()
    print(json.dumps({"pairs": pairs, "torch": torch.__version__,
                      "device": torch.cuda.get_device_name(env.device) if cuda else "cpu",
                      "mixed": summary["shard_mixed_precision"],
                      "peak_bytes": torch.cuda.max_memory_allocated(env.device) if cuda else None}),
          flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7, help="blocks of each (first is warm-up)")
    parser.add_argument("--block-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--backend", default="nccl", help="gloo: a CPU smoke run of the script")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    result = run_workers(__file__, sys.argv[1:], nproc=1)
    pairs = result["pairs"]
    tandem_med = statistics.median(p[0] for p in pairs)
    plain_med = statistics.median(p[1] for p in pairs)
    ratio = statistics.median(p[1] / p[0] for p in pairs)
    print(f"{result['device']}, torch {result['torch']}, units in {result['mixed']}")
    print(f"{'':34}{'median step':>12}{'samples/s':>12}")
    for name, step in (("tandem --shard 1 --precision bf16", tandem_med),
                       ("plain fully_shard, bf16 policy", plain_med)):
        print(f"{name:34}{step * 1e3:9.2f} ms{args.batch_size / step:12.0f}")
    print(f"{'throughput ratio (tandem / plain)':34}{ratio:12.3f}")
    print(json.dumps({"benchmark": "sharded_gpu", "device": result["device"],
                      "torch": result["torch"], "model": args.model, "data": args.data,
                      "batch_size": args.batch_size, "blocks": len(pairs),
                      "block_steps": args.block_steps, "tandem_step_s": tandem_med,
                      "reference_step_s": plain_med, "throughput_ratio": ratio,
                      "tandem_mixed_precision": result["mixed"],
                      "peak_cuda_bytes": result["peak_bytes"]}))


if __name__ == "__main__":
    main()
