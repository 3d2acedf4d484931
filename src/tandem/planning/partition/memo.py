"""The partitioner's solves remembered within a process, so that none is done twice.

The planner asks the partitioner for plans along ladders of link speeds and memory budgets, on
a fixed grid of budgets that every rung and every limit shares; ``tandem scale`` asks again for
every device count, and a caller comparing clusters (a bandwidth series, a tighter limit) asks
again for the rungs they share. What is kept, by the content of its inputs (never by object
identity, so an equal profile built anew is recognised):

- :func:`recall`: a whole solve (its partition or its refusal, no plan fits), by the
  profile, the cluster's levels, speed and memory, and the options; an LRU of
  :data:`MAX_SOLVES`.
- :func:`states_of`: the cut states of a profile (:func:`build_states`), once per profile.
- :func:`inner_table`: the full table of an inner level of a hierarchy, by the levels up to
  its own (a ``tandem scale`` point differs from the next in its outer level only); an LRU of
  at most :data:`MAX_TABLE_BYTES`. The innermost level's table under a memory limit starts
  from the one kept under the least looser limit, and solves again only the cells whose plan
  there no longer fits (:func:`.levels.solve_level`): a walk down the memory grid.
- :func:`infeasible`: on one level, whether a plan fits depends on memory alone (links and
  speed change times, not bytes), and a plan that fits a budget fits every looser one; so the
  loosest budget known to fit nothing is kept per profile, unit count and memory options, and
  a budget at or below it needs no solve.
- :func:`optimum_bounds`: on one level under a memory limit, the least bottleneck
  :mod:`.limited`'s search reached under each budget, per profile, cluster and options; a
  looser budget's is a lower bound under a tighter one (the limit only removes plans) and a
  tighter budget's an upper bound, so a walk down the memory grid starts each search between
  its neighbours' (the same plan: the search returns the plan at the optimum itself).
- :func:`known_plans`: the stages of every plan solved, by profile and device count, for
  :mod:`.bounded`'s table to take the least bottleneck among those that fit as its bound (a
  plan known to exist: pruning by it keeps the answer exactly).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import numpy as np

from tandem.planning.partition.antichain import States, build_states
from tandem.profile import ModelProfile

T = TypeVar("T")

MAX_SOLVES = 512
"""Whole solves kept (a planning takes a few dozen; each holds its stages and shares states)."""
MAX_PROFILES = 16
"""Profiles whose states, infeasible budgets and plans are kept."""
MAX_TABLE_BYTES = 128e6
"""Bytes of inner-level tables kept (ResNet-50 on servers of 4: 6 MB each)."""
MAX_KNOWN_PLANS = 64
"""Plans kept per profile and device count for bounds (the latest)."""

StageKey = tuple[tuple[int, int, int], ...]
"""A plan's stages as (state before, state, replicas)."""


class Content:
    """A profile's layers and edges as a key: hashed once, compared by value."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple[Any, ...]) -> None:
        self.value = value
        self._hash = hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Content) and (self.value is other.value
                                               or self.value == other.value)


class _Lru:
    """An ordered dict that forgets its least recently used entries beyond a total size."""

    def __init__(self, capacity: float, size: Callable[[Any], float] = lambda _: 1.0) -> None:
        self.capacity = capacity
        self.size = size
        self.entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.total = 0.0

    def get(self, key: Hashable) -> Any:
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        if key in self.entries:
            self.total -= self.size(self.entries.pop(key))
        self.entries[key] = value
        self.total += self.size(value)
        while self.total > self.capacity and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.total -= self.size(old)

    def clear(self) -> None:
        self.entries.clear()
        self.total = 0.0


_SOLVES = _Lru(MAX_SOLVES)
_STATES = _Lru(MAX_PROFILES)
_TABLES = _Lru(MAX_TABLE_BYTES, size=lambda entry: _nbytes(entry, depth=3))
_INFEASIBLE = _Lru(MAX_PROFILES * 64)
_KNOWN = _Lru(MAX_PROFILES * 8)
_CONTENTS = _Lru(MAX_PROFILES)
_FAMILIES = _Lru(MAX_PROFILES * 8)
_OPTIMA = _Lru(MAX_PROFILES * 8)


def _nbytes(value: Any, depth: int) -> float:
    """The bytes of the arrays in ``value`` (a tuple or dataclass of them, ``depth`` deep)."""
    if isinstance(value, np.ndarray):
        return float(value.nbytes)
    if depth == 0:
        return 0.0
    if isinstance(value, tuple):
        return sum(_nbytes(item, depth - 1) for item in value)
    if dataclasses.is_dataclass(value):
        return sum(_nbytes(getattr(value, field.name), depth - 1)
                   for field in dataclasses.fields(value) if field.name != "states")
    return 0.0


def content(profile: ModelProfile) -> Content:
    """``profile``'s layers and edges as a key (equal profiles give the same object)."""
    key = Content((tuple(profile.layers), tuple(profile.edge_list())))
    found = _CONTENTS.get(key)
    if found is None:
        _CONTENTS.put(key, key)
        return key
    return found  # type: ignore[no-any-return]


