"""A server's messages with its workers: received on background threads (one per worker) and
decoded, replies encoded and sent without waiting (at most one in flight per worker)."""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.runtime.ps import protocol
from tandem.runtime.ps.codecs import WireCodecs
from tandem.runtime.ps.shard import ServerShard
from tandem.runtime.watchdog import SILENT_AFTER_S


NEVER = datetime.timedelta(days=365)
"""How long a receive from a worker may wait: for ever, in effect. A gloo wait that times out
closes every connection of its process (the server's with the other workers too), so the server
judges a worker that sends nothing by its heartbeat (:mod:`tandem.runtime.ps.liveness`), not by
a receive's timeout."""


class WorkerLost(RuntimeError):
    """The connection to a worker failed (its process ended) before it said goodbye."""

    def __init__(self, worker: int, error: BaseException) -> None:
        super().__init__(f"worker rank {worker}: {error}")
        self.worker, self.error = worker, error


class Mailbox:
    """Receives the workers' messages, one background thread per worker, so that the server can
    wait for the next one with a timeout (a timed-out gloo receive cannot be resumed).

    Not one receive from any worker: gloo gives such a receive to the first worker that
    announced a message, and then waits for that worker's bytes, so a worker stopped (SIGSTOP)
    between the two would hold every other worker's message back. A worker's thread ends with
    its goodbye, or when its connection fails (:class:`WorkerLost` is queued: its process
    ended)."""

    def __init__(self, body_bytes: int, workers: list[int],
                 group: dist.ProcessGroup | None = None) -> None:
        self.body_bytes = body_bytes
        self.group = group
        self.queue: queue.Queue[Any] = queue.Queue()
        self.threads = {worker: threading.Thread(target=self._run, args=(worker,), daemon=True,
                                                 name=f"tandem-ps-mailbox-{worker}")
                        for worker in workers}
        for thread in self.threads.values():
            thread.start()

    def get(self, timeout: float | None) -> Any:
        """The next message (or the :class:`WorkerLost` of a worker whose connection failed)."""
        return self.queue.get(timeout=timeout)

    def join(self, workers: set[int], timeout_s: float) -> None:
        """Wait up to ``timeout_s`` in all for the threads of ``workers`` to end (each ends when
        its worker's process does), so that none is still in a receive when this process
        exits: an interpreter that exits under one aborts."""
        deadline = time.monotonic() + timeout_s
        for worker in sorted(workers):
            self.threads[worker].join(timeout=max(0.0, deadline - time.monotonic()))

    def _run(self, worker: int) -> None:
        while True:
            try:
                message = self._receive_one(worker)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.queue.put(WorkerLost(worker, exc))
                return
            self.queue.put((worker, message))
            if protocol.Header.decode(message).kind == protocol.BYE:
                return

    def _receive_one(self, worker: int) -> torch.Tensor:
        message = protocol.empty(self.body_bytes)
        work = dist.irecv(message, src=worker, tag=protocol.TO_SERVER, group=self.group)
        if work is None:  # only a rank outside the group gets none, and servers are in it
            raise RuntimeError("this server is not in the group its workers send on")
        work.wait(NEVER)
        return message


class Replies:
    """The server's replies in flight: a new one to a worker first waits for the previous one
    (which has arrived, since the worker has sent again), so at most one is in flight each."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.in_flight: dict[int, tuple[Any, torch.Tensor]] = {}

    def settle(self, worker: int) -> None:
        """Wait for the reply in flight to ``worker``, if any (raises ``RuntimeError`` if it
        failed: the worker died)."""
        previous = self.in_flight.pop(worker, None)
        if previous is not None:
            previous[0].wait()

    def send(self, worker: int, outgoing: torch.Tensor) -> None:
        """Send ``outgoing`` to ``worker`` without waiting (after :meth:`settle`)."""
        self.in_flight[worker] = (dist.isend(outgoing, dst=worker, tag=protocol.TO_WORKER,
                                             group=self.group), outgoing)

    def finish(self, skip: set[int]) -> set[int]:
        """Wait for every reply in flight but those to ``skip`` (workers left behind, which may
        never take theirs); the workers whose reply failed."""
        failed = set()
        for worker, (work, _) in list(self.in_flight.items()):
            if worker in skip:
                continue
            try:
                work.wait()
            except RuntimeError:
                failed.add(worker)
        self.in_flight.clear()
        return failed


class ServerWire:
    """A server's side of the wire: pushes decoded as they arrive (their buffers kept by the
    shard until applied), replies encoded and sent, on the gloo ``group``."""

    def __init__(self, shard: ServerShard, codecs: WireCodecs, workers: list[int],
                 group: dist.ProcessGroup | None) -> None:
        self.shard, self.codecs = shard, codecs
        self.push_bytes = codecs.codec(feedback=True).body_bytes
        self.replies = Replies(group)
        self.mailbox = Mailbox(self.push_bytes + shard.buffers.num_bytes, workers, group)

    def receive(self, timeout: float | None, *,
                limit_s: float) -> tuple[int, protocol.Header, torch.Tensor | None]:
        """The next message from any worker: (sender, header, decoded gradient shard of a
        push); raises ``queue.Empty`` after ``timeout`` seconds without one (None: a
        ``RuntimeError`` after ``limit_s``, for the diagnosis of the workers), and
        :class:`WorkerLost` where a worker's connection failed.

        Every push is decoded, in the order each worker sent them (codecs whose decoding has
        state advance in step with the sender's)."""
        try:
            item = self.mailbox.get(timeout=limit_s if timeout is None else timeout)
        except queue.Empty:
            if timeout is not None:
                raise
            raise RuntimeError(f"timed out after {limit_s:g} s waiting for the workers' "
                               "messages") from None
        if isinstance(item, BaseException):
            raise item
        sender, message = item
        header = protocol.Header.decode(message)
        if header.kind != protocol.PUSH:
            return sender, header, None
        data = protocol.body(message)
        self.shard.keep_buffers(sender, data[self.push_bytes:])
        if not self.shard.params:
            return sender, header, None
        return sender, header, self.codecs.decode(sender, data[:self.push_bytes])

    def finish(self, left_behind: set[int]) -> set[int]:
        """After the last message: wait for the replies in flight to the workers not
        ``left_behind`` (returns those whose reply failed), then up to ``SILENT_AFTER_S + 5``
        s for the receives from those left behind to end, as their processes do."""
        failed = self.replies.finish(skip=left_behind)
        if left_behind:
            self.mailbox.join(left_behind, timeout_s=SILENT_AFTER_S + 5)
        return failed

    def reply(self, worker: int, values: Callable[[], torch.Tensor], *, version: int,
              stop: bool, update: int = -1) -> None:
        """Send ``worker`` the flat shard ``values()`` with the buffers, as of ``version``, and
        the ``update`` it computes next (without waiting: the previous reply to it has arrived,
        since it has sent again, so at most one send per worker is in flight); raises
        ``RuntimeError`` if it died."""
        self.replies.settle(worker)
        data = self.codecs.encode(worker, values())
        header = protocol.Header(kind=protocol.PARAMS, step=update, version=version, stop=stop)
        self.replies.send(worker, protocol.message(header, data, self.shard.buffers.encode()))
