"""A server's messages with its workers: received on a background thread and decoded, replies
encoded and sent without waiting (at most one in flight per worker)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.runtime.ps import protocol
from tandem.runtime.ps.codecs import WireCodecs
from tandem.runtime.ps.shard import ServerShard
from tandem.sync.side_group import source_rank


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
        if work is None:  # only a rank outside the group gets none, and servers are in it
            raise RuntimeError("this server is not in the group its workers send on")
        work.wait()
        return source_rank(work, self.group), message


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

    def finish(self) -> set[int]:
        """Wait for every reply in flight; the workers whose reply failed."""
        failed = set()
        for worker, (work, _) in list(self.in_flight.items()):
            try:
                work.wait()
            except RuntimeError:
                failed.add(worker)
        self.in_flight.clear()
        return failed


class ServerWire:
    """A server's side of the wire: pushes decoded as they arrive (their buffers kept by the
    shard until applied), replies encoded and sent, on the gloo ``group``."""

    def __init__(self, shard: ServerShard, codecs: WireCodecs, num_workers: int,
                 group: dist.ProcessGroup | None) -> None:
        self.shard, self.codecs = shard, codecs
        self.push_bytes = codecs.codec(feedback=True).body_bytes
        self.replies = Replies(group)
        self.mailbox = Mailbox(self.push_bytes + shard.buffers.num_bytes, num_workers, group)

    def receive(self, timeout: float | None) -> tuple[int, protocol.Header, torch.Tensor | None]:
        """The next message from any worker: (sender, header, decoded gradient shard of a
        push); raises ``queue.Empty`` after ``timeout`` seconds without one.

        Every push is decoded, in the order each worker sent them (codecs whose decoding has
        state advance in step with the sender's)."""
        item = self.mailbox.get(timeout=timeout)
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
