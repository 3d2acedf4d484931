"""Throughput of tandem's pipeline against ``torch.distributed.pipelining``, same everything.

Two gloo workers (one thread each) hold the two stages of the same model, split at the same
block, and train it on the same global batches with the same number of micro-batches and the
same schedule (GPipe, then 1F1B with a flush), with SGD and momentum. tandem's side is its real
training loop (``PipelineTrainer.train_steps``: sampling, micro-batching, tracing, logging); the
reference is a ``PipelineStage`` driven by ``ScheduleGPipe`` / ``Schedule1F1B`` plus the
optimizer step. Both run inside the same two processes, alternating short blocks of steps
(which goes first alternates too), so the machine's background load hits both alike; the
ratio is taken per pair of blocks and its median reported, with the CPU time per step of
both workers together (all threads) as a less load-sensitive second measure. Prints a table,
then one JSON object on the last line.

    .venv/bin/python benchmarks/pipeline_vs_torch.py [--blocks 31] [--block-steps 10]
    .venv/bin/python benchmarks/pipeline_vs_torch.py --model gpt:layers=4,dim=64 \
        --data tokens:n=1280,seq=32,vocab=64 --batch-size 32
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from same_run import run_workers  # benchmarks/ is on sys.path when a script runs
from typing import Any

MODEL = "mlp:hidden=512,layers=8"
DATA = "images:n=5120,size=16,channels=3"
"""4096 training samples: every global batch of a power-of-two size is full (torch's stages
fix their shapes at the first step)."""
SCHEDULES = ("gpipe", "1f1b")


class TorchPipeline:
    """The reference: this worker's stage under a ``torch.distributed.pipelining`` schedule."""

    def __init__(self, kind: str, trainer: Any, args: argparse.Namespace) -> None:
        import torch
        from torch import nn
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch.nn import functional as F

        from tandem.models import build_model

        self.trainer, self.rank = trainer, trainer.env.rank
        torch.manual_seed(trainer.config.seed)
        model = build_model(trainer.config.model, trainer.feed.data.info)
        start, end = trainer.layout.bounds[trainer.place.stage]
        self.module = nn.Sequential(*list(model)[start:end])
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=args.lr, momentum=0.9)
        stage = PipelineStage(self.module, trainer.place.stage, trainer.layout.num_stages,
                              torch.device("cpu"))
        schedule_cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
        self.schedule = schedule_cls(stage, n_microbatches=args.microbatches,
                                     loss_fn=lambda out, y: F.cross_entropy(
                                         out.reshape(-1, out.shape[-1]), y.reshape(-1)))

    def train_steps(self, first: int, last: int) -> None:
        train, sampler = self.trainer.feed.train, self.trainer.feed.sampler
        for step in range(first, last):
            batch = sampler.global_indices(step)
            if self.rank == 0:
                self.schedule.step(train.inputs[batch])
            else:
                self.schedule.step(target=train.targets[batch], losses=[])
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def timed_block(runner: Any, first: int, last: int) -> tuple[float, float]:
    """Wall seconds per step of ``runner`` over steps ``first..last-1`` (started together), and
    CPU seconds per step summed over both workers (all threads, gloo's included)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    runner.train_steps(first, last)
    cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
    dist.barrier()
    wall = time.perf_counter() - start
    dist.all_reduce(cpu)
    return wall / (last - first), float(cpu) / (last - first)


def worker(args: argparse.Namespace) -> None:
    """Run under torchrun: for each schedule, alternate blocks of tandem and torch steps."""
    import torch.distributed as dist

    from tandem.runtime.run import make_job
    from tandem.runtime.dist import init_worker
    from tandem.runtime.pipeline.trainer import PipelineTrainer
    from tandem.runtime.watchdog import Heartbeat

    total = args.blocks * args.block_steps
    env = init_worker(backend="gloo", timeout_s=120, threads=1)
    store = dist.distributed_c10d._get_default_store()
    results: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]] = {
        kind: [] for kind in SCHEDULES}
    with Heartbeat(store, env.rank, env.world_size) as beat:
        runners = {}
        for kind in SCHEDULES:
            job = make_job("pipeline", {"--schedule": kind, "--microbatches": args.microbatches,
                                        "--stages": 2},
                           model=args.model, data=args.data, nproc=2, steps=total,
                           batch_size=args.batch_size, lr=args.lr, progress=False)
            tandem = PipelineTrainer(job, env, beat)
            runners[kind] = (tandem, TorchPipeline(kind, tandem, args))
        for block in range(args.blocks):
            first, last = block * args.block_steps, (block + 1) * args.block_steps
            for kind, (tandem, reference) in runners.items():
                if block % 2:  # alternate which goes first, so a trend in load favours neither
                    torch_s = timed_block(reference, first, last)
                    pair = (timed_block(tandem, first, last), torch_s)
                else:
                    pair = (timed_block(tandem, first, last), timed_block(reference, first, last))
                if block > 0:
                    results[kind].append(pair)
        del tandem, reference
        runners.clear()  # release both pipelines' pending work before the groups go
        gc.collect()
    if env.rank == 0:
        print(json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Skip interpreter finalization: a gloo work object freed during it can abort the process
    # ("terminate called without an active exception"; pytorch/pytorch#179291 discusses it).
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=31, help="blocks of each (first is warm-up)")
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--data", default=DATA, help="a dataset whose training split is a "
                        "multiple of the batch size, e.g. tokens:n=1280,seq=64 for gpt")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = run_workers(__file__, sys.argv[1:])
    figures: dict[str, Any] = {}
    print(f"{'schedule':10}{'tandem step':>13}{'torch step':>13}{'throughput ratio':>18}"
          f"{'tandem CPU':>13}{'torch CPU':>12}")
    for kind, pairs in results.items():
        ratios = [torch_[0] / tandem[0] for tandem, torch_ in pairs]
        figures[kind] = {
            "tandem_step_s": statistics.median(tandem[0] for tandem, _ in pairs),
            "torch_step_s": statistics.median(torch_[0] for _, torch_ in pairs),
            "throughput_ratio": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "tandem_cpu_s": statistics.median(tandem[1] for tandem, _ in pairs),
            "torch_cpu_s": statistics.median(torch_[1] for _, torch_ in pairs),
        }
        f = figures[kind]
        print(f"{kind:10}{f['tandem_step_s'] * 1e3:10.2f} ms{f['torch_step_s'] * 1e3:10.2f} ms"
              f"{f['throughput_ratio']:18.3f}{f['tandem_cpu_s'] * 1e3:10.2f} ms"
              f"{f['torch_cpu_s'] * 1e3:9.2f} ms")
    print("step: median wall time per step; throughput ratio: tandem samples/s over "
          "torch.distributed.pipelining's, median over blocks (>= 1.0: tandem as fast or "
          "faster); CPU: CPU time per step, both workers together")
    print(json.dumps({"benchmark": "pipeline_vs_torch", "model": args.model, "data": args.data,
                      "workers": 2, "stages": 2, "batch_size": args.batch_size,
                      "microbatches": args.microbatches, "blocks": args.blocks - 1,
                      "block_steps": args.block_steps, **figures}))


if __name__ == "__main__":
    main()
