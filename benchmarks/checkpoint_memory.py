"""How much a sharded checkpoint raises a rank's peak memory: tandem's writer
(``tandem.runtime.sharded_checkpoint.save_sharded``) against plain ``torch.distributed.checkpoint``
code (``dcp.save(get_state_dict(model, optimizer), checkpoint_id=...)``), gpt with Adam under
FSDP2 on one process.

On a GPU, DCP's file writer copies each tensor to host memory and keeps every copy of a file
until the file is closed, so one file per rank stages the rank's whole state in host memory;
tandem writes one file per tensor there. On a CPU nothing is copied and both write one file per
rank. Each side runs in a process of its own (the peak resident memory, ``VmHWM``, only grows):
it builds the model, takes one optimizer step, then saves once, and reports the state it holds
(parameters, gradients, optimizer state: the bytes of each local shard), the growth of its
peak resident memory over the save, and on a GPU the growth of its peak device memory.
Prints a table, then one JSON object on the last line (``host_growth_ratio``: the growth under
tandem's writer over the plain one's; ``tandem_growth_over_state``: tandem's growth over the
state the rank holds, the rule the tests check on CPUs being at most 1).

    python3 benchmarks/checkpoint_memory.py [--model gpt:...] [--backend gloo]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from same_run import run_workers  # benchmarks/ is on sys.path when a script runs

MODEL = "gpt:layers=12,dim=768,heads=12,dropout=0"
DATA = "tokens:n=256,seq=256,vocab=8192"


def held_bytes(model, optimizer) -> int:
    """The bytes of the local shards of ``model``'s parameters and gradients and of
    ``optimizer``'s state."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    total = 0
    for param in model.parameters():
        total += local(param).nbytes
        if param.grad is not None:
            total += local(param.grad).nbytes
    for state in optimizer.state.values():
        total += sum(local(v).nbytes for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def worker(args: argparse.Namespace) -> None:
    """One side, one process under torchrun: build, one step, one save."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn import functional as F

    from tandem.data.builtin import build_dataset
    from tandem.models import build_model
    from tandem.runtime.dist import init_worker
    from tandem.runtime.memory import peak_rss_bytes
    from tandem.runtime.sharded_checkpoint import save_sharded

    env = init_worker(backend=args.backend, timeout_s=300, threads=4)
    cuda = env.device.type == "cuda"
    data = build_dataset(args.data)
    torch.manual_seed(0)
    model = build_model(args.model, data.info).to(env.device)
    mesh = init_device_mesh(env.device.type, (1,))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = data.train.inputs[: args.batch_size].to(env.device)
    targets = data.train.targets[: args.batch_size].to(env.device)
    logits = model(inputs)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
    optimizer.step()
    held = held_bytes(model, optimizer)
    del logits
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (imports are not the save's)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    device_before = torch.cuda.memory_allocated() if cuda else 0
    before = peak_rss_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        if args.side == "tandem":
            save_sharded(Path(tmp), 1, model, optimizer)
        else:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            save({"model": model_state, "optimizer": optimizer_state},
                 checkpoint_id=str(Path(tmp) / "plain.dcp"))
        files = sum(1 for _ in Path(tmp).rglob("*.distcp"))
    growth = peak_rss_bytes() - before
    device_growth = (torch.cuda.max_memory_allocated() - device_before) if cuda else 0
    print(json.dumps({"side": args.side, "held_bytes": held, "host_growth_bytes": growth,
                      "device_growth_bytes": device_growth, "files": files,
                      "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "torch": torch.__version__}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--backend", default="nccl", help="gloo: the same on the CPU")
    parser.add_argument("--side", default="tandem", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sides = {side: run_workers(__file__, [*sys.argv[1:], "--side", side], nproc=1)
             for side in ("plain", "tandem")}
    mb = 1e6
    print(f"{sides['tandem']['device']}, torch {sides['tandem']['torch']}, {args.model}, Adam")
    print(f"{'':28}{'state held':>12}{'host growth':>13}{'device growth':>15}{'files':>7}")
    for name, side in (("plain dcp.save", sides["plain"]), ("tandem save_sharded", sides["tandem"])):
        print(f"{name:28}{side['held_bytes'] / mb:9.1f} MB{side['host_growth_bytes'] / mb:10.1f} MB"
              f"{side['device_growth_bytes'] / mb:12.1f} MB{side['files']:7d}")
    plain, ours = sides["plain"]["host_growth_bytes"], sides["tandem"]["host_growth_bytes"]
    print(json.dumps({"benchmark": "checkpoint_memory", "device": sides["tandem"]["device"],
                      "torch": sides["tandem"]["torch"], "model": args.model,
                      "held_bytes": sides["tandem"]["held_bytes"],
                      "plain_host_growth_bytes": plain, "tandem_host_growth_bytes": ours,
                      "plain_device_growth_bytes": sides["plain"]["device_growth_bytes"],
                      "tandem_device_growth_bytes": sides["tandem"]["device_growth_bytes"],
                      "host_growth_ratio": ours / plain if plain else None,
                      "tandem_growth_over_state": ours / sides["tandem"]["held_bytes"]}))


if __name__ == "__main__":
    main()