def recall(key: Hashable, solve: Callable[[], T], refusal: type[Exception]) -> T:
    """``solve()``, or what it returned before for ``key``; a ``refusal`` it raised before is
    raised again (other errors are not kept)."""
    found = _SOLVES.get(key)
    if found is None:
        try:
            found = (True, solve())
        except refusal as exc:
            _SOLVES.put(key, (False, exc.args))
            raise
        _SOLVES.put(key, found)
    ok, value = found
    if not ok:
        raise refusal(*value)
    return value  # type: ignore[no-any-return]


def states_of(profile: ModelProfile, key: Content) -> States:
    """The cut states of ``profile`` (whose content is ``key``), built once."""
    found = _STATES.get(key)
    if found is None:
        found = build_states(profile)
        _STATES.put(key, found)
    return found  # type: ignore[no-any-return]


def inner_table(key: Hashable, solve: Callable[[T | None], T], family: Hashable = None,
                memory_bytes: float | None = None) -> T:
    """The table of an inner level, solved once for ``key`` (the levels up to it and every
    input of their problems). With a ``family`` (the same question under any memory limit;
    ``memory_bytes`` this one's, None: none), ``solve`` gets the table kept for the least
    looser limit of the family to start from (None when none is kept)."""
    found = _TABLES.get(key)
    if found is None:
        found = solve(_looser(family, memory_bytes) if family is not None else None)
        _TABLES.put(key, found)
        if family is not None:
            limits: dict[float, Hashable] = _FAMILIES.get(family) or {}
            limits[math.inf if memory_bytes is None else memory_bytes] = key
            _FAMILIES.put(family, limits)
    return found  # type: ignore[no-any-return]


def _looser(family: Hashable, memory_bytes: float | None) -> Any:
    """The table kept for the least limit of ``family`` looser than ``memory_bytes``."""
    limits: dict[float, Hashable] = _FAMILIES.get(family) or {}
    limit = math.inf if memory_bytes is None else memory_bytes
    for looser in sorted(budget for budget in limits if budget > limit):
        found = _TABLES.get(limits[looser])
        if found is not None:
            return found
    return None


def infeasible(key: Hashable, memory_bytes: float) -> bool:
    """Whether no plan fits ``memory_bytes`` per device, as known for ``key`` (a profile, a
    one-level cluster's unit count and the options that change memory or the plans allowed)."""
    loosest = _INFEASIBLE.get(key)
    return loosest is not None and memory_bytes <= loosest


def note_infeasible(key: Hashable, memory_bytes: float) -> None:
    """No plan fits ``memory_bytes`` for ``key`` (nor any tighter budget)."""
    loosest = _INFEASIBLE.get(key)
    _INFEASIBLE.put(key, memory_bytes if loosest is None else max(loosest, memory_bytes))


def optimum_bounds(family: Hashable, memory_bytes: float) -> tuple[float, float]:
    """Bounds on the least bottleneck reached under ``memory_bytes`` for ``family`` (a one-level
    problem under any limit): the greatest reached under a looser limit (at most this one's)
    and the least under a tighter one (at least this one's); 0 and inf where none is kept."""
    optima: dict[float, float] = _OPTIMA.get(family) or {}
    low = max((reached for budget, reached in optima.items() if budget > memory_bytes),
              default=0.0)
    high = min((reached for budget, reached in optima.items() if budget < memory_bytes),
               default=math.inf)
    return low, high


def note_optimum(family: Hashable, memory_bytes: float, reached: float) -> None:
    """The least bottleneck reached under ``memory_bytes`` for ``family``."""
    optima: dict[float, float] = _OPTIMA.get(family) or {}
    optima[memory_bytes] = reached
    _OPTIMA.put(family, optima)


def known_plans(key: Hashable) -> list[StageKey]:
    """The plans solved for ``key`` (a profile and a device count), latest last."""
    found = _KNOWN.get(key)
    return list(found) if found is not None else []


def note_plan(key: Hashable, stages: StageKey) -> None:
    """A plan solved for ``key``: kept among the latest :data:`MAX_KNOWN_PLANS`."""
    found: dict[StageKey, None] = _KNOWN.get(key) or {}
    found.pop(stages, None)
    found[stages] = None
    while len(found) > MAX_KNOWN_PLANS:
        del found[next(iter(found))]
    _KNOWN.put(key, found)


def forget() -> None:
    """Drop everything kept (for measuring a cold start)."""
    for cache in (_SOLVES, _STATES, _TABLES, _INFEASIBLE, _KNOWN, _CONTENTS, _FAMILIES,
                  _OPTIMA):
        cache.clear()
