"""What a parameter server counts while it serves (losses, samples, staleness, traffic, its
updates in the trace), and the metrics lines and summary fields made of them."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from tandem.runtime.component import Component, StepEnd
from tandem.runtime.memory import rss_bytes
from tandem.runtime.outputs import MAX_TRACED_STEPS
from tandem.runtime.ps import protocol
from tandem.runtime.reporting import Reporter
from tandem.timeline import Event


class ServerStats:
    """The counts of server ``rank`` since its start (``clock_start``, a ``perf_counter``
    reading, is where its trace's times count from)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.clock_start = time.perf_counter()
        self.started = self.clock_start
        """When the first gradient arrived: rates count from it, not from start-up."""
        self.loss = [0.0, 0]
        """The pushed losses' sum and count since the last metrics line."""
        self.last_loss = float("nan")
        self.samples_pushed = 0
        """Samples of every gradient pushed to this server (each push carries its count)."""
        self.pushes: Counter[int] = Counter()
        self.staleness: list[int] = []
        self.skipped_steps = 0
        """Updates not applied: their gradient was not finite."""
        self.dropped = 0
        """Pushes not applied: they came after their step (backup workers) or the last."""
        self.events: list[Event] = []
        """This server's updates (``0ST``), for ``trace.json``."""
        self.traffic: dict[int, protocol.Traffic] = {}
        """Per worker: the traffic it reported last (all servers together)."""
        self.logged_traffic = protocol.Traffic()
        self.logged_steps = 0

    def count_push(self, sender: int, header: protocol.Header) -> None:
        """A push of ``sender`` that is applied: its loss and samples count."""
        self.pushes[sender] += 1
        self.loss[0] += header.loss
        self.loss[1] += header.count
        self.samples_pushed += header.count

    def record_update(self, start: float, end: float, step: int) -> None:
        """An update from ``start`` to ``end`` (``perf_counter`` readings), traced as ``0ST``
        of ``step`` among the first :data:`MAX_TRACED_STEPS`."""
        if step < MAX_TRACED_STEPS:
            self.events.append(Event(worker=self.rank, name="0ST",
                                     start_s=start - self.clock_start,
                                     end_s=end - self.clock_start, step=step))

    def samples_per_s(self, elapsed: float) -> float:
        """Samples pushed per second over ``elapsed`` seconds."""
        return self.samples_pushed / max(elapsed, 1e-9)

    def total_traffic(self) -> protocol.Traffic:
        """All workers' traffic with all servers, as last reported to this server."""
        return sum(self.traffic.values(), protocol.Traffic())

    def traffic_per_step(self, steps_done: int) -> dict[str, float]:
        """Bytes per step since the last metrics line (as far as the workers have reported:
        a push's header counts the replies received before it), and the compression ratio."""
        total = self.total_traffic()
        window = total - self.logged_traffic
        steps = max(1, steps_done - self.logged_steps)
        self.logged_traffic, self.logged_steps = total, steps_done
        return {"pushed_bytes_per_step": window.pushed_bytes / steps,
                "pulled_bytes_per_step": window.pulled_bytes / steps,
                "sent_bytes_per_step": window.sent_bytes / steps,
                "compression_ratio": total.compression_ratio}

    def traffic_summary(self, steps_done: int) -> dict[str, float]:
        """The run's bytes, both ways, from the workers' final reports (their goodbyes)."""
        total, steps = self.total_traffic(), max(1, steps_done)
        return {"sync_bytes": total.sent_bytes,
                "pushed_bytes": total.pushed_bytes, "pulled_bytes": total.pulled_bytes,
                "pushed_bytes_per_step": total.pushed_bytes / steps,
                "pulled_bytes_per_step": total.pulled_bytes / steps,
                "sent_bytes_per_step": total.sent_bytes / steps,
                "uncompressed_bytes_per_step":
                    (total.raw_pushed_bytes + total.raw_pulled_bytes) / steps,
                "compression_ratio": total.compression_ratio}

    def staleness_summary(self) -> dict[str, float]:
        """The mean and largest staleness of the updates applied."""
        return {"mean_staleness": statistics.fmean(self.staleness) if self.staleness else 0.0,
                "max_staleness": max(self.staleness, default=0)}


class ServerLog(Component):
    """The metrics line of a server at each ``--log-every`` step (and the last): the mean loss
    the workers pushed since the last line, the rate, the traffic (``batch_at``: the global
    batch of a step), the learning rate of its last update (``lr``: None for a server without
    an optimizer, whose line has none) and its resident memory."""

    def __init__(self, stats: ServerStats, reporter: Reporter, batch_at: Callable[[int], int],
                 lr: Callable[[], float | None]) -> None:
        self.stats, self.reporter, self.batch_at, self.lr = stats, reporter, batch_at, lr

    def after_step(self, end: StepEnd) -> None:
        if not end.logging:
            return
        stats = self.stats
        if stats.loss[1]:
            elapsed = time.perf_counter() - stats.started
            stats.last_loss = stats.loss[0] / stats.loss[1]
            lr = self.lr()
            self.reporter.record(step=end.done, loss=stats.last_loss,
                                 **({"lr": lr} if lr is not None else {}),
                                 batch_size=self.batch_at(end.step),
                                 samples_per_s=stats.samples_per_s(elapsed),
                                 **stats.traffic_per_step(end.done), rss_bytes=rss_bytes())
        stats.loss = [0.0, 0]
