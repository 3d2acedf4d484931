"""``tandem search --objective time-to-accuracy``: its arguments and their checks, the steps
model (from a measuring run or a file), and the table of every candidate's two factors.

Usage::

    tandem search --model mlp --data digits --devices 4 --bandwidth 10Gb/s \\
        --objective time-to-accuracy --target-loss 0.3 [--batch-sizes 32,64,...,1024]

For each global batch of ``--batch-sizes`` the search runs as it does for ``--objective
step-time`` (its budget shared among the batches), with stale plans weighed by their predicted
steps, and so does the parameter-server family (synchronous and asynchronous servers); each
plan found gets its simulated time per step and its predicted steps to ``--target-loss``
(:class:`~tandem.planning.search.time_to_accuracy.StepsModel`), and the least product wins.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.commands.measure_steps import MeasureOptions, measure_steps
from tandem.commands.profile import default_data
from tandem.errors import UsageError
from tandem.planning.search.flexflow import Candidate
from tandem.planning.search.time_to_accuracy import STALENESS_COSTS, StepsModel, Timed

OBJECTIVES = ("step-time", "time-to-accuracy")
DEFAULT_BATCHES = (32, 64, 128, 256, 512, 1024)
TIME_FAMILIES = ("ps",)
"""Families whose steps the model predicts (synchronous or stale servers); gossip, local SGD
and EASGD workers disagree in ways no staleness describes."""
MEASURE_FLAGS = {"--measure-batch": "measure_batch", "--measure-steps": "measure_steps",
                 "--lr": "lr"}
OBJECTIVE_FLAGS = {"--target-loss": "target_loss", "--batch-sizes": "batch_sizes",
                   "--learning": "learning", "--staleness-cost": "staleness_cost",
                   **MEASURE_FLAGS}


def add_objective_args(p: argparse.ArgumentParser) -> None:
    """``--objective`` and the options of ``time-to-accuracy`` (None when not given)."""
    group = p.add_argument_group("time to accuracy (--objective time-to-accuracy)")
    group.add_argument("--objective", choices=OBJECTIVES, default="step-time",
                       help="what the search minimizes: time per step (default), or predicted "
                       "time to --target-loss over --batch-sizes: time per step times the "
                       "steps the noise-scale model predicts (docs/large_batch.md)")
    group.add_argument("--target-loss", type=float, metavar="X",
                       help="training loss to reach (a metrics line's mean loss)")
    group.add_argument("--batch-sizes", metavar="B,...",
                       help=f"global batches to weigh (default "
                       f"{','.join(map(str, DEFAULT_BATCHES))})")
    group.add_argument("--learning", metavar="FILE",
                       help="a JSON steps model (noise_scale, reference_batch, reference_steps, "
                       "target_loss; the time_to_accuracy.steps_model of a search's --json) "
                       "instead of a measuring run")
    group.add_argument("--measure-batch", type=int, metavar="B",
                       help="global batch of the measuring run (dp on 2 workers; default 32)")
    group.add_argument("--measure-steps", type=int, metavar="N",
                       help="steps of the measuring run, which must reach --target-loss "
                       "(default 500)")
    group.add_argument("--lr", type=float,
                       help="learning rate of the measuring run at --measure-batch (default "
                       "0.05, tandem train's); each batch's rate is scaled from it")
    group.add_argument("--staleness-cost", type=float, metavar="K",
                       help="more steps per unit of staleness, as a fraction, for every stale "
                       "plan (default: measured for each kind, " + ", ".join(
                           f"{kind} {cost:g}" for kind, cost in STALENESS_COSTS.items())
                       + "; docs/benchmarks.md)")


def check_objective(args: argparse.Namespace) -> None:
    """Refuse, in one line each, what ``--objective`` and its options cannot do together; run
    before anything is profiled or measured."""
    given = [flag for flag, name in OBJECTIVE_FLAGS.items() if getattr(args, name) is not None]
    if args.objective != "time-to-accuracy":
        if given:
            also = "" if given[0] == "--target-loss" else " --target-loss X"
            raise UsageError(f"{given[0]} applies to --objective time-to-accuracy; add "
                             f"--objective time-to-accuracy{also}, or drop {given[0]}")
        return
    if args.target_loss is None or not math.isfinite(args.target_loss) or args.target_loss < 0:
        raise UsageError(f"--objective time-to-accuracy needs --target-loss X, a finite training "
                         f"loss >= 0 to reach (got {args.target_loss}), e.g. --target-loss 0.3")
    if args.batch_size is not None:
        raise UsageError(f"--batch-size {args.batch_size} fixes the batch, which --objective "
                         f"time-to-accuracy chooses; give --batch-sizes {args.batch_size},... "
                         f"instead")
    if args.pick != "allreduce":
        raise UsageError(f"--pick {args.pick} chooses by time per step; --objective "
                         f"time-to-accuracy picks the least time to the target: drop --pick")
    others = [m for m in _methods(args.families) if m not in TIME_FAMILIES]
    if others:
        raise UsageError(f"--families {','.join(others)}: --objective time-to-accuracy predicts "
                         f"the steps of synchronous and stale plans, not of {others[0]}'s "
                         f"disagreeing workers; give --families ps or none")
    measured = [flag for flag, name in MEASURE_FLAGS.items() if getattr(args, name) is not None]
    if args.learning is not None and measured:
        raise UsageError(f"{measured[0]} sets the measuring run, which --learning "
                         f"{args.learning} replaces; drop one of them")
    if args.learning is None and args.model is None:
        raise UsageError("--objective time-to-accuracy measures the steps with a short run of "
                         "--model on --data, and a --profile cannot train: give --model, or "
                         "--learning FILE with the steps model")
    if args.staleness_cost is not None and not args.staleness_cost >= 0:
        raise UsageError(f"--staleness-cost {args.staleness_cost} must be >= 0 (0 charges "
                         f"staleness nothing)")
    batch_sizes(args)
    if args.learning is None:
        _measure_options(args)  # its own checks


def _methods(text: str) -> list[str]:
    return [] if text.strip() == "none" else [m.strip() for m in text.split(",") if m.strip()]


def time_families(args: argparse.Namespace) -> tuple[str, ...]:
    """The families weighed: ``--families`` as given, ``ps`` when left at its default."""
    return tuple(m for m in _methods(args.families) if m in TIME_FAMILIES)


def batch_sizes(args: argparse.Namespace) -> list[int]:
    """``--batch-sizes`` (default :data:`DEFAULT_BATCHES`), increasing, each at least 1."""
    if args.batch_sizes is None:
        return list(DEFAULT_BATCHES)
    try:
        sizes = sorted({int(text) for text in args.batch_sizes.split(",") if text.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise UsageError(f"--batch-sizes {args.batch_sizes!r}: give whole numbers of at least 1 "
                         f"separated by commas, e.g. 32,64,128")
    return sizes


def steps_model(args: argparse.Namespace) -> StepsModel:
    """The steps model of ``--learning FILE``, or of a measuring run of ``--model``."""
    if args.learning is not None:
        model = StepsModel.from_dict(_read_json(args.learning), f"--learning {args.learning}")
        if model.target_loss != args.target_loss:
            raise UsageError(f"--learning {args.learning} holds steps to loss "
                             f"{model.target_loss:g}, not --target-loss {args.target_loss:g}; "
                             f"measure again for this target")
    else:
        model = measure_steps(_measure_options(args))
    if args.staleness_cost is None:
        return model
    return dataclasses.replace(model, staleness_costs=dict.fromkeys(STALENESS_COSTS,
                                                                     args.staleness_cost))


def _measure_options(args: argparse.Namespace) -> MeasureOptions:
    """The measuring run of ``--model`` the arguments ask for."""
    return MeasureOptions(model=args.model, data=args.data or default_data(args.model),
                          target_loss=args.target_loss, batch=args.measure_batch or 32,
                          lr=0.05 if args.lr is None else args.lr,
                          steps=args.measure_steps or 500, seed=args.seed)


def _read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read --learning {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(f"--learning {path} is not JSON: {exc}") from None


def format_timed(timed: list[Timed], best: Timed, model: StepsModel,
                 describe: Callable[[Candidate], str]) -> str:
    """The steps model, one row per candidate (its time per step, its predicted steps and their
    product), and the winner with the ``tandem train`` flags it assumes."""
    lines = [f"steps to loss {model.target_loss:g}: {model.source}; predicted S(B) = "
             f"{model.min_steps:.1f} (1 + {model.noise_scale:.1f}/B) (1 + c x staleness), c "
             + ", ".join(f"{cost:g} for {kind}" for kind, cost in model.staleness_costs.items()),
             f"{'batch':>6} {'ms/step':>9} {'steps':>8} {'time to target':>15} {'stale':>5}  plan"]
    for row in timed:
        mark = "  <- best" if row is best else ""
        lines.append(f"{row.batch_size:>6} {row.step_time_s * 1e3:9.3f} {row.predicted_steps:8.1f} "
                     f"{_seconds(row.time_to_target_s):>15} {row.staleness:>5}  "
                     f"{describe(row.candidate)}{mark}")
    lr = model.lr_at(best.batch_size)
    lines.append(f"best: batch {best.batch_size}, {describe(best.candidate)}: "
                 f"{best.step_time_s * 1e3:.3f} ms x {best.predicted_steps:.1f} steps = "
                 f"{_seconds(best.time_to_target_s)} predicted"
                 + ("" if lr is None else f", at --lr {lr:.4g} (--lr {model.lr:g} at batch "
                    f"{model.reference_batch} scaled as --lr-scaling auto would)"))
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if value >= 1 else f"{value * 1e3:.2f} ms"


def timed_dict(row: Timed, model: StepsModel) -> dict[str, Any]:
    """One candidate as JSON: both factors, their product, and the plan."""
    return {"batch_size": row.batch_size, "label": row.label,
            "config": row.candidate.plan.config, "schedule": row.candidate.plan.schedule,
            "sync": row.candidate.plan.sync.method, "staleness": row.staleness,
            "step_time_s": row.step_time_s, "predicted_steps": row.predicted_steps,
            "time_to_target_s": row.time_to_target_s, "lr": model.lr_at(row.batch_size),
            "plan": row.candidate.plan.to_dict()}
