"""Checks of a job that need its data, its model or this machine, run by ``tandem train`` before
any worker starts: the data and model can be built, the batch fits the data, the model's output
fits the loss, and the local workers fit this machine's memory (an error) and cores (a warning).

Usage::

    data, model = build_checked(job.run)
    check_batch(job.run, data)
    check_output(model, data, job.run)
    note = check_machine(job.run, model)     # raises if the workers cannot fit in memory
    if note:
        warn(note)                           # a MachineWarning, just before the workers start
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem import structures
from tandem.data import Data, dataset_bytes
from tandem.errors import MachineWarning, TandemWarning, UsageError
from tandem.loss import checked_loss, cross_entropy, load_loss, loss_name
from tandem.models import build_model
from tandem.runtime.config import RunConfig

WORKER_RUNTIME_BYTES = 100 * 2**20
"""What a worker holds beyond the parent's memory after it built the model and data: its process
group, communication buffers and bookkeeping (measured ~70 MB with gloo and DDP)."""
PARAMETER_COPIES = 3
"""Parameter-sized buffers a worker adds to its model: gradients, optimizer state, DDP buckets."""
MEMORY_FRACTION = 0.75
"""Share of the available memory the workers may take: the rest stays for the system, the
machine's other users and the workers' start-up peaks (the estimate is of their steady state)."""


def warn(message: str, category: type[TandemWarning] = MachineWarning) -> None:
    """Warn the user (``tandem: warning: <message>`` on the command line's stderr)."""
    warnings.warn(message, category, stacklevel=3)


def build_checked(run: RunConfig, objects: Any = None, *, shares: int = 1,
                  meta: bool = False, data: Data | None = None) -> tuple[Data, nn.Module]:
    """The run's data and model (from its specs, or the user's ``objects``). One that would not
    fit in memory is refused before it is built where its size can be told in advance (the
    dataset's options, the model's parameters built on the ``meta`` device), and if building it
    runs out of memory, counting ``1 / shares`` of the model per worker. With ``meta`` a model
    that can be built in pieces comes on the meta device (workers that build it in pieces, or
    a caller that needs only its structure), so that no process builds it whole. ``data``: the
    run's data, built already (then used as it is)."""
    from tandem.runtime.task import Task

    available = available_memory_bytes()
    if data is None and (objects is None or objects.train is None):
        _check_fits(f"--data {run.data}", dataset_bytes(run.data), available,
                    "a smaller dataset (n, size)")
    try:
        task = Task(run, objects, data=data)
    except (MemoryError, RuntimeError) as exc:
        raise _too_big(exc, f"--data {run.data}", "a smaller dataset (n, size)") from None
    data = task.data
    if objects is None or objects.model is None:
        parameters = meta_parameter_bytes(run.model, data)
        _check_fits(f"--model {run.model}", None if parameters is None
                    else (1 + PARAMETER_COPIES) * parameters // shares, available,
                    "a smaller model (fewer or narrower layers)")
    try:
        model = task.build_model(meta=meta)
    except (MemoryError, RuntimeError) as exc:
        raise _too_big(exc, f"--model {run.model}", "a smaller model (fewer or narrower "
                       "layers)") from None
    return data, model


def _check_fits(what: str, needed: int | None, available: int | None, fix: str) -> None:
    if needed is None or available is None or needed <= available * MEMORY_FRACTION:
        return
    raise UsageError(f"{what} needs about {_size(needed)} of memory to train but this machine "
                     f"has {_size(available)} available; use {fix}")


def meta_parameter_bytes(spec: str, data: Data) -> int | None:
    """Bytes of the parameters of model ``spec``, built on the ``meta`` device (no memory);
    None for a model that cannot be built there."""
    try:
        with torch.device("meta"):
            model = build_model(spec, lambda: data.info)
        return sum(p.numel() * p.element_size() for p in model.parameters())
    except UsageError:
        raise
    except Exception:  # a builder that needs real tensors: its size is not known in advance
        return None


def _too_big(exc: BaseException, what: str, fix: str) -> BaseException:
    text = str(exc).lower()
    if isinstance(exc, MemoryError) or "allocate" in text or "out of memory" in text:
        return UsageError(f"{what} does not fit in this machine's memory "
                          f"({_first_line(exc) or 'MemoryError'}); use {fix}")
    return exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:200] if lines else ""


