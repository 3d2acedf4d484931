"""The server side of parameter-server training: hold a shard of the model and its optimizer,
apply the workers' gradient pushes (synchronously, asynchronously or with bounded staleness),
send parameters back, and at the end gather the model on server 0 to evaluate and save it.

With ``--compress``, the server decodes compressed pushes and sends each worker compressed
differences from the copy of the shard that worker holds (see :mod:`tandem.sync.ps_protocol`).
Server 0 sums the traffic the workers report in their headers into the metrics and summary,
and holds the model's buffers: in ``sync`` mode it takes those of the lowest-ranked worker
whose push the step applies (as DDP broadcasts rank 0's), in ``async`` and ``ssp`` mode those of
each push it applies, and sends them back with the parameters, so ``final.pt`` holds both.

The server's model and optimizer live on the CPU, and all its messages travel on a gloo group
(:func:`~tandem.sync.side_group.cpu_group`), also when the workers train on GPUs with NCCL.
"""

from __future__ import annotations

import copy
import math
import queue
import threading
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tandem.spec.batch_schedule import batch_at
from tandem.errors import WorkerFailure
from tandem.loss import evaluation
from tandem.runtime.task import Task
from tandem.runtime.base import (
    GANTT_STEPS,
    MAX_TRACED_STEPS,
    Worker,
    build_optimizer,
    batch_lr_factor,
    lr_factor,
    merge_worker_traces,
    plan_summary,
    save_worker_trace,
    scaled_lr,
    write_run_files,
)
from tandem.runtime.asynchrony import (
    Compensation, apply_compensation, compensation_for, restore_momentum,
)
from tandem.runtime.checkpoint import (
    CHECKPOINT_VERSION, load_checkpoint, resume_path, save_atomic,
)
from tandem.runtime.config import Job
from tandem.runtime.dist import WorkerEnv
from tandem.runtime.divergence import diverged, first_non_finite
from tandem.runtime.faults import announce_resume
from tandem.runtime.noise_scale import NoiseScale
from tandem.runtime.reporting import Reporter
from tandem.runtime.watchdog import Heartbeat
from tandem.strategy import strategy_of
from tandem.sync import ps_protocol as protocol
from tandem.spec.sync import ParameterServerSync
from tandem.timeline import Event, plot_gantt
from tandem.sync.flat import flatten, state_buffers, unflatten_into
from tandem.sync.side_group import cpu_group, source_rank

LIVENESS_EVERY_S = 0.5


class Mailbox:
    """Receives the workers' messages on a background thread, so that the server can wait for
    the next one with a timeout (a timed-out gloo receive cannot be resumed). It stops once
    every one of ``num_workers`` workers has said goodbye."""

    def __init__(self, body_bytes: int, num_workers: int,
                 group: dist.ProcessGroup | None = None) -> None:
        self.body_bytes = body_bytes
        self.num_workers = num_workers
        self.group = group
        self.queue: queue.Queue[Any] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="tandem-ps-mailbox", daemon=True)
        self.thread.start()

    def get(self, timeout: float | None) -> Any:
        """The next message (or the exception that stopped the receiver)."""
        return self.queue.get(timeout=timeout)

    def _run(self) -> None:
        goodbyes: set[int] = set()
        while len(goodbyes) < self.num_workers:
            try:
                sender, message = self._receive_one()
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.queue.put(exc)
                return
            self.queue.put((sender, message))
            if protocol.Header.decode(message).kind == protocol.BYE:
                goodbyes.add(sender)

    def _receive_one(self) -> tuple[int, torch.Tensor]:
        message = protocol.empty(self.body_bytes)
        work = dist.irecv(message, src=None, tag=protocol.TO_SERVER, group=self.group)
        work.wait()
        return source_rank(work, self.group), message


