"""Arguments the planning commands share: where the profile comes from and the cluster."""

from __future__ import annotations

import argparse
import dataclasses

from tandem.cluster import FLAT_MEMORY, Cluster, flat_cluster, parse_cluster, parse_size
from tandem.errors import UsageError
from tandem.profile import ModelProfile, load_profile


def add_source_args(p: argparse.ArgumentParser, *, batch_help: str, batch_default: int | None,
                    required: bool = True) -> None:
    """``--model`` or ``--profile`` (one of them ``required``: otherwise the command checks),
    ``--batch-size`` and ``--data``."""
    source = p.add_mutually_exclusive_group(required=required)
    source.add_argument("--model", help="profile this model spec locally first (e.g. vgg)")
    source.add_argument("--profile", help="profile file: tandem JSON or PipeDream graph.txt")
    p.add_argument("--batch-size", type=int, default=batch_default, help=batch_help)
    p.add_argument("--data", default=None, help="with --model: dataset spec")
    p.add_argument("--split-points", default=None, metavar="NAME,...",
                   help="with --model, not an nn.Sequential: its blocks start at these submodules")


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """``--devices``/``--bandwidth`` or ``--cluster``."""
    p.add_argument("--devices", type=int,
                   help="number of devices of a flat cluster (16GB each unless --memory)")
    p.add_argument("--bandwidth", help="link bandwidth of a flat cluster, e.g. 10Gb/s")
    p.add_argument("--cluster", help="cluster spec (8x300GB/s,4x25Gb/s), YAML file or preset")


def build_cluster(args: argparse.Namespace) -> Cluster:
    """The cluster from ``--cluster`` or ``--devices``/``--bandwidth`` (a flat cluster, its
    devices :data:`tandem.cluster.FLAT_MEMORY` each, as the V100 presets)."""
    if args.cluster is not None:
        if args.devices is not None or args.bandwidth is not None:
            raise UsageError("give either --cluster or --devices with --bandwidth, not both")
        return parse_cluster(args.cluster)
    if args.devices is None or args.bandwidth is None:
        raise UsageError("describe the cluster: --devices N --bandwidth 10Gb/s, or --cluster SPEC")
    return flat_cluster(num_devices=args.devices, bandwidth=args.bandwidth, memory=FLAT_MEMORY)


def with_memory(cluster: Cluster, memory: str | None) -> Cluster:
    """``cluster`` with its per-device memory replaced by ``--memory`` when given."""
    if not memory:
        return cluster
    return dataclasses.replace(cluster, memory_bytes=parse_size(memory))


def load_source(args: argparse.Namespace, *, default_batch: int = 32) -> ModelProfile:
    """The profile from ``--profile``, or measured from ``--model`` at ``--batch-size``."""
    if args.profile is not None:
        if getattr(args, "split_points", None) is not None:
            raise UsageError("--split-points chooses the blocks of a --model to profile; a "
                             "--profile already has its layers")
        return load_profile(args.profile)
    from tandem.commands.profile import measure

    batch = args.batch_size if args.batch_size is not None else default_batch
    return measure(args.model, batch, args.data,
                   split_points=getattr(args, "split_points", None))


def batch_scale(profile: ModelProfile, batch_size: int | None, profile_batch: int | None) -> float:
    """The global minibatch ``batch_size`` in units of the profile's minibatch (1 if not given).

    The profile's minibatch comes from the profile or, for profiles that do not record it
    (PipeDream's graph.txt), from ``--profile-batch``.
    """
    if batch_size is None:
        return 1.0
    if batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1 (got {batch_size})")
    measured = profile_batch or profile.batch_size
    if not measured:
        raise UsageError(
            f"the profile does not record the minibatch it was measured at, so --batch-size "
            f"{batch_size} cannot be related to it: add --profile-batch N (e.g. 128 for "
            f"PipeDream's VGG-16 profile)"
        )
    return batch_size / measured