def check_data(run: RunConfig, data: Data, objects: Any = None) -> None:
    """The user's ``collate_fn`` makes a batch of the first items of each split, and the
    user's sampler gives the same order when asked twice (:func:`tandem.data.collate.
    check_collate`, :func:`tandem.data.user_sampler.check_order`), here rather than in every
    worker; ``pin_memory`` needs the workers on GPUs."""
    from tandem.data.collate import check_collate
    from tandem.data.user_sampler import SamplerOrder, check_order
    from tandem.runtime.dist import choose_backend

    check_collate(data.train, batch_size=run.batch_size)
    if data.test is not data.train:
        check_collate(data.test, batch_size=run.batch_size)
    sampler = getattr(objects, "sampler", None)
    if sampler is not None:
        order = SamplerOrder(sampler, seed=run.seed, num_items=len(data.train))
        check_order(order)
        if order.length < max(run.batches()):
            raise UsageError(f"sampler {type(sampler).__name__} gives {order.length} samples an "
                             f"epoch, fewer than a global batch of {max(run.batches())}; use a "
                             f"smaller batch_size, or a sampler with more samples")
    if run.loader.pin_memory and choose_backend(run.backend) != "nccl":
        raise UsageError("loader option pin_memory=True pins batches for their copy to a GPU, "
                         "and this run's workers train on the CPU (gloo); drop it")


def check_batch(run: RunConfig, data: Data) -> None:
    """A global batch (each of a ``--batch-schedule``) takes at most the whole training split;
    ``--batch-schedule auto`` needs samples held, whose order does not depend on the batches
    to come (a shard stream's epoch order does)."""
    samples = len(data.train)
    if run.batch_size > samples:
        raise UsageError(f"--batch-size {run.batch_size} is more than the {samples} training "
                         f"samples of --data {run.data}; use at most {samples}, or more data")
    for batch in run.batches():
        if batch > samples:
            raise UsageError(f"--batch-schedule {run.batch_schedule} has a batch of {batch}, "
                             f"more than the {samples} training samples of --data {run.data}; "
                             f"use batches of at most {samples}")
    if run.batch_schedule == "auto" and data.train.streams:
        raise UsageError(f"--batch-schedule auto cannot stream --data {run.data} (a shard "
                         f"stream's epoch is cut for the batches to come, which auto decides "
                         f"as it goes); give the schedule, e.g. --batch-schedule 64@0,128@200")


def check_output(model: nn.Module, data: Data, run: RunConfig, objects: Any = None) -> None:
    """One sample through the model (in eval mode, without gradients, on the model's device):
    it must run, and the loss must take its output (:func:`check_loss_input`)."""
    batch = data.train.rows(0, 1)
    device = next(model.parameters(), torch.empty(0)).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = structures.call_model(model, structures.to_device(batch.inputs, device))
    except UsageError:
        raise
    except Exception as exc:  # the user's model cannot take the data: say so, in one line
        shown = (f"input shape {tuple(batch.inputs.shape)}"
                 if isinstance(batch.inputs, torch.Tensor)
                 else f"inputs: {structures.describe(batch.inputs)}")
        raise UsageError(
            f"--model {run.model} fails on one sample of --data {run.data} ({shown}): "
            f"{type(exc).__name__}: {_first_line(exc)}; make the model take this input") from None
    finally:
        model.train(training)
    if objects is not None and objects.loss is not None:
        loss_fn, label = objects.loss, loss_name(objects.loss)
    else:
        loss_fn, label = load_loss(run.loss), loss_name(run.loss)
    if loss_fn is cross_entropy:
        check_loss_input(output, batch.targets, data, run)
    checked_loss(loss_fn, output, structures.to_device(batch.targets, device), name=label)


