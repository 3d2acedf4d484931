"""How the workers of a plan synchronize, as typed specs with their own options (no torch).

Usage::

    sync = ParameterServerSync(servers=2, mode=PsMode.SSP, staleness=3)   # or mode="ssp"
    sync_to_dict(sync)        # {"method": "ps", "servers": 2, "mode": "ssp", ...}
    sync_from_dict({"method": "gossip", "topology": "torus"})

Each spec names the command-line flags that set its fields (``FLAGS``): the command line
builds specs from them, and a flag of another spec is an error (see :mod:`tandem.strategy`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Union

from tandem.errors import UsageError
from tandem.spec.kinds import ElasticMode, PsMode

PS_MODES = tuple(mode.value for mode in PsMode)
EASGD_MODES = tuple(mode.value for mode in ElasticMode)
GOSSIP_WEIGHTS = ("uniform", "metropolis")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class AllReduceSync:
    """Gradients summed by allreduce every step: PyTorch DDP, or a pipeline stage's replicas."""

    method: ClassVar[str] = "allreduce"
    FLAGS: ClassVar[dict[str, str]] = {}

    @property
    def num_servers(self) -> int:
        """Server processes among the job's: none."""
        return 0


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ParameterServerSync:
    """Parameter servers (the first ``servers`` ranks) hold shards of the model; workers push
    gradients and pull parameters."""

    method: ClassVar[str] = "ps"
    FLAGS: ClassVar[dict[str, str]] = {
        "--servers": "servers", "--mode": "mode", "--staleness": "staleness",
        "--staleness-lr": "staleness_lr", "--backup": "backup",
    }

    servers: int = 1
    """Server processes, counted within the job's processes (ranks ``0..servers-1``)."""
    mode: PsMode = PsMode.SYNC
    """``sync`` (every step waits for the pushes), ``async`` (each push applied on arrival) or
    ``ssp`` (asynchronous, bounded staleness); its name is read into a :class:`PsMode`."""
    staleness: int = 2
    """``ssp``: how many updates a worker may be ahead of the slowest."""
    staleness_lr: bool = False
    """``async``/``ssp``: scale each update's learning rate by 1 / its staleness."""
    backup: int = 0
    """``sync``: backup workers; each step applies the first (workers - backup) pushes."""

    def __post_init__(self) -> None:
        mode = PsMode.parse(self.mode)
        if mode is None:
            raise UsageError(f"--mode {self.mode!r} is not one of: {', '.join(PS_MODES)}")
        object.__setattr__(self, "mode", mode)  # frozen: the name is read once, here
        if self.servers < 1:
            raise UsageError(f"--servers must be at least 1 (got {self.servers})")
        if self.staleness < 0:
            raise UsageError(f"--staleness must be >= 0 (got {self.staleness})")
        if self.backup < 0:
            raise UsageError(f"--backup must be >= 0 (got {self.backup})")
        if self.backup and self.mode.asynchronous:
            raise UsageError(f"--backup applies to --mode sync only (got --mode {self.mode}); "
                             f"drop --backup or use --mode sync")

    @property
    def num_servers(self) -> int:
        """Server processes among the job's (ranks ``0..servers-1``)."""
        return self.servers

    @property
    def asynchronous(self) -> bool:
        """Each push is an update of its own (``async``, ``ssp``): workers never wait for all."""
        return self.mode.asynchronous

    def updates_per_step(self, workers: int) -> int:
        """Server updates that make one optimizer step of ``--batch-size`` samples: one in
        ``sync`` mode (the workers' mean), one per worker in ``async`` and ``ssp`` (each push is
        an update of one worker's share), so ``--steps`` reads the same samples in every mode."""
        return workers if self.mode.asynchronous else 1

    @property
    def server_clips(self) -> bool:
        """Whether ``--clip-grad-norm`` clips on the servers: in ``sync`` mode the applied
        gradient is the workers' mean, whose norm only the servers see (asynchronous modes
        apply each worker's own gradient, which the worker clips before pushing)."""
        return not self.mode.asynchronous

    def check_given(self, given: dict[str, Any]) -> None:
        """Mode-specific flags given with another mode are errors."""
        if "--staleness" in given and not self.mode.bounded:
            raise UsageError(f"--staleness applies to --mode ssp only (got --mode {self.mode}); "
                             f"drop --staleness or use --mode ssp")
        if given.get("--staleness-lr") and not self.mode.asynchronous:
            raise UsageError("--staleness-lr applies to --mode async or ssp only (got --mode "
                             "sync, where no update is stale); drop it or change --mode")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GossipSync:
    """Decentralized SGD over a topology: D-PSGD rounds, or AD-PSGD's pairwise averages."""

    method: ClassVar[str] = "gossip"
    FLAGS: ClassVar[dict[str, str]] = {
        "--topology": "topology", "--weights": "weights", "--async-gossip": "asynchronous",
        "--gossip-step": "step",
    }

    topology: str = "ring"
    """ring, torus, exponential, complete or custom:0-1,1-2,..."""
    weights: str = "metropolis"
    """Mixing weights: ``uniform`` or ``metropolis``."""
    asynchronous: bool = False
    """AD-PSGD: pairwise averaging with a random neighbour, no global rounds."""
    step: float | None = None
    """CHOCO-gossip's consensus step size gamma with compression, in (0, 1] (None: 0.1, or
    random-k's ratio if smaller)."""

    def __post_init__(self) -> None:
        if self.weights not in GOSSIP_WEIGHTS:
            raise UsageError(f"--weights {self.weights!r} is not one of: {', '.join(GOSSIP_WEIGHTS)}")
        if self.step is not None and not (0 < self.step <= 1):
            raise UsageError(f"--gossip-step must be in (0, 1] (got {self.step}); "
                             f"e.g. 0.5, or 1 with a lossless codec")

    @property
    def num_servers(self) -> int:
        """Server processes among the job's: none."""
        return 0


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ElasticAveragingSync:
    """EASGD (Zhang, Choromanska and LeCun, 2015): workers step on their own and move
    elastically towards a center variable, every ``period`` local steps; synchronously (an
    allreduce among the workers, each holding the center) or asynchronously (the center on
    server processes, each worker exchanging with them on its own clock: the paper's
    Algorithm 1). ``nesterov`` gives the workers Nesterov momentum: EAMSGD (Algorithm 2)."""

    method: ClassVar[str] = "easgd"
    FLAGS: ClassVar[dict[str, str]] = {"--rho": "rho", "--period": "period", "--mode": "mode",
                                       "--servers": "servers", "--nesterov": "nesterov"}

    rho: float = 1.0
    """Elasticity; the moving rate is ``alpha = lr * rho``."""
    period: int = 4
    """Elastic update every this many local steps of a worker (tau)."""
    mode: ElasticMode = ElasticMode.SYNC
    """``sync`` (every worker meets the others every period) or ``async`` (a server holds the
    center; no barrier between workers)."""
    servers: int | None = None
    """``async``: server processes holding the center's shards, counted within the job's
    processes (ranks ``0..servers-1``). None: 1 in ``async`` mode, 0 in ``sync`` (always an int
    after construction)."""
    nesterov: bool = False
    """EAMSGD: the workers' SGD uses Nesterov momentum (``--momentum`` is its delta)."""

    def __post_init__(self) -> None:
        if not (self.rho > 0 and math.isfinite(self.rho)):
            raise UsageError(f"--rho must be a positive number (got {self.rho})")
        _check_period(self.period)
        mode = ElasticMode.parse(self.mode)
        if mode is None:
            raise UsageError(f"--mode {self.mode!r} is not one of: {', '.join(EASGD_MODES)} for "
                             f"--strategy easgd (bounded staleness is --strategy ps --mode ssp)")
        object.__setattr__(self, "mode", mode)  # frozen: the name is read once, here
        if not mode.asynchronous and self.servers:
            raise UsageError(f"--servers {self.servers} applies to --strategy easgd --mode async "
                             f"only (synchronous EASGD keeps the center on every worker); add "
                             f"--mode async or drop --servers")
        if mode.asynchronous and self.servers is not None and self.servers < 1:
            raise UsageError(f"--servers must be at least 1 (got {self.servers})")
        if self.servers is None:  # frozen: the default is settled once, here
            object.__setattr__(self, "servers", 1 if mode.asynchronous else 0)

    @property
    def num_servers(self) -> int:
        """Server processes holding the center (``async``; none in ``sync``)."""
        return self.servers or 0

    @property
    def asynchronous(self) -> bool:
        """The center lives on servers and each worker meets it on its own clock."""
        return self.mode.asynchronous


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class LocalSGDSync:
    """Local SGD: workers step on their own and average their parameters every ``period`` steps."""

    method: ClassVar[str] = "localsgd"
    FLAGS: ClassVar[dict[str, str]] = {"--period": "period"}

    period: int = 4
    """Average every this many steps (H)."""

    def __post_init__(self) -> None:
        _check_period(self.period)

    @property
    def num_servers(self) -> int:
        """Server processes among the job's: none."""
        return 0


