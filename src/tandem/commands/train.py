"""``tandem train``: train a model with a distributed strategy on local or torchrun workers."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tandem import strict_json
from tandem.cluster import parse_duration
from tandem.commands.config_file import KEY_VALUE
from tandem.errors import UsageError
from tandem.plan import Plan
from tandem.runtime.config import (
    BACKENDS, DEFAULT_BASE_BATCH, OPTIMIZERS, SCHEDULES, RunConfig, resolve_batch_size,
)
from tandem.runtime.job import Job, sketch_job
from tandem.runtime.launcher_env import under_launcher, world_size
from tandem.runtime.out_dir import default_out, remove_if_unused
from tandem.runtime.run import check_flags, make_job, run_training, start_forkserver
from tandem.strategy import PLAN_FLAGS, STRATEGIES, plan_with_flags


def add_train_arguments(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    """Arguments shared by ``train`` and ``demo``.

    The flags that describe the plan default to None, so that the ones the user gave are known
    (a flag of another strategy is an error); their defaults live in the plan's types.
    """
    add = parser.add_argument
    add("--model", default=defaults.model, help="model spec, e.g. mlp, gpt:layers=4,dim=128, "
        "resnet:depth=50, vgg:width=0.25, or package.module:function")
    add("--data", default=defaults.data, help="dataset spec: digits, images:n=4096,size=32, "
        "tokens:seq=64,vocab=128, folder:PATH (one subfolder of images per class), "
        "shards:DIR (written by tandem pack, streamed) or "
        "package.module:function[:k=v] (returns the train and test datasets)")
    add("--loader-workers", type=int, default=defaults.loader_workers, metavar="N",
        help="background processes per worker that read batches ahead (default: 1 for "
        "--data shards:DIR, 0 for a Dataset; not for data held in memory)")
    add("--cache-dir", default=defaults.cache_dir, metavar="DIR",
        help="--data shards:DIR: keep local copies of the shards here (a slow source is read "
        "once)")
    add("--loss", default=defaults.loss, metavar="PACKAGE.MODULE:FUNCTION",
        help="loss(output, targets) -> the batch's mean loss (default: cross-entropy on the "
        "model's logits)")
    add("--init-fn", default=defaults.init_fn, metavar="reset|PACKAGE.MODULE:FUNCTION",
        help="build a user's model (--model package.module:function) on the meta device and "
        "initialize it one module at a time: by each module's reset_parameters (reset) or by "
        "function(module); sharded workers then never hold it whole (default: built whole)")
    add("--plan", default=None, metavar="FILE",
        help="run this plan (tandem plan -o / tandem search -o): strategy, layout, schedule, "
        "micro-batches, sync options and codec; --nproc defaults to its workers")
    add("--strategy", default=None,
        help=f"one of: {', '.join(STRATEGIES)} (default dp)")
    add("--servers", type=int, help="ps, easgd --mode async: parameter-server processes, "
        "counted within --nproc (default 1)")
    add("--mode", help="ps: sync, async or ssp; easgd: sync (an allreduce every period) or "
        "async (the center on --servers, each worker on its own clock) (default sync)")
    add("--staleness", type=int, help="ps --mode ssp: updates a worker may run ahead of the "
        "slowest (default 2)")
    add("--staleness-lr", action="store_true", default=None,
        help="ps async/ssp: scale each update's learning rate by 1/staleness")
    add("--backup", type=int,
        help="ps --mode sync: backup workers (apply the first workers-b gradients per step)")
    add("--topology", help="gossip: ring, torus, exponential, complete, custom:0-1,1-2,... "
        "(default ring)")
    add("--weights", help="gossip: uniform or metropolis (default metropolis)")
    add("--async-gossip", action="store_true", default=None,
        help="gossip: AD-PSGD, asynchronous pairwise averaging (needs a bipartite topology)")
    add("--gossip-step", type=float, metavar="GAMMA",
        help="gossip with --compress: CHOCO-gossip's consensus step size in (0, 1] "
        "(default 0.1, or randk's ratio if smaller; see docs/compression.md)")
    add("--period", type=int,
        help="localsgd: average every H steps; easgd: elastic update period tau (default 4)")
    add("--rho", type=float, help="easgd: elasticity, moving rate lr*rho (default 1)")
    add("--nesterov", action="store_true", default=None,
        help="easgd: EAMSGD, the workers' SGD with Nesterov momentum (--momentum is its delta)")
    add("--compress", default=None, metavar="CODEC[:k=v]",
        help="dp, ps, gossip, pipeline: compression: fp16, bf16, qsgd:levels=7, sign, "
        "topk:ratio=0.01, randk:ratio=0.01, powersgd:rank=2 (see docs/compression.md)")
    add("--straggler", default=None, help="RANK:FACTOR: slow one worker down FACTOR times")
    add("--split-points", default=defaults.split_points, metavar="NAME,...",
        help="pipeline of a model that is not an nn.Sequential: cut it into blocks before these "
        "submodules (e.g. transformer.h.2,transformer.h.4) instead of automatically")
    add("--nproc", type=int, default=None,
        help="local worker processes (default: the plan's, else 1; ignored under torchrun)")
    add("--steps", type=int, default=defaults.steps, help="optimizer steps")
    add("--schedule", help="pipeline schedule: gpipe, 1f1b (flush per step), pipedream "
        "(asynchronous) or a schedule file (default 1f1b)")
    add("--microbatches", type=int,
        help="micro-batches per step of a pipeline (default: max(stages, replicas))")
    add("--stages", type=int,
        help="pipeline stages (default: one per worker): an nn.Sequential's blocks split evenly, "
        "any other model's where a quick profile balances them")
    add("--replicas", help="replicas of each pipeline stage, e.g. 2,1")
    add("--tensor-parallel", type=int, metavar="T",
        help="split layers across T workers (Megatron-style): those --tensor-layers names, else "
        "mlp's, gpt's and vgg's own; --strategy dp is data nproc/T x tensor T, --strategy "
        "pipeline makes every stage replica T workers (see README's Tensor parallelism)")
    add("--tensor-layers", metavar="NAME=STYLE,...",
        help="with --tensor-parallel: the layers of any model to split, by module name, and how "
        "(colwise, rowwise, heads, channels), e.g. fc1=colwise,fc2=rowwise")
    add("--shard", type=int, metavar="S",
        help="--strategy dp: shard the model's state over groups of S workers (ZeRO / FSDP2's "
        "fully_shard); --nproc above S replicates the groups (hybrid, HSDP); S divides --nproc. "
        "--strategy pipeline: each stage's S replicas shard it (levels 2 and 3)")
    add("--shard-level", type=int, metavar="1|2|3",
        help="with --shard: what is sharded: 1 optimizer state, 2 + gradients, 3 + parameters "
        "(default 3)")
    add("--shard-units", metavar="NAME,...",
        help="with --shard: the submodules gathered one at a time, by module name (default: "
        "each block of the model's sequence of blocks, e.g. transformer.h.*, then the rest)")
    add("--sync-batchnorm", action="store_true", default=None,
        help="--strategy dp: BatchNorm layers normalize over every worker's samples (the global "
        "batch), as one process does; without it each worker normalizes its own share")
    add("--vertical-sync", action="store_true", default=None,
        help="pipedream schedule: every stage uses the weight version stage 0 used")
    add("--recompute", action="store_true", default=None,
        help="pipeline: keep only each stage's input per micro-batch and recompute its "
        "activations in the backward (the plan's recompute)")
    add("--batch-size", type=int, default=None,
        help=f"global minibatch (all workers together; default {defaults.batch_size}, or the "
        f"first batch of --batch-schedule)")
    add("--batch-schedule", default=defaults.batch_schedule, metavar="BATCH@STEP,...|auto",
        help="change the global batch during training, e.g. 64@0,128@200,256@400 (64 from step "
        "0, 128 from step 200, ...), instead of decaying the learning rate; auto (--strategy "
        "dp): double the batch at log steps while the gradient noise scale exceeds twice it")
    add("--accumulate", type=int,
        help="data parallelism: gradient-accumulation micro-steps per optimizer step (default 1)")
    add("--find-unused-parameters", action="store_true", default=defaults.find_unused_parameters,
        help="data parallelism: parameters forward does not use get a zero gradient (DDP's "
        "find_unused_parameters); without it they stop the run, named")
    add("--memory-limit", default=defaults.memory_limit, metavar="SIZE",
        help="data parallelism: the most parameter, gradient and optimizer-state bytes a worker "
        "may hold (e.g. 16GB, an emulated device's memory); over it, the run stops after its "
        "first step naming the --shard that fits")
    add("--offload", default=defaults.offload, metavar="optimizer",
        help="with --shard on GPUs: keep the shards of the optimizer state, gradients and "
        "parameters in CPU memory and step the optimizer there (FSDP2's CPU offload)")
    add("--optimizer", default=defaults.optimizer, metavar="NAME|PACKAGE.MODULE:CLASS",
        help=f"{', '.join(OPTIMIZERS)} (lars and lamb: layer-wise trust ratios for large "
        f"batches, see docs/large_batch.md), any torch.optim class by name (rmsprop, NAdam, ...) "
        f"or a class of yours (default {defaults.optimizer})")
    add("--optimizer-options", nargs="+", default=None, metavar=KEY_VALUE,
        help="the optimizer's keyword options, e.g. betas=0.9,0.95 eps=1e-8 (lr and "
        "weight_decay come from --lr and --weight-decay, SGD's momentum from --momentum)")
    add("--no-decay", default=defaults.no_decay, metavar="norm,bias,embedding",
        help="weight decay 0 for these parameters (a second group): those of normalization "
        "layers, those whose name ends in bias, embedding weights")
    add("--lr", type=float, default=defaults.lr, help="learning rate")
    add("--momentum", type=float, default=defaults.momentum,
        help="momentum of sgd and lars (default 0.9)")
    add("--weight-decay", type=float, default=defaults.weight_decay,
        help="weight decay of every optimizer that takes one (default 0)")
    add("--lr-scaling", default=defaults.lr_scaling, metavar="linear|sqrt|auto",
        help="--lr is for a global batch of --base-batch B0; use it times B/B0 (linear, Goyal "
        "et al. 2017; pair it with --warmup-steps) or sqrt(B/B0) at --batch-size B, or (auto, "
        "--strategy dp on 2+ workers) times the gain per step the measured gradient noise "
        "scale predicts, (1 + B_noise/B0) / (1 + B_noise/B)")
    add("--base-batch", type=int, default=defaults.base_batch, metavar="B0",
        help=f"the batch --lr is for under --lr-scaling (default {DEFAULT_BASE_BATCH})")
    add("--warmup-steps", type=int, default=defaults.warmup_steps)
    add("--async-compensation", default=defaults.async_compensation, choices=None,
        metavar="auto|off", help="asynchronous strategies (ps --mode async/ssp, pipedream): "
        "scale the learning rate (and set pipedream's momentum) for the updates' staleness "
        "(default auto; see docs/large_batch.md)")
    add("--precision", default=defaults.precision,
        help="fp32, or bf16/fp16 mixed precision (autocast; fp16 scales the loss and skips "
        "steps whose gradients overflow, counting them in the summary's skipped_steps)")
    add("--clip-grad-norm", type=float, default=defaults.clip_grad_norm, metavar="X",
        help="clip the gradients' global L2 norm to X (over every worker or stage that holds "
        "a part of it)")
    add("--lr-schedule", default=defaults.lr_schedule,
        help=f"one of: {', '.join(SCHEDULES)} (step:0.2@200,400 multiplies the learning rate "
        f"by 0.2 at step 200 and again at 400)")
    add("--seed", type=int, default=defaults.seed)
    add("--out", default=defaults.out,
        help="directory for final.pt, metrics.jsonl, trace.json, plan.json, checkpoint.pt "
        "(default: a new runs/<date>_<time>, under $TANDEM_RUNS_DIR if set)")
    add("--resume", nargs="?", const="auto", default=None, metavar="auto|PATH",
        help="resume from a checkpoint: auto (also a bare --resume) resumes OUT/checkpoint.pt "
        "if it exists and starts afresh if not, so one command line serves every attempt of a "
        "restarted job; PATH must exist")
    add("--overwrite", action="store_true", default=defaults.overwrite,
        help="start over in an --out that holds another run's outputs (they are removed)")
    add("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    add("--max-restarts", type=int, default=defaults.max_restarts, metavar="K",
        help="start the workers again after a failure, up to K times, each resuming from the "
        "latest checkpoint (needs --resume auto); under torchrun, give torchrun --max-restarts")
    add("--stop-after", type=int, default=None,
        help="stop (with a checkpoint) after this many steps; finish later with --resume")
    add("--eval-every", type=int, default=defaults.eval_every)
    add("--log-every", type=int, default=defaults.log_every)
    add("--log-to", default=defaults.log_to, metavar="jsonl,csv,tensorboard",
        help="where the metrics lines go (loss, lr, samples/s, memory, data wait, noise scale, "
        "evaluations): a comma list of jsonl (OUT/metrics.jsonl), csv (OUT/metrics.csv) and "
        "tensorboard (event files in OUT/tensorboard; needs pip install tensorboard) "
        "(default jsonl)")
    add("--noise-every", type=int, default=defaults.noise_every, metavar="N",
        help="measure the gradient noise scale every N steps (data parallelism; default: at "
        "the --log-every steps, every step with --batch-schedule auto)")
    add("--threads", type=int, default=defaults.threads, help="intra-op threads per CPU worker")
    add("--backend", default=defaults.backend, help=f"one of: {', '.join(BACKENDS)}")
    add("--timeout", type=_duration("--timeout"), default=defaults.timeout_s, dest="timeout_s",
        metavar="TIME", help="how long a worker waits for the others before the job stops, "
        "e.g. 300 (seconds), 90s or 5000ms (default 300)")
    add("--no-progress", action="store_false", dest="progress", help="hide the progress bar")
    add("--json", action="store_true", help="print the summary as one JSON object on stdout")


def _duration(flag: str) -> Any:
    """An argparse type: seconds of a duration with or without a unit (one line if not); a
    bare number is left for :class:`RunConfig` to check (its message gives the range)."""
    def parse(text: str) -> float:
        try:
            return float(text)
        except ValueError:
            pass
        try:
            return parse_duration(text, flag)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def given_plan_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The plan's flags the user gave, e.g. ``{"--servers": 2}``."""
    values = {flag: getattr(args, flag.lstrip("-").replace("-", "_"), None) for flag in PLAN_FLAGS}
    return {flag: value for flag, value in values.items() if value is not None}


