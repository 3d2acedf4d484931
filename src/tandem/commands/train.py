"""``tandem train``: train a model with a distributed strategy on local or torchrun workers."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tandem.data import build_dataset
from tandem.errors import UsageError
from tandem.models import build_model
from tandem.runtime.config import BACKENDS, OPTIMIZERS, SCHEDULES, TrainConfig
from tandem.runtime.dist import under_launcher
from tandem.sync import STRATEGIES


def add_train_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Arguments shared by ``train`` and ``demo``."""
    add = parser.add_argument
    add("--model", default=defaults.model, help="model spec, e.g. mlp, gpt:layers=4,dim=128, "
        "resnet:depth=50, vgg:width=0.25, or package.module:function")
    add("--data", default=defaults.data, help="dataset spec: digits, images:n=4096,size=32, "
        "tokens:seq=64,vocab=128")
    add("--servers", type=int, default=defaults.servers,
        help="ps: parameter-server processes, counted within --nproc")
    add("--mode", dest="ps_mode", default=defaults.ps_mode, help="ps: sync, async or ssp")
    add("--staleness", type=int, default=defaults.staleness,
        help="ps --mode ssp: updates a worker may run ahead of the slowest")
    add("--staleness-lr", action="store_true",
        help="ps async/ssp: scale each update's learning rate by 1/staleness")
    add("--backup", type=int, default=defaults.backup,
        help="ps --mode sync: backup workers (apply the first workers-b gradients per step)")
    add("--topology", default=defaults.topology,
        help="gossip: ring, torus, exponential, complete, custom:0-1,1-2,...")
    add("--weights", dest="mixing", default=defaults.mixing, help="gossip: uniform or metropolis")
    add("--async-gossip", dest="asynchronous_gossip", action="store_true",
        help="gossip: AD-PSGD, asynchronous pairwise averaging (needs a bipartite topology)")
    add("--gossip-step", type=float, default=defaults.gossip_step, metavar="GAMMA",
        help="gossip with --compress: CHOCO-gossip's consensus step size in (0, 1] "
        "(default 0.1, or randk's ratio if smaller; see docs/compression.md)")
    add("--period", type=int, default=defaults.period,
        help="localsgd: average every H steps; easgd: elastic update period tau")
    add("--rho", type=float, default=defaults.rho, help="easgd: elasticity (moving rate lr*rho)")
    add("--compress", default=None, metavar="CODEC[:k=v]",
        help="dp, ps, gossip, pipeline: compression: fp16, bf16, qsgd:levels=7, sign, "
        "topk:ratio=0.01, randk:ratio=0.01, powersgd:rank=2 (see docs/compression.md)")
    add("--straggler", default=None, help="RANK:FACTOR: slow one worker down FACTOR times")
    add("--nproc", type=int, default=defaults.nproc,
        help="local worker processes (ignored under torchrun)")
    add("--strategy", default=defaults.strategy,
        help=f"one of: {', '.join((*STRATEGIES, 'pipeline'))}")
    add("--steps", type=int, default=defaults.steps, help="optimizer steps")
    add("--schedule", default=defaults.schedule,
        help="pipeline schedule: gpipe, 1f1b (flush per step) or pipedream (asynchronous)")
    add("--microbatches", type=int, default=None,
        help="micro-batches per step of a pipeline (default: number of stages)")
    add("--stages", type=int, default=None,
        help="pipeline stages, an even split of the model's blocks (default: one per worker)")
    add("--replicas", default=None, help="replicas of each pipeline stage, e.g. 2,1")
    add("--plan", default=None, help="stages and replicas from a `tandem plan -o` JSON file")
    add("--vertical-sync", action="store_true",
        help="pipedream schedule: every stage uses the weight version stage 0 used")
    add("--batch-size", type=int, default=defaults.batch_size,
        help="global minibatch (all workers together)")
    add("--accumulate", type=int, default=defaults.accumulate,
        help="gradient-accumulation micro-steps per optimizer step")
    add("--optimizer", default=defaults.optimizer, help=f"one of: {', '.join(OPTIMIZERS)}")
    add("--lr", type=float, default=defaults.lr, help="learning rate")
    add("--momentum", type=float, default=defaults.momentum, help="SGD momentum")
    add("--weight-decay", type=float, default=defaults.weight_decay)
    add("--warmup-steps", type=int, default=defaults.warmup_steps)
    add("--lr-schedule", default=defaults.lr_schedule, help=f"one of: {', '.join(SCHEDULES)}")
    add("--seed", type=int, default=defaults.seed)
    add("--out", default=defaults.out,
        help="directory for final.pt, metrics.jsonl, trace.json, checkpoint.pt")
    add("--resume", nargs="?", const="auto", default=None,
        help="resume from a checkpoint (default: OUT/checkpoint.pt)")
    add("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    add("--stop-after", type=int, default=None,
        help="stop (with a checkpoint) after this many steps; finish later with --resume")
    add("--eval-every", type=int, default=defaults.eval_every)
    add("--log-every", type=int, default=defaults.log_every)
    add("--threads", type=int, default=defaults.threads, help="intra-op threads per CPU worker")
    add("--backend", default=defaults.backend, help=f"one of: {', '.join(BACKENDS)}")
    add("--timeout", type=float, default=defaults.timeout_s, dest="timeout_s",
        help="seconds a worker waits for the others before the job stops")
    add("--no-progress", action="store_false", dest="progress", help="hide the progress bar")
    add("--json", action="store_true", help="print the summary as one JSON object on stdout")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` of parsed arguments."""
    fields = TrainConfig.__dataclass_fields__
    return TrainConfig(**{key: value for key, value in vars(args).items() if key in fields})


def check_config(config: TrainConfig) -> None:
    """Catch the user's mistakes before any worker starts."""
    data = build_dataset(config.data)
    model = build_model(config.model, data.info)
    if config.strategy not in (*STRATEGIES, "pipeline"):
        raise UsageError(
            f"unknown strategy {config.strategy!r}; "
            f"choose one of: {', '.join(sorted((*STRATEGIES, 'pipeline')))}"
        )
    if config.compress is not None:
        from tandem.compress import check_compress

        check_compress(config.compress, strategy=config.strategy,
                       sgd_momentum=config.momentum if config.optimizer == "sgd" else 0.0)
    _check_gossip_compress(config)
    if not under_launcher():
        config.check_world(config.nproc)
        if config.strategy == "gossip":
            from tandem.topology import build_topology, mixing_matrix

            graph = build_topology(config.topology, config.nproc)
            mixing_matrix(graph, config.mixing)
            if config.asynchronous_gossip:
                from tandem.sync.gossip import two_colouring

                two_colouring(graph)
        if config.strategy == "pipeline":
            from tandem.runtime.pipeline.setup import pipeline_setup

            pipeline_setup(config, model, config.nproc)
    if config.out is not None:
        _check_writable(Path(config.out))


def _check_gossip_compress(config: TrainConfig) -> None:
    """Compression is CHOCO-gossip, for synchronous gossip only; its step needs it."""
    if config.strategy == "gossip" and config.asynchronous_gossip and config.compress:
        raise UsageError(f"--compress {config.compress} cannot be used with --async-gossip: "
                         f"AD-PSGD's pairwise averages exchange whole models; drop --async-gossip "
                         f"(CHOCO-gossip compresses synchronous gossip) or --compress")
    if config.gossip_step is not None and (config.strategy != "gossip" or not config.compress
                                           or config.asynchronous_gossip):
        raise UsageError("--gossip-step is the step size of compressed gossip; it needs "
                         "--strategy gossip --compress CODEC (plain D-PSGD averages fully)")


def _check_writable(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise UsageError(
            f"--out {out} is not a writable directory ({exc.strerror}); choose one you can write"
        ) from None


def run_training(config: TrainConfig) -> dict[str, Any] | None:
    """Check, launch and return rank 0's summary (None on the other ranks of a torchrun job)."""
    from tandem.runtime.launch import launch
    from tandem.runtime.trainer import train_worker

    check_config(config)
    return launch(train_worker, config, nproc=config.nproc, threads=config.threads)


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    """The summary as one JSON object on stdout, or as a short table on stderr."""
    if as_json:
        print(json.dumps(summary), flush=True)
        return
    for key in ("strategy", "mode", "schedule", "pipeline", "model", "world_size", "steps",
                "final_loss", "test_accuracy", "samples_per_s", "updates_per_s", "step_time_s",
                "sent_bytes_per_step", "compression_ratio", "activation_compression_ratio",
                "dropped_pushes", "wall_s", "out"):
        if summary.get(key) is None:
            continue
        value = summary[key]
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {key:<19} {text}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    summary = run_training(config_from_args(args))
    if summary is not None:
        print_summary(summary, args.json)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model on local or torchrun workers",
        description="Train a model with a distributed strategy. Without torchrun, --nproc N "
        "starts N local workers; under torchrun this process is one worker of the job.",
    )
    add_train_arguments(parser, TrainConfig())
    parser.set_defaults(run=run)