def _check_period(period: int) -> None:
    if period < 1:
        raise UsageError(f"--period must be at least 1 (got {period})")


SyncSpec = Union[AllReduceSync, ParameterServerSync, GossipSync, ElasticAveragingSync, LocalSGDSync]
"""Any synchronization method."""

SYNC_METHODS: dict[str, type[SyncSpec]] = {cls.method: cls for cls in (
    AllReduceSync, ParameterServerSync, GossipSync, ElasticAveragingSync, LocalSGDSync)}
"""Method name (the ``method`` key of a plan's ``sync``) -> its spec class."""


def sync_to_dict(sync: SyncSpec) -> dict[str, Any]:
    """``{"method": ..., <options>}``, ready for JSON."""
    return {"method": sync.method, **dataclasses.asdict(sync)}


def sync_from_dict(data: Any) -> SyncSpec:
    """The spec of :func:`sync_to_dict`'s output; one-line :class:`UsageError` if malformed."""
    if not isinstance(data, dict) or data.get("method") not in SYNC_METHODS:
        raise UsageError(f"malformed plan: sync {data!r} needs a method, one of: "
                         f"{', '.join(SYNC_METHODS)}")
    cls = SYNC_METHODS[data["method"]]
    known = {field.name for field in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known - {"method"})
    if unknown:
        raise UsageError(f"malformed plan: sync method {data['method']!r} has no option "
                         f"{unknown[0]!r} (known: {', '.join(sorted(known)) or 'none'})")
    try:
        return cls(**{key: value for key, value in data.items() if key != "method"})
    except TypeError as exc:
        raise UsageError(f"malformed plan: sync {data!r}: {exc}") from None