def job_from_args(args: argparse.Namespace) -> Job:
    """The run's settings and its plan: read from ``--plan``, or built from the flags."""
    fields = RunConfig.__dataclass_fields__
    settings = resolve_batch_size(
        {key: value for key, value in vars(args).items() if key in fields and key != "nproc"})
    return _job(args, settings)


def _job(args: argparse.Namespace, settings: dict[str, Any]) -> Job:
    """The job of ``args`` with the run's ``settings``, checked."""
    given = given_plan_flags(args)
    processes = world_size() if under_launcher() else args.nproc
    if args.plan is None:
        strategy, nproc = args.strategy or "dp", 1 if processes is None else processes
        sketch = sketch_job(strategy, given, RunConfig(**settings, nproc=nproc))
        # a sketched pipeline's default micro-batches follow stages the model has not decided
        # yet: its batch is checked on the real job (more stages than layers comes first)
        check_flags(sketch, batches=not sketch.plan.pipelined or "--microbatches" in given)
        start_forkserver()
        return make_job(strategy, given, nproc=nproc, **settings)
    plan = plan_with_flags(Plan.load(args.plan), args.strategy, given, args.plan)
    job = Job(run=RunConfig(**settings, nproc=plan.num_workers if processes is None else processes),
              plan=plan)
    check_flags(job)
    start_forkserver()
    return job


