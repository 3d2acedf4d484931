"""The training loop of one worker: data shards, synchronized steps, evaluation, checkpoints.

Every worker runs :func:`train_worker` with the same ``TrainConfig``; rank 0 returns the run's
summary and writes the outputs. The loss of each step is the mean over the *global* batch, so
any number of workers computes the same update as one process on the same data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from tandem.data import DataBundle, GlobalBatchSampler, Split, build_dataset, shard_sizes
from tandem.models import build_model
from tandem.runtime.checkpoint import CHECKPOINT_VERSION, load_checkpoint, save_atomic
from tandem.runtime.config import TrainConfig
from tandem.runtime.dist import WorkerEnv, init_worker
from tandem.runtime.reporting import Reporter
from tandem.runtime.watchdog import Heartbeat, is_communication_error
from tandem.sync import SyncStrategy, build_strategy
from tandem.timeline import Event, Timeline

MAX_TRACED_STEPS = 1000
EVAL_CHUNK = 1024


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over every prediction (one per sample, or one per token)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def build_optimizer(config: TrainConfig, params: Any) -> torch.optim.Optimizer:
    """The optimizer named in ``config``."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay)
    cls = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=config.lr, weight_decay=config.weight_decay)


def lr_factor(config: TrainConfig, step: int) -> float:
    """Learning-rate multiplier at ``step``: linear warm-up, then constant or cosine decay."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "cosine":
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0


def train_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Run the whole training job as this worker; rank 0 returns the summary."""
    start = time.perf_counter()
    env = init_worker(backend=config.backend, timeout_s=config.timeout_s, threads=config.threads)
    store = dist.distributed_c10d._get_default_store()
    try:
        config.check_world(env.world_size)
        with Heartbeat(store, env.rank, env.world_size) as beat:
            try:
                summary = Trainer(config, env, beat).run()
            except RuntimeError as exc:
                if is_communication_error(exc):
                    raise beat.diagnose(exc) from exc
                raise
        if summary is not None:
            summary["wall_s"] = round(time.perf_counter() - start, 3)
        return summary
    finally:
        dist.destroy_process_group()


