"""The worker side of parameter-server training: push gradient shards, pull parameter shards.

Ranks ``0 .. servers-1`` are servers (see :mod:`tandem.runtime.ps.server`), the others workers.
Each worker pushes its gradient to every server (shard ``k`` to server ``k``) and waits for
the parameters the server sends back; when it sends them back depends on the mode (``sync``:
after all (or, with backup workers, the first N - b) gradients of the step; ``async``: at
once; ``ssp``: once the worker is at most ``staleness`` updates ahead of the slowest).

With ``--compress CODEC``, pushes are the codec's payloads (with the registry's error feedback,
one residual per parameter) and replies after the first are compressed differences from the
parameters the worker holds (see :mod:`tandem.runtime.ps.protocol`). Messages with server 0 carry
the model's buffers both ways.

Every message is a CPU tensor on a gloo group (:func:`~tandem.sync.side_group.cpu_group`):
servers receive from any worker, which NCCL cannot do, so a GPU worker stages its gradients and
parameters through the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tandem.runtime.ps import protocol
from tandem.runtime.watchdog import WAITING, Heartbeat
from tandem.spec.codec import CodecSpec
from tandem.sync.base import SyncStrategy
from tandem.sync.flat import flatten, state_buffers
from tandem.sync.side_group import cpu_group


class ParameterServerClient(SyncStrategy):
    """A worker's strategy: the servers own the optimizer; the worker only computes gradients.

    Usage (inside a job whose ranks ``0 .. num_servers-1`` run ``ParameterServer``)::

        client = ParameterServerClient(1, "topk:ratio=0.1", rank=0, num_workers=4)
        module = client.wrap(model, device)      # pulls the servers' parameters
    """

    name = "ps"
    local_optimizer = False
    pull_on_wrap = True
    """Whether :meth:`wrap` takes the servers' parameters (else the worker calls :meth:`pull`
    when it is ready to train)."""

    def __init__(self, num_servers: int, compress: CodecSpec | str | None = None, *,
                 rank: int = 0, num_workers: int = 1, timeout_s: float = 300.0) -> None:
        self.num_servers = num_servers
        self.timeout_s = timeout_s
        self.compress = compress
        self.versions: list[int] = [0] * num_servers
        """Parameter version (updates applied) of each server's shard in the worker's model."""
        self.next_step = 0
        """The servers' version (updates applied) the update this worker computes next is
        computed on."""
        self.next_update: int | None = None
        """In ``async`` and ``ssp`` modes, the update of the run this worker computes next, as
        server 0's last reply numbered it (its global batch and share:
        :meth:`tandem.runtime.trainer.Trainer.batch_share`); None where it numbered none."""
        self.loss = (0.0, 0)
        self.traffic = protocol.Traffic()
        """Bytes of this worker's messages with all servers, both ways."""
        self.shards: list[list[torch.Tensor]] = []
        self.pushes: list[protocol.ShardCodec] = []
        self.pulls: list[protocol.PullDecoder] = []
        self.rank, self.num_workers = rank, num_workers
        """This worker's index among the workers, and their number (seed its codec's noise)."""
        self.buffers = protocol.Buffers([])
        self.extra_bytes: list[int] = []
        """Per server: bytes of buffers its messages carry after the shard (server 0's only)."""
        self.group: dist.ProcessGroup | None = None
        self.resume_state: dict[str, Any] | None = None
        """Codec state of a checkpoint (:meth:`codec_state`), restored before the first pull."""
        self.beat: Heartbeat | None = None
        """The worker's heartbeat: its phase is :data:`~tandem.runtime.watchdog.WAITING` while
        it waits for the servers' replies (a server takes no waiting worker for stuck)."""
        self.on_pushed: Callable[[int], None] | None = None
        """Called after each push of step ``s`` is sent and before its reply is read: where a
        compressed worker's codec state matches the servers' checkpoint after ``s + 1``
        updates."""

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        self.group = cpu_group(timeout_s=self.timeout_s)  # where the servers make theirs
        self.buffers = protocol.Buffers([b for _, b in state_buffers(model)])
        self.extra_bytes = [self.buffers.num_bytes if server == 0 else 0
                            for server in range(self.num_servers)]
        named = list(model.named_parameters())
        ranges = protocol.shard_ranges([p.numel() for _, p in named], self.num_servers)
        for start, end in ranges:
            shapes = [p.shape for _, p in named[start:end]]
            keys = [name for name, _ in named[start:end]]
            self.shards.append([p for _, p in named[start:end]])
            push = protocol.ShardCodec(self.compress, shapes, keys, feedback=True)
            push.start(self.rank, self.num_workers)
            self.pushes.append(push)
            pull = protocol.ShardCodec(self.compress, shapes, keys, feedback=False)
            self.pulls.append(protocol.PullDecoder(pull))
        if self.resume_state is not None:
            self.load_codec_state(self.resume_state)
        if self.pull_on_wrap:
            self.pull()
        return model

    def pull(self) -> None:
        """Take the servers' parameters (the first exchange; see :attr:`pull_on_wrap`)."""
        self._exchange(protocol.PULL, step=0)

    def codec_state(self) -> dict[str, Any]:
        """What a compressed worker holds beyond the servers' checkpoint: its copy of the
        parameters (``x̂``, which compressed pulls advance), its pushes' error feedback and its
        codecs' random streams."""
        return {"params": [[p.detach().clone() for p in shard] for shard in self.shards],
                "pushes": [push.codec.state_dict() if push.codec else {} for push in self.pushes],
                "pulls": [{"codec": pull.codec.codec.state_dict() if pull.codec.codec else {},
                           "exact_received": pull.exact_received} for pull in self.pulls]}

    def load_codec_state(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`codec_state` (the servers resume from the same update)."""
        for shard, saved in zip(self.shards, state["params"]):
            for p, value in zip(shard, saved):
                p.data.copy_(value)
        for push, saved in zip(self.pushes, state["pushes"]):
            if push.codec is not None:
                push.codec.load_state_dict(saved)
        for pull, saved in zip(self.pulls, state["pulls"]):
            if pull.codec.codec is not None:
                pull.codec.codec.load_state_dict(saved["codec"])
            pull.exact_received = bool(saved["exact_received"])

    def record_loss(self, loss_sum: torch.Tensor, count: int) -> None:
        """The coming push carries its loss, for server 0's progress and metrics."""
        self.loss = (float(loss_sum), count)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        stop = self._exchange(protocol.PUSH, step)
        optimizer.zero_grad(set_to_none=True)
        return stop

    def finish(self) -> None:
        """Tell every server this worker is done (with its final traffic, for the summary)."""
        self._count_sent()
        header = protocol.Header(kind=protocol.BYE, traffic=self.traffic)
        for server, push in enumerate(self.pushes):
            dist.send(protocol.message(header, push.body_bytes, self.extra_bytes[server]),
                      dst=server, tag=protocol.TO_SERVER, group=self.group)

    def _exchange(self, kind: int, step: int) -> bool:
        """Send ``kind`` (with gradients for a push) to every server, then take back parameters."""
        bodies: list[torch.Tensor | int] = [push.body_bytes for push in self.pushes]
        if kind == protocol.PUSH:
            bodies = [push.encode(self._pushed(params).cpu())[0]
                      for push, params in zip(self.pushes, self.shards)]
        self._count_sent()
        header = protocol.Header(kind=kind, step=step, loss=self.loss[0], count=self.loss[1],
                                 traffic=self.traffic)
        sends = []
        with self.action("PU"):
            for server, data in enumerate(bodies):
                extra = self.extra_bytes[server]
                outgoing = protocol.message(
                    dataclasses.replace(header, version=self.versions[server]), data,
                    self.buffers.encode() if extra and kind == protocol.PUSH else extra)
                sends.append((dist.isend(outgoing, dst=server, tag=protocol.TO_SERVER,
                                         group=self.group), outgoing))
        if kind == protocol.PUSH and self.on_pushed is not None:
            self.on_pushed(step)
        with self.action("PL"), self._waiting():
            stop = self._pull()
        for work, _ in sends:
            if work is not None:
                work.wait()
        self.next_step = self.versions[0]
        return stop

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """Within: the heartbeat's phase says this worker waits for its servers (and still
        does after a wait that failed, for the diagnosis)."""
        if self.beat is None:
            yield
            return
        phase, self.beat.phase = self.beat.phase, WAITING
        yield
        self.beat.phase = phase

    def _pushed(self, params: list[torch.Tensor]) -> torch.Tensor:
        """What a push sends a server of its shard ``params``: their gradient, flat."""
        return _gradient(params)

    def _pull(self) -> bool:
        """Take back every server's reply (the parameters); True when a server says stop."""
        stop = False
        for server, (pull, params) in enumerate(zip(self.pulls, self.shards)):
            size, extra = pull.next_bytes, self.extra_bytes[server]
            reply = protocol.empty(size + extra)
            dist.recv(reply, src=server, tag=protocol.TO_WORKER, group=self.group)
            self.traffic.pulled_bytes += reply.numel()
            self.traffic.raw_pulled_bytes += protocol.HEADER_BYTES + pull.codec.raw_bytes + extra
            data = protocol.body(reply)
            pull.apply(data[:size], params)
            if extra:
                self.buffers.load(data[size:])
            header = protocol.Header.decode(reply)
            self.versions[server] = header.version
            if server == 0:
                self.next_update = header.step if header.step >= 0 else None
            stop = stop or header.stop
        return stop

    def _count_sent(self) -> None:
        """Count one message to every server (all have a push's size)."""
        for push, extra in zip(self.pushes, self.extra_bytes):
            self.traffic.pushed_bytes += protocol.HEADER_BYTES + push.body_bytes + extra
            self.traffic.raw_pushed_bytes += protocol.HEADER_BYTES + push.raw_bytes + extra

    def stats(self) -> dict[str, float]:
        """``sync_bytes``: what this worker sent; ``pulled_bytes``: what the servers sent it."""
        return {"sync_bytes": self.traffic.pushed_bytes, "pulled_bytes": self.traffic.pulled_bytes}


def _gradient(params: list[torch.Tensor]) -> torch.Tensor:
    """The shard's gradient as one flat tensor (zeros for parameters without one)."""
    if not params:
        return torch.zeros(0)
    return flatten(p.grad if p.grad is not None else torch.zeros_like(p) for p in params)
