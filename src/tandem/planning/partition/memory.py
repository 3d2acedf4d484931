"""Memory per device: the one model that the partitioner, the simulator and the search share.

Usage::

    held, versions = in_flight(ScheduleKind.PIPEDREAM, replicas=2, downstream=3)    # (3, 2)
    device_memory_bytes(parameter_bytes=P, activation_bytes=held * A,
                        stashed_versions=versions, optimizer_state_factor=1.0)

A device running a stage (parameters ``P`` bytes, outputs ``A`` bytes per minibatch) holds its
weights, their gradients, optimizer state (``optimizer_state_factor`` × ``P``), the weight versions
PipeDream stashes for minibatches in flight (``P`` each), and the activations of every minibatch
(or micro-batch) between its forward and its backward.

How much is in flight depends on the schedule (:func:`in_flight`):

- ``pipedream``: each replica runs whole minibatches; with ``d`` devices after the stage and
  ``r`` replicas of it, ``k = 1 + ceil(d / r)`` minibatches are in flight on each replica, which
  stashes ``k - 1`` weight versions besides its current one. The simulator's replay of the
  schedule reaches exactly this peak.
- ``gpipe`` and ``1f1b`` (flush schedules): no versions; a replica runs its round-robin share
  of the step's ``M`` micro-batches, ``ceil(M / r)`` of them, and holds at most their
  activations at once (exactly that for GPipe; 1F1B's stages hold fewer, at most one per stage
  after them).

Tensor parallelism (degree ``T``, :mod:`tandem.planning.simulate.tensor`) divides the parameter bytes of
the split layers (those with parameters) by ``T`` — so their gradients and optimizer state too
— and leaves activations whole: ``P = P_split / T + P_whole`` per device.

Recomputation keeps, per micro-batch in flight, only the stage's input ``I`` (the bytes it
receives), and while a backward recomputes its forward one micro-batch's full activations: a
replica holding ``k`` micro-batches of a share ``f`` of the minibatch each holds
``k f I + f A`` instead of ``k f A`` (:func:`held_activation_bytes`).

The partitioner budgets these closed forms before it knows ``M`` (``1 / r`` of a minibatch for
flush schedules, what ``M`` a multiple of ``r`` gives); the simulator reports the same parts
from its replay's peaks (:func:`device_memory_bytes` adds them up in both), and the planner
keeps only plans whose simulated peak fits. What it does not model is
listed in :mod:`tandem.planning.simulate.simulator` (workspace, buffers, fragmentation).
"""

from __future__ import annotations

import numpy as np

from tandem.spec.kinds import ScheduleKind

FLUSH_SCHEDULES = tuple(kind for kind in ScheduleKind if kind.flushes)
"""Schedules that end every step with a flush: no weight versions, one minibatch at most."""


def device_memory_bytes(*, parameter_bytes: np.ndarray | float,
                        activation_bytes: np.ndarray | float,
                        stashed_versions: np.ndarray | float = 0.0,
                        optimizer_state_factor: float = 1.0) -> np.ndarray | float:
    """Peak bytes on one device: weights, gradients, optimizer state, stashed weight versions
    and the activations held (vectorized)."""
    weights = parameter_bytes * (2.0 + optimizer_state_factor + stashed_versions)
    return weights + activation_bytes


def held_activation_bytes(held: np.ndarray | float, activation_bytes: np.ndarray | float, *,
                          recompute_input_bytes: np.ndarray | float | None = None,
                          microbatch_share: np.ndarray | float = 1.0) -> np.ndarray | float:
    """Activation bytes a device holds at its peak, with ``held`` minibatches in flight (as
    :func:`in_flight` counts them) of ``activation_bytes`` per minibatch: ``held * A``; with
    recomputation (``recompute_input_bytes`` = ``I``, the stage's input per minibatch) only the
    inputs of those in flight plus one micro-batch's full activations, ``held * I + f * A``
    (``f`` = ``microbatch_share``, one micro-batch's share of the minibatch; vectorized)."""
    if recompute_input_bytes is None:
        return held * activation_bytes
    return held * recompute_input_bytes + microbatch_share * activation_bytes


def in_flight(schedule: ScheduleKind | str, replicas: np.ndarray | float, downstream: np.ndarray | float,
              num_microbatches: int | None = None,
              ) -> tuple[np.ndarray | float, np.ndarray | float]:
    """``(minibatches of activations held, weight versions stashed)`` per device of a stage on
    ``replicas`` devices with ``downstream`` devices after it (vectorized; see the module
    docstring). Flush schedules: a replica's share of ``num_microbatches`` round-robin,
    ``ceil(M / r) / M``; None for ``1 / r`` (the partitioner, before the count is chosen)."""
    if _kind(schedule).flushes:
        replicas = np.asarray(replicas, dtype=np.float64)
        if num_microbatches is None:
            return 1.0 / replicas, 0.0
        return np.ceil(num_microbatches / replicas) / num_microbatches, 0.0
    held = 1.0 + np.ceil(np.asarray(downstream, dtype=np.float64) / replicas)
    return held, held - 1.0


def stage_memory_bytes(schedule: ScheduleKind | str, *, parameter_bytes: np.ndarray | float,
                       activation_bytes: np.ndarray | float, replicas: np.ndarray | float,
                       downstream: np.ndarray | float, optimizer_state_factor: float = 1.0,
                       num_microbatches: int | None = None,
                       recompute_input_bytes: np.ndarray | float | None = None,
                       ) -> np.ndarray | float:
    """Peak bytes per device of a stage (``activation_bytes`` per whole minibatch) under
    ``schedule``: :func:`in_flight` fed to :func:`device_memory_bytes`; with
    ``recompute_input_bytes`` (the stage's input per minibatch) under recomputation
    (:func:`held_activation_bytes`; one micro-batch is ``1 / M`` of the minibatch, a whole one
    under PipeDream's schedule, and the replica's share ``1 / r`` while ``M`` is unknown)."""
    held, versions = in_flight(schedule, replicas, downstream, num_microbatches)
    if not _kind(schedule).flushes:
        share: np.ndarray | float = 1.0
    elif num_microbatches is None:
        share = 1.0 / np.asarray(replicas, dtype=np.float64)
    else:
        share = 1.0 / num_microbatches
    activations = held_activation_bytes(held, activation_bytes,
                                        recompute_input_bytes=recompute_input_bytes,
                                        microbatch_share=share)
    return device_memory_bytes(parameter_bytes=parameter_bytes,
                               activation_bytes=activations,
                               stashed_versions=versions,
                               optimizer_state_factor=optimizer_state_factor)


def _kind(schedule: ScheduleKind | str) -> ScheduleKind:
    """The kind of ``schedule`` (a member, or its name); ``ValueError`` for an unknown one."""
    kind = ScheduleKind.parse(schedule)
    if kind is None:
        raise ValueError(f"no memory model for schedule {schedule!r}")
    return kind