class Trainer:
    """State of one worker's run; :meth:`run` trains, evaluates and saves."""

    def __init__(self, config: TrainConfig, env: WorkerEnv, beat: Heartbeat) -> None:
        self.config = config
        self.env = env
        self.beat = beat
        self.out = Path(config.out) if config.out else None
        self.data: DataBundle = build_dataset(config.data)
        torch.manual_seed(config.seed)
        model = build_model(config.model, self.data.info)
        self.strategy: SyncStrategy = build_strategy(config.strategy)
        self.first_step = 0
        checkpoint = self._load_checkpoint()
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
        self.module = self.strategy.wrap(model, env.device)
        self.model = self.strategy.unwrap(self.module)
        self.optimizer = build_optimizer(config, self.module.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(config, step)
        )
        if checkpoint is not None:
            self._restore(checkpoint)
        self.train = _to_device(self.data.train, env.device)
        self.test = _to_device(self.data.test, env.device)
        self.sampler = GlobalBatchSampler(len(self.train), global_batch_size=config.batch_size,
                                          seed=config.seed)
        self.predictions_per_sample = self.train.targets[0].numel()
        self.events: list[Event] = []
        self.step_times: list[float] = []
        self.epoch_start = time.perf_counter()
        self.loss_total = torch.zeros((), device=env.device)
        self.loss, self.logged = math.nan, self.first_step
        self.reporter = Reporter(
            enabled=env.rank == 0, show_progress=config.progress, total_steps=config.steps,
            metrics_path=self.out / "metrics.jsonl" if self.out else None,
            first_step=self.first_step,
        )

    def _load_checkpoint(self) -> dict[str, Any] | None:
        if self.config.resume is None:
            return None
        path = self.out / "checkpoint.pt" if self.config.resume == "auto" and self.out else Path(
            str(self.config.resume))
        return load_checkpoint(path, self.config.fingerprint())

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.first_step = int(checkpoint["step"])
        rng_states = checkpoint["rng"]
        if len(rng_states) == self.env.world_size:
            torch.set_rng_state(rng_states[self.env.rank])

    def run(self) -> dict[str, Any] | None:
        """Train from the first step to the last (or ``--stop-after``); rank 0 returns a summary."""
        config = self.config
        last_step = config.stop_after if config.stop_after is not None else config.steps
        with self.reporter:
            self.train_steps(self.first_step, last_step)
            evaluation = self.evaluate()
            self.reporter.record(step=last_step, **evaluation)
        finished = last_step == config.steps
        self._write_outputs(finished)
        if self.env.rank != 0:
            return None
        return self._summary(last_step, evaluation, finished)

    def train_steps(self, first: int, last: int) -> None:
        """Optimizer steps ``first`` to ``last - 1``, with logging, evaluation and checkpoints."""
        config, reporter = self.config, self.reporter
        self.module.train()
        for step in range(first, last):
            self.loss_total += self.train_step(step)
            reporter.advance()
            done = step + 1
            if done % config.log_every == 0 or done == last:
                self.loss = self._global_loss(self.loss_total, range(self.logged, done))
                reporter.record(step=done, loss=self.loss, lr=self.scheduler.get_last_lr()[0],
                                samples_per_s=self._samples_per_s(done - self.logged))
                self.loss_total.zero_()
                self.logged = done
            if config.eval_every and done % config.eval_every == 0 and done < last:
                reporter.record(step=done, **self.evaluate())
            if done == last or (config.checkpoint_every and done % config.checkpoint_every == 0):
                self._save_checkpoint(done)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step on this worker's share of global batch ``step``; returns its loss sum."""
        start = time.perf_counter()
        global_count = len(self.sampler.global_indices(step)) * self.predictions_per_sample
        indices = self.sampler.local_indices(step, rank=self.env.rank, world_size=self.env.world_size)
        scale = self.env.world_size / global_count
        inputs = self.train.inputs[indices].tensor_split(self.config.accumulate)
        targets = self.train.targets[indices].tensor_split(self.config.accumulate)
        loss_total = torch.zeros((), device=self.env.device)
        traced = step - self.first_step < MAX_TRACED_STEPS
        for micro_index, (x, y) in enumerate(zip(inputs, targets)):
            last = micro_index == len(inputs) - 1
            t0 = time.perf_counter()
            self.beat.step, self.beat.phase = step, "forward"
            with contextlib.nullcontext() if last else self.strategy.accumulating(self.module):
                loss = loss_sum(self.module(x), y)
                t1 = time.perf_counter()
                self.beat.phase = "backward"
                (loss * scale).backward()
            loss_total += loss.detach()
            if traced:
                self._trace("forward", t0, t1, step)
                self._trace("backward", t1, time.perf_counter(), step)
        t2 = time.perf_counter()
        self.beat.phase = "step"
        self.strategy.before_step(self.module)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.strategy.after_step(self.module)
        end = time.perf_counter()
        if traced:
            self._trace("step", t2, end, step)
        self.step_times.append(end - start)
        return loss_total

    def _trace(self, name: str, start: float, end: float, step: int) -> None:
        self.events.append(Event(worker=self.env.rank, name=name, start_s=start - self.epoch_start,
                                 end_s=end - self.epoch_start, step=step))

    def _global_loss(self, loss_total: torch.Tensor, steps: range) -> float:
        """Mean loss per prediction over the global batches of ``steps``."""
        count = sum(len(self.sampler.global_indices(s)) for s in steps) * self.predictions_per_sample
        total = loss_total.clone()
        dist.all_reduce(total)
        return float(total) / count

    def _samples_per_s(self, num_steps: int) -> float:
        window = self.step_times[-num_steps:]
        return self.config.batch_size * len(window) / max(sum(window), 1e-12)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Accuracy and mean loss on the test split, each worker scoring its own shard."""
        self.beat.phase = "evaluate"
        self.model.eval()
        sizes = shard_sizes(len(self.test), self.env.world_size)
        start = sum(sizes[: self.env.rank])
        totals = torch.zeros(3, dtype=torch.float64, device=self.env.device)
        for chunk_start in range(start, start + sizes[self.env.rank], EVAL_CHUNK):
            chunk_end = min(chunk_start + EVAL_CHUNK, start + sizes[self.env.rank])
            x = self.test.inputs[chunk_start:chunk_end]
            y = self.test.targets[chunk_start:chunk_end]
            logits = self.model(x)
            totals[0] += (logits.argmax(-1) == y).sum()
            totals[1] += loss_sum(logits, y).double()
            totals[2] += y.numel()
        dist.all_reduce(totals)
        self.model.train()
        correct, loss, count = totals.tolist()
        return {"test_accuracy": correct / count, "test_loss": loss / count}

    def _save_checkpoint(self, step: int) -> None:
        if self.out is None:
            return
        rng_states: list[torch.Tensor | None] = [None] * self.env.world_size
        dist.all_gather_object(rng_states, torch.get_rng_state())
        if self.env.rank != 0:
            return
        save_atomic({
            "version": CHECKPOINT_VERSION, "step": step, "fingerprint": self.config.fingerprint(),
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "rng": rng_states,
        }, self.out / "checkpoint.pt")

    def _write_outputs(self, finished: bool) -> None:
        gathered: list[list[Event] | None] = [None] * self.env.world_size
        dist.all_gather_object(gathered, self.events)
        if self.env.rank != 0 or self.out is None:
            return
        events = [event for worker_events in gathered for event in worker_events or []]
        Timeline(events=events).write(self.out / "trace.json")
        (self.out / "config.json").write_text(json.dumps(dataclasses.asdict(self.config), indent=2))
        if finished:
            state = {name: tensor.detach().cpu() for name, tensor in self.model.state_dict().items()}
            save_atomic(state, self.out / "final.pt")

    def _summary(self, last_step: int, evaluation: dict[str, float],
                 finished: bool) -> dict[str, Any]:
        timed = self.step_times[min(len(self.step_times) - 1, 2):]
        train_s = sum(self.step_times)
        return {
            "strategy": self.config.strategy, "model": self.config.model, "data": self.config.data,
            "world_size": self.env.world_size, "backend": self.env.backend,
            "steps": last_step, "finished": finished, "global_batch_size": self.config.batch_size,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "final_loss": self.loss, **evaluation,
            "samples_per_s": self.config.batch_size * len(self.step_times) / max(train_s, 1e-12),
            "step_time_s": statistics.median(timed) if timed else 0.0,
            "train_s": round(train_s, 4), "out": str(self.out) if self.out else None,
        }


def _to_device(split: Split, device: torch.device) -> Split:
    return Split(inputs=split.inputs.to(device), targets=split.targets.to(device))

