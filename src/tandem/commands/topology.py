"""``tandem topology``: print the mixing matrix of a gossip topology and its spectral gap."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from tandem import strict_json
from tandem.topology import WEIGHTS, build_topology, mixing_matrix, spectral_gap


def run(args: argparse.Namespace) -> int:
    graph = build_topology(args.kind, args.n)
    matrix = mixing_matrix(graph, args.weights)
    gap = spectral_gap(matrix)
    if args.json:
        print(strict_json.dumps({"kind": args.kind, "n": args.n, "weights": args.weights,
                                 "spectral_gap": gap, "matrix": matrix.tolist(),
                                 "neighbours": [sorted(n) for n in graph]}))
        return 0
    with np.printoptions(precision=3, suppress=True, linewidth=200):
        print(f"{args.kind} on {args.n} workers, {args.weights} weights: "
              f"{sum(map(len, graph)) // 2} links")
        print(matrix)
    rounds = float("inf") if gap <= 0 else np.log(10.0) / -np.log(max(1e-300, 1.0 - gap))
    print(f"spectral gap {gap:.4f}: disagreement shrinks at least {1 - gap:.4f}x per round "
          f"(about {rounds:.1f} rounds per 10x)")
    return 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "topology", help="mixing matrix and spectral gap of a gossip topology",
        description="Print the doubly stochastic mixing matrix that gossip SGD uses on a "
        "topology, and its spectral gap (1 - second largest eigenvalue magnitude).",
    )
    parser.add_argument("--kind", default="ring",
                        help="ring, torus, exponential, complete, or custom:0-1,1-2,...")
    parser.add_argument("--n", type=int, default=8, help="number of workers")
    parser.add_argument("--weights", default="metropolis", choices=WEIGHTS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)