class ParameterServer(Worker):
    """Server ``rank`` of the plan's ``sync.servers``: serves pushes until ``config.steps``
    steps (``per_step`` updates each: one in ``sync`` mode, one per worker otherwise)."""

    spec: type = ParameterServerSync
    """The sync spec this server serves (subclasses serve others)."""

    def __init__(self, job: Job, env: WorkerEnv, beat: Heartbeat) -> None:
        config = job.run
        if not isinstance(job.plan.sync, self.spec):
            raise TypeError(f"{type(self).__name__} needs a {self.spec.__name__} plan, not "
                            f"{job.plan.sync!r}")
        self.job, self.config, self.sync, self.env, self.beat = job, config, job.plan.sync, env, beat
        self.codec_text = job.plan.compress.text if job.plan.compress else None
        self.out = Path(config.out) if config.out else None
        self.task = Task(config, job.objects)
        torch.manual_seed(config.seed)
        self.model = self.task.build_model()
        named = list(self.model.named_parameters())
        ranges = protocol.shard_ranges([p.numel() for _, p in named], self.sync.servers)
        self.ranges = ranges
        start, end = ranges[env.rank]
        self.params = [p for _, p in named[start:end]]
        self.shapes = [p.shape for p in self.params]
        self.keys = [name for name, _ in named[start:end]]
        self.workers = list(range(self.sync.servers, env.world_size))
        self.optimizer = self._server_optimizer()
        self.compensation = self._compensation()
        if self.optimizer is not None:
            apply_compensation(self.optimizer, self.compensation)
        self.required = self._required_pushes()
        self.version = 0
        self.skipped_steps = 0
        self._clips = self._server_clips()
        self.staleness: list[int] = []
        self.dropped = 0
        self.pushes: Counter[int] = Counter()
        self.dead: set[int] = set()
        self.checked_at = time.monotonic()
        self.finished: set[int] = set()
        self.loss = [0.0, 0]
        self.samples_pushed = 0
        """Samples of every gradient pushed to this server (each push carries its count)."""
        self.batch_schedule = config.parsed_batch_schedule() or ((0, config.batch_size),)
        self.last_loss = float("nan")
        self.update_times: list[float] = []
        self.replies: dict[int, tuple[Any, torch.Tensor]] = {}
        self.decoders: dict[int, protocol.ShardCodec] = {}
        """Per worker: decodes its pushes (a codec of its own, for codecs with shared state)."""
        self.encoders: dict[int, protocol.PullEncoder] = {}
        """Per worker: its copy of this shard, and how replies to it are encoded."""
        self.codec_snapshot: tuple[int, dict[str, Any]] = (-1, {})
        """The codec state at the last update a checkpoint may be taken after (the version and
        :meth:`_codec_state`), taken before that version's replies advance the encoders."""
        self.traffic: dict[int, protocol.Traffic] = {}
        """Per worker: the traffic it reported last (all servers together)."""
        self.logged_traffic = protocol.Traffic()
        self.logged_version = 0
        self.clock_start = time.perf_counter()
        self.last_step = config.stop_after if config.stop_after is not None else config.steps
        """Steps to serve before stopping (``--stop-after``, else ``--steps``)."""
        self.per_step = self._updates_per_step()
        """Updates (``version``) per step."""
        self.last_update = self.last_step * self.per_step
        """Updates to serve before stopping."""
        self.events: list[Event] = []
        """This server's updates (``0ST``), for ``trace.json``."""
        self.buffers = protocol.Buffers(
            [b for _, b in state_buffers(self.model)] if env.rank == 0 else [])
        """The model's buffers (server 0 holds them; see the module's docstring)."""
        self.pushed_buffers: dict[int, torch.Tensor] = {}
        """``sync``: the buffers each worker pushed with the current step's gradient."""
        self._resume()
        push_codec = self._codec(feedback=True)
        self.push_bytes = push_codec.body_bytes
        self.group = cpu_group(timeout_s=config.timeout_s)  # where the workers make theirs
        self.mailbox = Mailbox(self.push_bytes + self.buffers.num_bytes, len(self.workers),
                               self.group)

    def _server_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that applies the pushed gradients to this server's shard."""
        return build_optimizer(self.config, self.params) if self.params else None

    def _compensation(self) -> Compensation:
        """How the optimizer compensates stale updates: asynchronous ones are as stale as the
        other workers' pushes between two of one's, each of one worker's share of the batch
        (:mod:`tandem.runtime.asynchrony`)."""
        delay = len(self.workers) - 1 if self.sync.mode != "sync" else 0
        return compensation_for(self.config, delay, share=1 / len(self.workers))

    def _updates(self) -> int:
        """Updates of the model so far (the summary's ``updates``)."""
        return self.version

    def _updates_per_step(self) -> int:
        """Updates per step (:meth:`ParameterServerSync.updates_per_step`)."""
        return self.sync.updates_per_step(len(self.workers))

    def _required_pushes(self) -> int:
        """``sync`` mode: pushes a step applies (all but the backup workers')."""
        return len(self.workers) - self.sync.backup

    def _server_clips(self) -> bool:
        """Whether ``--clip-grad-norm`` clips here (see ``ParameterServerSync.server_clips``)."""
        return self.config.clip_grad_norm is not None and self.sync.server_clips

    def _reply_values(self, worker: int) -> torch.Tensor:
        """The flat shard a reply to ``worker`` carries: the current parameters."""
        return flatten(self.params) if self.params else torch.zeros(0)

    def _codec(self, *, feedback: bool) -> protocol.ShardCodec:
        return protocol.ShardCodec(self.codec_text, self.shapes, self.keys, feedback=feedback)

    # -- messages --------------------------------------------------------------------------------

    def _receive(self, poll: bool) -> tuple[int, protocol.Header, torch.Tensor | None] | None:
        """The next message from any worker: (sender, header, decoded gradient shard of a push).

        A push's buffers (server 0) are kept in :attr:`pushed_buffers` until the step applies.

        Every push is decoded, in the order each worker sent them (codecs whose decoding has
        state advance in step with the sender's). With ``poll``, gives up after
        ``LIVENESS_EVERY_S`` to check which workers went silent, and returns None.
        """
        if poll and time.monotonic() - self.checked_at > LIVENESS_EVERY_S:
            self._check_liveness()  # also while messages flow: a stuck worker sends none
        try:
            item = self.mailbox.get(timeout=LIVENESS_EVERY_S if poll else None)
        except queue.Empty:
            self._check_liveness()
            return None
        if isinstance(item, BaseException):
            raise item
        sender, message = item
        header = protocol.Header.decode(message)
        self.traffic[sender] = header.traffic
        if header.kind != protocol.PUSH:
            return sender, header, None
        data = protocol.body(message)
        if self.buffers.num_bytes:
            self.pushed_buffers[sender] = data[self.push_bytes:]
        if not self.params:
            return sender, header, None
        if sender not in self.decoders:
            self.decoders[sender] = self._codec(feedback=False)
        return sender, header, self.decoders[sender].decode(data[:self.push_bytes])

    def _reply(self, worker: int, stop: bool = False) -> None:
        """Send the current parameters (without waiting: the previous reply to ``worker`` has
        arrived, since it has sent again, so at most one send per worker is in flight)."""
        try:
            previous = self.replies.pop(worker, None)
            if previous is not None:
                previous[0].wait()
            if worker not in self.encoders:
                self.encoders[worker] = protocol.PullEncoder(self._codec(feedback=False))
            data = self.encoders[worker].encode(self._reply_values(worker))
            header = protocol.Header(kind=protocol.PARAMS, version=self.version, stop=stop)
            outgoing = protocol.message(header, data, self.buffers.encode())
            self.replies[worker] = (dist.isend(outgoing, dst=worker, tag=protocol.TO_WORKER,
                                               group=self.group), outgoing)
        except RuntimeError:
            if self.sync.mode == "sync":
                raise
            self.dead.add(worker)

    def _finish_replies(self) -> None:
        for worker, (work, _) in list(self.replies.items()):
            try:
                work.wait()
            except RuntimeError:
                self.dead.add(worker)
        self.replies.clear()

    def _check_liveness(self) -> None:
        """Asynchronous modes go on without workers whose heartbeat stopped, or whose heartbeat
        goes on with no progress for ``--timeout`` while no server holds them back (stuck);
        either is fenced, so that it ends instead of outliving the job."""
        self.checked_at = time.monotonic()
        live = [w for w in self.workers if w not in self.finished and w not in self.dead]
        for worker in sorted(self.beat.silent(live)):
            self._give_up(worker, "stopped responding")
        held = set(self.waiting)
        # before this server's own receive gives up (--timeout after the last message)
        after_s = max(self.config.timeout_s - 2 * LIVENESS_EVERY_S, LIVENESS_EVERY_S)
        stuck = self.beat.stalled([w for w in live if w not in self.dead and w not in held],
                                  after_s=after_s)
        for worker, (step, phase) in sorted(stuck.items()):
            self._give_up(worker, f"is stuck at step {step} ({phase}), no progress for "
                                  f"{after_s:g} s")
        if self.version < self.last_update and set(self.workers) <= self.dead | self.finished:
            raise WorkerFailure(f"every worker died (ranks {', '.join(map(str, sorted(self.dead)))}); "
                                f"server {self.env.rank} stops at update {self.version}")
        self._release_waiting()

    def _give_up(self, worker: int, why: str) -> None:
        self.dead.add(worker)
        self.beat.fence(worker, why)
        if self.env.rank == 0:
            self.reporter.message(f"worker rank {worker} {why}; asynchronous training goes on "
                                  f"without it")

    # -- updates ---------------------------------------------------------------------------------

    def _apply(self, gradient: torch.Tensor | None, seen_version: int) -> None:
        start = time.perf_counter()
        staleness = self.version - seen_version
        self.staleness.append(staleness)
        if self._clips:
            gradient = self._clip(gradient)
        if gradient is not None and not bool(torch.isfinite(gradient).all()):
            self.skipped_steps += 1  # an overflowed (fp16) or diverged gradient: not applied
            gradient = None
        if self.optimizer is not None and gradient is not None:
            for p, g in zip(self.params, _split(gradient, self.params)):
                p.grad = g
            step = self.version // self.per_step
            factor = lr_factor(self.config, step) * batch_lr_factor(
                self.config, self.batch_at(step))
            if self.sync.staleness_lr:
                factor /= max(1, staleness)
            for group in self.optimizer.param_groups:
                group["lr"] = scaled_lr(self.config) * self.compensation.lr_scale * factor
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        end = time.perf_counter()
        self.update_times.append(end - start)
        if self.version <= MAX_TRACED_STEPS:
            self.events.append(Event(worker=self.env.rank, name="0ST", start_s=start - self.clock_start,
                                     end_s=end - self.clock_start, step=self.version - 1))
        self.beat.step = self.version
        self._log()
        self._maybe_evaluate()
        at_checkpoint = (self.config.checkpoint_every
                         and self.version % (self.config.checkpoint_every * self.per_step) == 0)
        if at_checkpoint or self.version == self.last_update:
            # the codecs as the workers' saved state has them: before this version's replies
            self.codec_snapshot = (self.version, self._codec_state())
        if at_checkpoint:
            self._checkpoint()

    def _maybe_evaluate(self) -> None:
        """Evaluate at an ``--eval-every`` step before the last (one server holds the whole
        model: Job refuses ``--eval-every`` with more)."""
        every = self.config.eval_every * self.per_step
        if every and self.version % every == 0 and self.version < self.last_update:
            self.reporter.record(step=self.version // self.per_step, **self._evaluate())

    def _clip(self, gradient: torch.Tensor | None) -> torch.Tensor | None:
        """Scale the step's mean gradient to ``--clip-grad-norm`` by its global norm: this
        server's shard's squared norm plus the other servers' (exchanged point-to-point; in
        sync mode every server applies every step, in the same order). Collectives the workers
        are not part of cannot be used here."""
        squared = (gradient.double().pow(2).sum().reshape(1) if gradient is not None
                   else torch.zeros(1, dtype=torch.float64))
        others = [rank for rank in range(self.sync.servers) if rank != self.env.rank]
        received = [torch.empty_like(squared) for _ in others]
        sends = [dist.isend(squared, dst=rank, tag=protocol.CLIP, group=self.group)
                 for rank in others]
        for rank, buffer in zip(others, received):
            dist.recv(buffer, src=rank, tag=protocol.CLIP, group=self.group)
        for work in sends:
            work.wait()
        norm = float(squared.sum() + sum(buffer.sum() for buffer in received)) ** 0.5
        limit = self.config.clip_grad_norm or 0.0
        if gradient is not None and norm > limit and norm == norm:
            return gradient * (limit / (norm + 1e-6))
        return gradient

    def _count_loss(self, header: protocol.Header) -> None:
        self.loss[0] += header.loss
        self.loss[1] += header.count
        self.samples_pushed += header.count

    def batch_at(self, step: int) -> int:
        """The global batch of step ``step`` (``--batch-schedule``; the workers take their
        share of the batch of the step the servers are at)."""
        return batch_at(self.batch_schedule, step)

    def _log(self) -> None:
        if self.version % self.per_step:
            return
        self.reporter.advance()
        if self.version % (self.config.log_every * self.per_step) and \
                self.version != self.last_update:
            return
        if self.loss[1]:
            elapsed = time.perf_counter() - self.started
            self.last_loss = self.loss[0] / self.loss[1]
            self.reporter.record(step=self.version // self.per_step, loss=self.last_loss,
                                 batch_size=self.batch_at(self.version // self.per_step - 1),
                                 samples_per_s=self._samples_per_s(elapsed),
                                 **self._traffic_per_step())
        self.loss = [0.0, 0]

    def _total_traffic(self) -> protocol.Traffic:
        """All workers' traffic with all servers, as last reported to this server."""
        return sum(self.traffic.values(), protocol.Traffic())

    def _traffic_per_step(self) -> dict[str, float]:
        """Bytes per step since the last metrics line (as far as the workers have reported:
        a push's header counts the replies received before it), and the compression ratio."""
        total = self._total_traffic()
        window = total - self.logged_traffic
        steps = max(1, (self.version - self.logged_version) // self.per_step)
        self.logged_traffic, self.logged_version = total, self.version
        return {"pushed_bytes_per_step": window.pushed_bytes / steps,
                "pulled_bytes_per_step": window.pulled_bytes / steps,
                "sent_bytes_per_step": window.sent_bytes / steps,
                "compression_ratio": total.compression_ratio}

    def _samples_per_s(self, elapsed: float) -> float:
        return self.samples_pushed / max(elapsed, 1e-9)

    # -- modes -----------------------------------------------------------------------------------

    def serve(self) -> None:
        """Apply pushes until ``steps`` steps (``last_update`` updates), then stop every
        worker."""
        self.started = time.perf_counter()
        self.waiting: list[int] = []
        while self.version < self.last_update:
            received = self._receive(poll=self.sync.mode != "sync")
            if received is not None:
                self._handle(*received)
        self._stop_all()

    def _handle(self, sender: int, header: protocol.Header, gradient: torch.Tensor | None) -> None:
        kind = header.kind
        if kind == protocol.PUSH and not self.pushes:
            self.started = time.perf_counter()  # rates count from the first gradient, not start-up
        if kind == protocol.PUSH:
            self._check_push(sender, header, gradient)
        if kind == protocol.PULL:
            self._reply(sender)
        elif kind == protocol.BYE:
            self.finished.add(sender)
        elif self.sync.mode == "sync":
            self._handle_sync(sender, header, gradient)
        else:
            self.pushes[sender] += 1
            self._count_loss(header)
            self._take_buffers(sender)
            self._apply(gradient, header.version)
            self.waiting.append(sender)
            self._release_waiting()

    def _handle_sync(self, sender: int, header: protocol.Header,
                     gradient: torch.Tensor | None) -> None:
        """Average the first ``required`` pushes of the current step; late ones are dropped."""
        if header.step < self.version:
            self.dropped += 1
            self._reply(sender)
            return
        self.pushes[sender] += 1
        self._count_loss(header)
        if gradient is not None:
            self.gradient_sum = gradient if not self.waiting else self.gradient_sum + gradient
        self.waiting.append(sender)
        if len(self.waiting) == self.required:
            mean = self.gradient_sum / self.required if self.params else None
            self._take_buffers(min(self.waiting))
            self._apply(mean, self.version)
            stop = self.version >= self.last_update
            for worker in self.waiting:
                self._reply(worker, stop=stop)
            self.waiting = []

    def _check_push(self, sender: int, header: protocol.Header,
                    gradient: torch.Tensor | None) -> None:
        """Stop the run on a push whose loss or gradient is not finite, naming its worker:
        divergence in fp32 and bf16. With fp16 it is an overflow, skipped by :meth:`_apply`
        (the worker stops the run if its steps keep overflowing, see
        :mod:`tandem.runtime.divergence`)."""
        if self.config.precision == "fp16":
            return
        mean = header.loss / header.count if header.count else 0.0
        if math.isfinite(mean):
            bad = first_non_finite([gradient]) if gradient is not None else None
            if bad is None:
                return
            problem, loss = f"the gradient became {bad}", None
        else:
            problem, loss = f"loss became {mean}", mean
        where = (f"worker {sender - self.sync.servers} (rank {sender}), pushed to server "
                 f"{self.env.rank}")
        raise diverged(self.config, problem=problem, step_index=header.step // self.per_step,
                       where=where, rank=sender, loss=loss)

    def _take_buffers(self, worker: int) -> None:
        """The model's buffers become those ``worker`` pushed with its gradient (server 0)."""
        if worker in self.pushed_buffers:
            self.buffers.load(self.pushed_buffers[worker])
        self.pushed_buffers.clear()

    def _release_waiting(self) -> None:
        """Reply to waiting workers that bounded staleness lets go on (all of them in async)."""
        if self.sync.mode == "sync":
            return
        live = [w for w in self.workers if w not in self.dead and w not in self.finished]
        slowest = min((self.pushes[w] for w in live), default=0)
        stop = self.version >= self.last_update
        still = []
        for worker in self.waiting:
            bound = self.sync.staleness if self.sync.mode == "ssp" else None
            if stop or bound is None or self.pushes[worker] - slowest <= bound:
                self._reply(worker, stop=stop)
            else:
                still.append(worker)
        self.waiting = still

    def _stop_all(self) -> None:
        """After the last update: answer every remaining message with 'stop' until all are done."""
        self._release_waiting()
        while set(self.workers) - self.finished - self.dead:
            received = self._receive(poll=self.sync.mode != "sync")
            if received is None:
                continue
            sender, header, _ = received
            if header.kind == protocol.BYE:
                self.finished.add(sender)
            elif header.kind in (protocol.PUSH, protocol.PULL):
                self.dropped += int(header.kind == protocol.PUSH)
                self._reply(sender, stop=True)
        self._finish_replies()
        if self.dead:  # its receive from them ends at --timeout; never let it end at exit
            self.mailbox.thread.join(timeout=self.config.timeout_s + 5)

    # -- outputs ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any] | None:
        """Serve, then gather the model on server 0, evaluate it and write the outputs."""
        rank0 = self.env.rank == 0
        self.reporter = Reporter(
            enabled=rank0, show_progress=self.config.progress, total_steps=self.config.steps,
            metrics_path=self.out / "metrics.jsonl" if self.out and rank0 else None,
            first_step=self.version // self.per_step,
        )
        with self.reporter:
            self.serve()
            if self.out is not None and not rank0:  # before the gather server 0 waits for
                save_worker_trace(self.out, self.env.rank, self.clock_start, self.events)
            self._gather()
            if not rank0:
                self._checkpoint()  # its shard where the run ends (server 0's: after evaluating)
                return None
            evaluation = self._evaluate()
            self.reporter.record(step=self.version // self.per_step, **evaluation)
        self._checkpoint()
        return self._summary(evaluation)

    def _write_trace(self) -> None:
        """``trace.json`` and ``gantt.png``: every process's actions (workers' ``0F``, ``0B``,
        ``0PU``, ``0PL``; servers' ``0ST`` updates), from the files they saved."""
        if self.out is None:
            return
        others = [rank for rank in range(1, self.env.world_size)]
        timeline = merge_worker_traces(self.out, others, self.clock_start, self.events)
        timeline.write(self.out / "trace.json")
        shown = sorted({e.step for e in timeline.events if e.step >= 0})[-GANTT_STEPS:]
        plot_gantt(timeline, self.out / "gantt.png", steps=set(shown) or None,
                   title=f"{strategy_of(self.job.plan)} {self.sync.mode}, {self.config.model.partition(':')[0]}, "
                         f"{self.env.world_size} processes (measured)")

    def _gather(self) -> None:
        """Servers send their shards to server 0 (server groups only; workers are done)."""
        for server in range(1, self.sync.servers):
            start, end = self.ranges[server]
            shard = list(self.model.parameters())[start:end]
            if not shard:
                continue
            if self.env.rank == server:
                dist.send(flatten(shard), dst=0, tag=protocol.GATHER, group=self.group)
            elif self.env.rank == 0:
                flat = torch.empty(sum(p.numel() for p in shard))
                dist.recv(flat, src=server, tag=protocol.GATHER, group=self.group)
                unflatten_into(flat, shard)

    def _evaluate(self) -> dict[str, float | None]:
        return evaluation(self.task.score(self.model, 0, len(self.task.test_samples)))

    def _checkpoint(self) -> None:
        """Each server saves its shard, optimizer and version (``server-K.pt``, atomically),
        unless its parameters are no longer finite: then the run stops (divergence) and the
        last good checkpoint stays."""
        bad = first_non_finite(self.params)
        if bad is not None:
            raise diverged(self.config, problem=f"the parameters became {bad}",
                           step_index=self.version // self.per_step - 1, at="after",
                           rank=self.env.rank, where=f"server {self.env.rank} (rank {self.env.rank})")
        if self.out is None:
            return
        save_atomic({
            "version": CHECKPOINT_VERSION, "step": self.version // self.per_step,
            "fingerprint": self.job.fingerprint(), "shard": [p.detach() for p in self.params],
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "buffers": [b.detach().clone() for b in self.buffers.tensors],
            "codecs": (self.codec_snapshot[1] if self.codec_snapshot[0] == self.version
                       else self._codec_state()),
        }, self.out / f"server-{self.env.rank}.pt")

    def _codec_state(self) -> dict[str, Any]:
        """With a codec, per worker: the state of the decoder of its pushes, and the copy of
        the shard it holds (``x̂_w``) with the encoder of its pulls (their workers save theirs
        in ``worker-K.pt`` at the same update)."""
        if self.codec_text is None:
            return {}
        return copy.deepcopy({  # a snapshot: encoding the next replies changes these in place
            "decoders": {w: d.codec.state_dict() for w, d in self.decoders.items() if d.codec},
            "encoders": {w: {"copy": e.copy, "codec": e.codec.codec.state_dict()
                             if e.codec.codec else {}} for w, e in self.encoders.items()},
        })

    def _load_codec_state(self, state: dict[str, Any]) -> None:
        for worker, saved in state.get("decoders", {}).items():
            decoder = self.decoders[worker] = self._codec(feedback=False)
            if decoder.codec is not None:
                decoder.codec.load_state_dict(saved)
        for worker, saved in state.get("encoders", {}).items():
            encoder = self.encoders[worker] = protocol.PullEncoder(self._codec(feedback=False))
            encoder.copy = saved["copy"]
            if encoder.codec.codec is not None:
                encoder.codec.codec.load_state_dict(saved["codec"])

    def _resume(self) -> None:
        path = resume_path(self.config.resume, self.out, f"server-{self.env.rank}.pt")
        state = (None if path is None else
                 load_checkpoint(path, self.job.fingerprint(), steps=self.config.steps))
        announce_resume(self.env.rank, path, state["step"] if state else None)
        if state is None:
            return
        for p, saved in zip(self.params, state["shard"]):
            p.data.copy_(saved)
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            restore_momentum(self.optimizer, self.compensation)
        for b, saved in zip(self.buffers.tensors, state.get("buffers", [])):
            b.copy_(saved)
        self._load_codec_state(state.get("codecs", {}))
        self.version = int(state["step"]) * self.per_step

    def _summary(self, evaluation: dict[str, float]) -> dict[str, Any]:
        wall = time.perf_counter() - self.started
        finished = self.version >= self.config.steps * self.per_step
        if self.out:
            if finished:
                state = {n: t.detach().cpu() for n, t in self.model.state_dict().items()}
                save_atomic(state, self.out / "final.pt")
            write_run_files(self.job, self.out)
            self._write_trace()
        return {
            **plan_summary(self.job.plan), **self._mode_summary(), "model": self.config.model,
            "data": self.config.data, "world_size": self.env.world_size,
            "servers": self.sync.servers, "workers": len(self.workers),
            "steps": self.version // self.per_step,
            "updates": self._updates(), "finished": finished,
            "global_batch_size": self.batch_at(max(self.version // self.per_step - 1, 0)),
            "batch_schedule": self.config.batch_schedule, "lr": scaled_lr(self.config),
            "final_loss": self.last_loss,
            **self.task.summary_fields(), "precision": self.config.precision,
            "clip_grad_norm": self.config.clip_grad_norm, "skipped_steps": self.skipped_steps,
            **evaluation, "samples_per_s": self._samples_per_s(wall),
            "updates_per_s": self._updates() / max(wall, 1e-9),
            "step_time_s": wall / max(self.version // self.per_step, 1),
            "train_s": round(wall, 4), "async_compensation": (
                self.compensation.describe() if self.compensation.delay else None),
            "dropped_pushes": self.dropped, "dead_workers": sorted(self.dead),
            "pushes": {str(w): self.pushes[w] for w in self.workers}, **self._traffic_summary(),
            "out": str(self.out) if self.out else None, **NoiseScale.unavailable(
                "the gradient noise scale is measured in data parallelism only (--strategy dp, "
                "from each worker's gradient and their allreduced mean); servers take each "
                "worker's push on its own").summary(),
        }

    def _mode_summary(self) -> dict[str, Any]:
        """The summary's fields of this kind of server: its mode, backup workers, staleness."""
        return {"mode": self.sync.mode, "backup": self.sync.backup,
                "mean_staleness": statistics.fmean(self.staleness) if self.staleness else 0.0,
                "max_staleness": max(self.staleness, default=0)}

    def _traffic_summary(self) -> dict[str, float]:
        """The run's bytes, both ways, from the workers' final reports (their goodbyes)."""
        total, steps = self._total_traffic(), max(1, self.version // self.per_step)
        return {"sync_bytes": total.sent_bytes,
                "pushed_bytes": total.pushed_bytes, "pulled_bytes": total.pulled_bytes,
                "pushed_bytes_per_step": total.pushed_bytes / steps,
                "pulled_bytes_per_step": total.pulled_bytes / steps,
                "sent_bytes_per_step": total.sent_bytes / steps,
                "uncompressed_bytes_per_step":
                    (total.raw_pushed_bytes + total.raw_pulled_bytes) / steps,
                "compression_ratio": total.compression_ratio}


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for tensor in like:
        out.append(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return out