def check_loss_input(output: Any, targets: Any, data: Data, run: RunConfig) -> None:
    """The model's output must suit the default loss, cross-entropy on logits
    (:func:`tandem.loss.cross_entropy`): float logits with one row per target and, where the
    data says how many classes it has, one logit per class."""
    logits = structures.logits_of(output)
    if logits is None or not logits.is_floating_point() or logits.dim() < 1:
        raise UsageError(
            f"--model {run.model} returns {_describe(output)}, but the loss (cross-entropy) "
            f"needs float logits (a tensor, or a .logits field), one row per target; make it "
            f"return them, or give --loss package.module:function")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point():
        raise UsageError(
            f"--data {run.data} gives {structures.describe(targets)} as targets, but the loss "
            f"(cross-entropy) needs integer class indices; give --loss package.module:function")
    if data.has_info:
        classes = data.info.num_classes
        kind = "classes" if data.info.task == "classify" else "tokens in its vocabulary"
        if logits.shape[-1] != classes:
            raise UsageError(
                f"--model {run.model} outputs {logits.shape[-1]} logits per prediction, but "
                f"--data {run.data} has {classes} {kind}; make its last layer output {classes}")
    predictions, expected = logits.numel() // logits.shape[-1], targets.numel()
    if predictions != expected:
        raise UsageError(
            f"--model {run.model} makes {predictions} predictions (output shape "
            f"{tuple(logits.shape)}) for a batch of --data {run.data} with {expected} targets "
            f"(shape {tuple(targets.shape)}); make it output one row of logits per target")


def _describe(output: Any) -> str:
    return structures.describe(output)


def check_machine(run: RunConfig, model: nn.Module, shares: int = 1) -> str | None:
    """Refuse local workers that cannot fit in memory (each holding ``1 / shares`` of the
    model's state); return a warning if they will share this machine's cores (or GPUs), else
    None."""
    per_worker = worker_bytes(model, shares)
    available = available_memory_bytes()
    if per_worker is not None and available is not None:
        check_memory(run.nproc, per_worker, available)
    return sharing_warning(run)


def worker_bytes(model: nn.Module, shares: int = 1) -> int | None:
    """Estimated memory of one worker: this process's own (PyTorch, the model and the data,
    just built), plus a worker's runtime and its share of parameter-sized buffers; None if
    unknown."""
    own = private_memory_bytes()
    if own is None:
        return None
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    return own + WORKER_RUNTIME_BYTES + PARAMETER_COPIES * parameters // shares


def check_memory(nproc: int, per_worker_bytes: int, available_bytes: int) -> None:
    """Refuse ``nproc`` workers of ``per_worker_bytes`` each that exceed the usable share of
    ``available_bytes`` (one worker is always allowed: this process already runs)."""
    usable = available_bytes * MEMORY_FRACTION
    fits = int(usable // per_worker_bytes)
    if nproc <= max(1, fits):
        return
    raise UsageError(
        f"--nproc {nproc} needs about {_size(nproc * per_worker_bytes)} of memory ({nproc} "
        f"workers x ~{_size(per_worker_bytes)}: PyTorch, the model and the data in each) but "
        f"this machine has {_size(available_bytes)} available; use --nproc {max(1, fits)} or "
        f"fewer")


def _size(num_bytes: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 2**20:.0f} MiB"


def private_memory_bytes() -> int | None:
    """Memory this process alone holds (Linux ``Private_*`` of ``smaps_rollup``, else its
    resident size); None where unknown."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
        return 1024 * sum(int(line.split()[1]) for line in text.splitlines()
                          if line.startswith(("Private_Clean:", "Private_Dirty:")))
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def available_memory_bytes() -> int | None:
    """Memory new processes can take: the kernel's ``MemAvailable``, within a cgroup's limit
    if one is set; None where unknown."""
    free: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = int(Path(limit).read_text())
            if cap < 2**60:
                free.append(max(0, cap - int(Path(usage).read_text())))
        except (OSError, ValueError):
            continue
    return min(free) if free else None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def sharing_warning(run: RunConfig) -> str | None:
    """What to expect when local workers outnumber the GPUs or (with their threads) the cores;
    None when they do not. Emulated models sleep instead of computing, so they share nothing."""
    if run.backend != "gloo" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        if run.nproc <= gpus:
            return None
        return (f"--nproc {run.nproc} on {gpus} GPU(s): workers will share the GPUs; expect each "
                f"step to take ~{-(-run.nproc // gpus)}x longer than with one GPU per worker, "
                f"and NCCL may refuse two workers on one GPU (use --nproc {gpus}, or --backend "
                f"gloo)")
    if run.model.split(":", 1)[0] == "emulated":
        return None
    cores, threads = usable_cores(), run.nproc * run.threads
    if threads <= cores:
        return None
    what = f"--nproc {run.nproc}" + (f" --threads {run.threads} ({threads} threads)"
                                     if run.threads > 1 else "")
    return (f"{what} on {cores} core{'s' if cores > 1 else ''}: workers will time-share the "
            f"cores; expect each step to take ~{threads / cores:.3g}x longer than with one worker "
            f"per core")
