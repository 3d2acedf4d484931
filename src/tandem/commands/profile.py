"""The ``tandem profile`` command: measure a model's blocks and write a ModelProfile."""

from __future__ import annotations

import argparse
import sys

from tandem import strict_json
from tandem.commands.output_paths import check_output_files
from tandem.spec.data import check_data_spec
from tandem.errors import UsageError
from tandem.spec.model import check_model_spec
from tandem.profile import ModelProfile


PIN_SPLIT = ("another profile can split the model elsewhere on a busy machine; to keep one "
             "split, plan once (tandem plan --profile {profile} -o OUT/plan.json) and train with "
             "tandem train --plan OUT/plan.json")
"""The line ``tandem profile`` ends with: how to keep a split across runs."""


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tandem profile``."""
    p = subparsers.add_parser(
        "profile",
        help="measure per-layer time and sizes of a model",
        description="Measure forward/backward time, output activation bytes and parameter "
        "bytes of every top-level block of a model on the local device, and each block's fixed "
        "cost per call (fitted over the batch, its half, quarter and eighth). One thread; every "
        "block timed once per round; identical blocks share one figure.",
    )
    p.add_argument("--model", required=True, help="model spec, e.g. vgg:width=0.25 or gpt")
    p.add_argument("--batch-size", type=int, required=True, help="minibatch size to profile at")
    p.add_argument("--data", default=None,
                   help="dataset spec, as tandem train's --data (a built-in name, folder:PATH or "
                   "package.module:function; default: digits for image models, tokens for gpt)")
    p.add_argument("-o", "--output", default=None, help="write the profile JSON here")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per block (default 2)")
    p.add_argument("--repeats", type=int, default=9,
                   help="timed rounds of every block; a block's time is the least of the "
                   "medians of groups of three (default 9)")
    p.add_argument("--device", default="cpu", help="torch device to profile on (default cpu)")
    p.add_argument("--split-points", default=None, metavar="NAME,...",
                   help="a model that is not an nn.Sequential: its blocks start at these "
                   "submodules (as tandem train --split-points) instead of automatically")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    p.set_defaults(run=run)


def measure(model_spec: str, batch_size: int, data_spec: str | None, *, warmup: int = 2,
            repeats: int = 9, device: str = "cpu",
            split_points: str | None = None) -> ModelProfile:  # fmt: skip
    """Build the model and a minibatch of its data, and profile it (a model that is not an
    ``nn.Sequential`` as the blocks of its split, see :mod:`tandem.split`)."""
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {batch_size})")
    check_data_spec(data_spec or default_data(model_spec))
    check_model_spec(model_spec)
    import torch
    from torch import nn

    from tandem.data import load_data
    from tandem.models import build_model
    from tandem.runtime.pipeline.setup import parse_split_points
    from tandem.runtime.profiler import profile_model

    data = load_data(data_spec or default_data(model_spec))
    torch.manual_seed(0)
    model = build_model(model_spec, lambda: data.info)
    try:
        target = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown --device {device!r}: use cpu or cuda") from None
    model.to(target)
    samples = len(data.train)
    if not samples:
        raise UsageError(f"--data {data.name} has no training samples to profile on")
    rows = torch.arange(batch_size) % samples  # the first samples, repeated if there are fewer
    batch = data.train.take(rows).to(target).inputs
    points = parse_split_points(split_points)
    if points and isinstance(model, nn.Sequential):
        raise UsageError(f"--split-points is for models that are not an nn.Sequential; "
                         f"model {model_spec!r} is one, and its blocks are its layers")
    profile = profile_model(model, batch, warmup=warmup, repeats=repeats, model_name=model_spec,
                            split_points=points)
    profile.batch_size = batch_size
    return with_tensor_allreduces(profile, model_spec, model)


def with_tensor_allreduces(profile: ModelProfile, model_spec: str, model: object) -> ModelProfile:
    """``profile`` with each layer's tensor-parallel allreduces (``LayerProfile.tensor_allreduces``)
    when ``model`` is a reference model that ``--tensor-parallel`` splits (an ``nn.Sequential``
    whose blocks are the profile's layers); unchanged otherwise (a user's model, dropout)."""
    import dataclasses

    from torch import nn

    from tandem.models.tensor import TENSOR_PLANS, block_allreduces, tensor_plan

    name = model_spec.partition(":")[0]
    if name not in TENSOR_PLANS or not isinstance(model, nn.Sequential) \
            or len(model) != len(profile.layers):
        return profile
    try:
        plan = tensor_plan(model_spec, model, 1)
    except UsageError:  # dropout: it cannot be split, so there is nothing to record
        return profile
    counts = block_allreduces(plan, len(profile.layers))
    layers = [dataclasses.replace(layer, tensor_allreduces=c)
              for layer, c in zip(profile.layers, counts)]
    return dataclasses.replace(profile, layers=layers)


def default_data(model_spec: str) -> str:
    """The dataset a built-in model is profiled (and measured) on when ``--data`` is not given."""
    return "tokens" if model_spec.split(":", 1)[0] == "gpt" else "digits"


def format_profile(profile: ModelProfile) -> str:
    """A readable per-layer table."""
    lines = [f"{'layer':<28} {'fwd ms':>9} {'bwd ms':>9} {'fixed fwd us':>12} {'fixed bwd us':>12} "
             f"{'act MB':>9} {'params MB':>10}"]
    for layer in profile.layers:
        lines.append(f"{layer.name[:28]:<28} {layer.forward_s * 1e3:9.3f} {layer.backward_s * 1e3:9.3f} "
                     f"{layer.forward_fixed_s * 1e6:12.1f} {layer.backward_fixed_s * 1e6:12.1f} "
                     f"{layer.activation_bytes / 1e6:9.3f} {layer.parameter_bytes / 1e6:10.3f}")  # fmt: skip
    total = profile.total_compute_s()
    lines.append(f"total forward+backward: {total * 1e3:.3f} ms per minibatch of {profile.batch_size}")
    lines.append(f"fixed cost per micro-batch ({profile.fixed_costs}): "
                 f"{profile.total_fixed_s() * 1e3:.3f} ms forward+backward, paid by every call "
                 "whatever its size")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Profile the model, print a table (stderr with --json) and write the profile."""
    check_output_files(("-o", args.output))
    profile = measure(args.model, args.batch_size, args.data, warmup=args.warmup,
                      repeats=args.repeats, device=args.device,
                      split_points=args.split_points)  # fmt: skip
    human = sys.stderr if args.json else sys.stdout
    print(format_profile(profile), file=human)
    if args.output:
        profile.save(args.output)
        print(f"wrote {args.output}", file=human)
    print(PIN_SPLIT.format(profile=args.output or "PROFILE.json"), file=human)
    if args.json:
        print(strict_json.dumps(profile.to_dict()))
    return 0