def print_summary(summary: dict[str, Any], as_json: bool) -> None:
    """The summary as one JSON object on stdout, or as a short table on stderr."""
    if as_json:
        print(strict_json.dumps(summary), flush=True)
        return
    for key in ("strategy", "mode", "shard", "schedule", "pipeline", "model", "world_size", "steps",
                "final_loss", "learning", "test_accuracy", "samples_per_s", "updates_per_s",
                "step_time_s", "sent_bytes_per_step", "compression_ratio",
                "activation_compression_ratio", "dropped_pushes", "critical_batch", "wall_s",
                "out"):
        if summary.get(key) is None:
            continue
        value = summary[key]
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {key:<19} {text}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    made, launched = None, under_launcher()
    if args.out is None and args.resume is None and not launched:  # never nowhere
        made = args.out = str(default_out())  # (--resume auto needs its --out)
    # said at the start at a terminal; the summary names it (``out``) wherever it goes
    told = made is not None and sys.stderr.isatty()
    try:
        summary = run_training(job_from_args(args), announce=None if not told else (
            f"tandem: writing this run's outputs to {made} (--out DIR chooses)"))
    except BaseException:
        if made is not None:
            remove_if_unused(Path(made))
        raise
    if summary is not None:
        print_summary(summary, args.json)
        if launched and args.out is None:  # the workers could not agree on a runs/ name
            print("tandem: warning: this torchrun job had no --out, so nothing was written "
                  "(final.pt, metrics.jsonl); give --out DIR, the same on every node",
                  file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model on local or torchrun workers",
        description="Train a model with a distributed strategy. Without torchrun, --nproc N "
        "starts N local workers; under torchrun this process is one worker of the job.",
    )
    add_train_arguments(parser, RunConfig())
    parser.set_defaults(run=run)
