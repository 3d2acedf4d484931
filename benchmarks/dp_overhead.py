"""Overhead of tandem's ``dp`` strategy over a plain hand-written DDP loop, same model and data.

Both run inside the same two gloo worker processes (one thread each), alternating blocks of
steps, so that the machine's background load hits both alike. tandem's side is the trainer's
real loop (``Trainer.train_steps``: sampling, loss scaling, tracing, logging, heartbeat); the
reference is the loop a user writes by hand around ``DistributedDataParallel``. Prints a table,
then one JSON object on the last line.

    .venv/bin/python benchmarks/dp_overhead.py [--blocks 12] [--block-steps 25]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from same_run import run_workers  # benchmarks/ is on sys.path when a script runs

MODEL = "mlp:hidden=512,layers=4"
DATA = "images:n=8192,size=16,channels=3"


def plain_ddp_steps(model, optimizer, inputs, targets, order, first: int, last: int,
                    batch_size: int, rank: int, world: int) -> None:
    """The hand-written reference: index this rank's share, forward, backward, step."""
    from torch.nn import functional as F

    local = batch_size // world
    per_epoch = len(inputs) // batch_size
    for step in range(first, last):
        start = (step % per_epoch) * batch_size + rank * local
        batch = order[start : start + local]
        loss = F.cross_entropy(model(inputs[batch]), targets[batch])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def worker(args: argparse.Namespace) -> None:
    """Run under torchrun: alternate blocks of tandem steps and plain DDP steps."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tandem.models import build_model
    from tandem.runtime.run import make_job
    from tandem.runtime.dist import init_worker
    from tandem.runtime.trainer import Trainer
    from tandem.runtime.watchdog import Heartbeat

    total = args.blocks * args.block_steps
    env = init_worker(backend="gloo", timeout_s=120, threads=1)
    config = make_job("dp", nproc=env.world_size, model=MODEL, data=DATA, steps=total, lr=args.lr,
                      batch_size=args.batch_size, progress=False)
    store = dist.distributed_c10d._get_default_store()
    with Heartbeat(store, env.rank, env.world_size) as beat:
        trainer = Trainer(config, env, beat)
        torch.manual_seed(0)
        plain = DistributedDataParallel(build_model(MODEL, trainer.feed.data.info))
        optimizer = torch.optim.SGD(plain.parameters(), lr=args.lr, momentum=0.9)
        order = torch.randperm(len(trainer.feed.train), generator=torch.Generator().manual_seed(0))
        pairs = []
        for block in range(args.blocks):
            first, last = block * args.block_steps, (block + 1) * args.block_steps
            dist.barrier()
            start = time.perf_counter()
            trainer.train_steps(first, last)
            tandem_s = (time.perf_counter() - start) / args.block_steps
            train = trainer.feed.train
            dist.barrier()
            start = time.perf_counter()
            plain_ddp_steps(plain, optimizer, train.inputs, train.targets, order,
                            first, last, args.batch_size, env.rank, env.world_size)
            plain_s = (time.perf_counter() - start) / args.block_steps
            if block > 0:
                pairs.append((tandem_s, plain_s))
    if env.rank == 0:
        print(json.dumps({"pairs": pairs}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=13, help="blocks of each (first is warm-up)")
    parser.add_argument("--block-steps", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    pairs = run_workers(__file__, sys.argv[1:])["pairs"]
    tandem_med = statistics.median(p[0] for p in pairs)
    plain_med = statistics.median(p[1] for p in pairs)
    ratio = statistics.median(p[0] / p[1] for p in pairs)
    print(f"{'':26}{'median step':>12}")
    print(f"{'tandem dp (Trainer)':26}{tandem_med * 1e3:9.3f} ms")
    print(f"{'plain DDP loop':26}{plain_med * 1e3:9.3f} ms")
    print(f"{'ratio (median of blocks)':26}{ratio:9.3f}")
    print(json.dumps({"benchmark": "dp_overhead", "model": MODEL, "data": DATA, "workers": 2,
                      "batch_size": args.batch_size, "blocks": len(pairs),
                      "block_steps": args.block_steps, "tandem_step_s": tandem_med,
                      "reference_step_s": plain_med, "ratio": ratio}))


if __name__ == "__main__":
    main()
