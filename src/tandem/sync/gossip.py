"""Decentralized SGD (D-PSGD, Lian et al. 2017): each step, every worker replaces its parameters
by a weighted average with its neighbours' (a doubly stochastic mixing matrix over a topology),
then applies its own gradient. No worker holds a global model; they reach consensus.

With ``--compress``, the averaging is CHOCO-gossip (Koloskova, Stich and Jaggi, 2019): workers
exchange compressed differences from public copies of their parameters (:class:`ChocoGossip`).

Buffers (BatchNorm's running statistics): the floating-point ones are mixed with the same
weights as the parameters (uncompressed under CHOCO-gossip: they are small), averaged pairwise
with them in AD-PSGD, and averaged over all workers with them for the final model.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from tandem.compress import Codec, ErrorFeedback, Payload, build_codec
from tandem.compress.hooks import from_bytes, to_bytes
from tandem.compress.qsgd import QSGD
from tandem.compress.sparse import RandomK
from tandem.spec.codec import CodecSpec, CodecUse
from tandem.sync.base import SyncStrategy
from tandem.sync.flat import average_model, flatten, float_buffers, model_state, unflatten_into
from tandem.sync.side_group import cpu_group, source_rank
from tandem.topology import Graph, two_colouring

DEFAULT_GOSSIP_STEP = 0.1
"""CHOCO-gossip's consensus step size gamma when ``--gossip-step`` is not given (random-k
takes its ratio if smaller, see :func:`default_gossip_step`)."""


class GossipMixer:
    """One gossip round for this rank: exchange a flat tensor with the neighbours and mix."""

    def __init__(self, graph: Graph, matrix: np.ndarray, rank: int) -> None:
        self.rank = rank
        self.neighbours = sorted(graph[rank])
        self.self_weight = float(matrix[rank, rank])
        self.weights = [float(matrix[rank, j]) for j in self.neighbours]
        self.bytes_sent = 0

    def mix(self, flat: torch.Tensor) -> torch.Tensor:
        """``sum_j W[rank, j] * x_j`` over this rank and its neighbours."""
        received = [torch.empty_like(flat) for _ in self.neighbours]
        operations = [dist.P2POp(dist.isend, flat, peer) for peer in self.neighbours]
        operations += [dist.P2POp(dist.irecv, buffer, peer)
                       for peer, buffer in zip(self.neighbours, received)]
        if operations:
            for work in dist.batch_isend_irecv(operations):
                work.wait()
        self.bytes_sent += len(self.neighbours) * flat.numel() * flat.element_size()
        mixed = flat * self.self_weight
        for weight, other in zip(self.weights, received):
            mixed.add_(other, alpha=weight)
        return mixed


class Gossip(SyncStrategy):
    """D-PSGD: mix parameters with the neighbours, then take the local optimizer step."""

    name = "gossip"
    replicas_agree = False

    def __init__(self, mixer: GossipMixer) -> None:
        self.mixer = mixer

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        return model.to(device)

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        state = model_state(module)
        with self.action("GX"):
            unflatten_into(self.mixer.mix(flatten(state)), state)
        self.step_optimizer(optimizer)
        return False

    def consensus(self, module: nn.Module) -> None:
        average_model(module)

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.mixer.bytes_sent}


def plain(codec: Codec) -> Codec:
    """``codec`` without error feedback: what decodes its payloads."""
    return codec.inner if isinstance(codec, ErrorFeedback) else codec


def tracking_scale(codec: Codec, numel: int) -> float:
    """Factor on a decoded message that makes ``codec`` shrink a difference it tracks.

    Difference tracking (``x̂ += scale * decode(C(x - x̂))``) needs
    ``E|d - scale * C(d)|^2 <= (1 - delta) |d|^2`` for some ``delta > 0``. Top-k, random-k
    (values unscaled), sign (scale mean|d|) and half precision satisfy it with ``scale = 1``.
    QSGD is unbiased with variance up to ``omega |d|^2``, and ``omega`` exceeds 1 for long
    chunks (the differences would grow), so it is scaled by ``1 / (1 + omega)`` (CHOCO's
    rescaled unbiased compressor). ``omega = min(c / s^2, sqrt(c) / s)`` for ``s`` levels and
    chunks of ``c`` elements (Alistarh et al., Lemma 3.1), ``c / 4s^2`` with max norms.
    """
    codec = plain(codec)
    if not isinstance(codec, QSGD):
        return 1.0
    chunk, levels = min(codec.chunk, numel), codec.levels
    spread = chunk / levels**2 if codec.norm == "l2" else chunk / (4 * levels**2)
    return 1.0 / (1.0 + min(spread, math.sqrt(chunk) / levels))


def default_gossip_step(codec: Codec) -> float:
    """:data:`DEFAULT_GOSSIP_STEP`, or random-k's ratio if smaller.

    CHOCO-gossip converges for steps up to about ``delta`` times a factor of the topology,
    where ``1 - delta`` bounds the part of a difference the codec drops. Random-k keeps exactly
    a fraction ``ratio`` of it; top-k keeps at least as much and, on gradients' differences,
    far more, and sign, QSGD (scaled) and half precision keep most. On digits (4 workers, a
    ring) 0.1 trained every codec at its default settings and random-k at ratio 0.1;
    random-k at ratio 0.01 diverged at 0.1 and trained at 0.01.
    """
    codec = plain(codec)
    if isinstance(codec, RandomK):
        return min(DEFAULT_GOSSIP_STEP, codec.ratio)
    return DEFAULT_GOSSIP_STEP


class ChocoGossip(SyncStrategy):
    """D-PSGD whose averaging step is CHOCO-gossip with a codec.

    Worker ``i`` keeps public copies ``x̂_j`` of its own parameters and of its neighbours'
    (all zero at the start, as in the paper). Each step it sends ``q_i = C(x_i - x̂_i)`` to its
    neighbours, every worker adds ``q_j`` (decoded, times :func:`tracking_scale`) to ``x̂_j``,
    and ``x_i += gamma * sum_j W_ij (x̂_j - x̂_i)``; then the local optimizer applies the
    gradient (computed before the exchange), in D-PSGD's order. With a lossless codec and
    ``gamma = 1`` this is D-PSGD: ``x̂_j = x_j`` and the step is ``sum_j W_ij x_j``.

    Every worker encodes each parameter once per step, in the same order, so the positions
    random-k draws from its shared seed are the same on every worker: a neighbour's payload
    decodes with this worker's own positions. Codecs run without error feedback (what they
    drop stays in ``x - x̂``).
    """

    name = "gossip"
    replicas_agree = False

    def __init__(self, graph: Graph, matrix: np.ndarray, rank: int, compress: CodecSpec | str,
                 step: float | None = None) -> None:
        self.rank, self.world_size = rank, len(graph)
        self.neighbours = sorted(graph[rank])
        self.weights = [float(matrix[rank, j]) for j in self.neighbours]
        self.codec = build_codec(compress, strategy=CodecUse.PARAMETERS)
        self.codec.start(rank, len(graph))
        self.step = default_gossip_step(self.codec) if step is None else step
        """The consensus step size gamma."""
        self.keys: list[str] = []
        self.shapes: list[torch.Size] = []
        self.public: dict[int, torch.Tensor] = {}
        """``x̂_j`` for this worker and each neighbour, flat."""
        self.scales: list[float] = []
        self.buffer_mixer = GossipMixer(graph, matrix, rank)
        """Mixes the floating-point buffers, uncompressed (D-PSGD's step)."""
        self.bytes_sent = 0
        self.uncompressed_bytes = 0

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        named = list(model.named_parameters())
        self.keys = [name for name, _ in named]
        self.shapes = [p.shape for _, p in named]
        flat = flatten(p for _, p in named)
        self.public = {j: torch.zeros_like(flat) for j in (self.rank, *self.neighbours)}
        self.scales = [tracking_scale(self.codec, shape.numel()) for shape in self.shapes]
        return model

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        params, buffers = list(module.parameters()), float_buffers(module)
        with self.action("GX"):
            unflatten_into(self.mix(flatten(params)), params)
            if buffers:
                unflatten_into(self.buffer_mixer.mix(flatten(buffers)), buffers)
        self.step_optimizer(optimizer)
        return False

    def mix(self, flat: torch.Tensor) -> torch.Tensor:
        """One CHOCO-gossip round from parameters ``flat``: the new parameters."""
        mine = self.public[self.rank]
        payloads = self._encode(flat - mine)
        template = [[(t.shape, t.dtype) for t in payload] for payload in payloads]
        outgoing = to_bytes([t for payload in payloads for t in payload])
        received = [torch.empty_like(outgoing) for _ in self.neighbours]
        operations = [dist.P2POp(dist.isend, outgoing, peer) for peer in self.neighbours]
        operations += [dist.P2POp(dist.irecv, buffer, peer)
                       for peer, buffer in zip(self.neighbours, received)]
        if operations:
            for work in dist.batch_isend_irecv(operations):
                work.wait()
        self.bytes_sent += len(self.neighbours) * outgoing.numel()
        self.uncompressed_bytes += len(self.neighbours) * flat.numel() * flat.element_size()
        mine.add_(self._decode(payloads, mine))
        for peer, data in zip(self.neighbours, received):
            self.public[peer].add_(self._decode(from_bytes(data, template), mine))
        mixed = flat.clone()
        for peer, weight in zip(self.neighbours, self.weights):
            mixed.add_(self.public[peer] - mine, alpha=self.step * weight)
        return mixed

    def _encode(self, difference: torch.Tensor) -> list[Payload]:
        parts = torch.split(difference, [shape.numel() for shape in self.shapes])
        return [self.codec.encode(part.view(shape), key)
                for part, shape, key in zip(parts, self.shapes, self.keys)]

    def _decode(self, payloads: Sequence[Payload], like: torch.Tensor) -> torch.Tensor:
        """The flat difference ``payloads`` stand for, each tensor times its tracking scale."""
        parts = []
        for payload, shape, key, scale in zip(payloads, self.shapes, self.keys, self.scales):
            part = self.codec.decode(payload, torch.empty(shape, dtype=like.dtype), key)
            parts.append(part.reshape(-1) * scale if scale != 1.0 else part.reshape(-1))
        return torch.cat(parts).to(like.device)

    def state_dict(self) -> dict[str, Any]:
        """The public copies and the codec's state (random draws)."""
        return {"public": {j: copy.cpu() for j, copy in self.public.items()},
                "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for j, copy in state["public"].items():
            self.public[j].copy_(copy)
        self.codec.load_state_dict(state["codec"])

    def consensus(self, module: nn.Module) -> None:
        average_model(module)

    def stats(self) -> dict[str, float]:
        """Bytes sent (buffers included), and the compression ratio of the parameters divided
        by the number of workers (the summary adds the workers' stats up, so it shows their
        mean)."""
        ratio = self.uncompressed_bytes / self.bytes_sent if self.bytes_sent else 1.0
        return {"sync_bytes": self.bytes_sent + self.buffer_mixer.bytes_sent,
                "compression_ratio": ratio / self.world_size}




_REQUEST, _STOP = 1.0, 2.0
_TAG_HEADER, _TAG_MINE, _TAG_THEIRS = 21, 22, 23


class AsyncGossip(SyncStrategy):
    """AD-PSGD (Lian et al. 2018): after each gradient, an *active* worker averages its model
    with one random *passive* neighbour, ``x_i = x_j = (x_i + x_j) / 2``, and applies its
    gradient; passive workers answer such requests on a background thread while they train.
    No worker waits for a global round, so a straggler slows only the requests sent to it.
    The topology must be bipartite (active and passive sides), which rules out deadlock.

    Requests come from any neighbour, which NCCL cannot receive: the exchanges travel on a gloo
    group of their own, through the CPU.
    """

    name = "gossip"
    replicas_agree = False
    synchronous = False

    def __init__(self, graph: Graph, rank: int, seed: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.world_size = len(graph)
        colours = two_colouring(graph)
        self.active = colours[rank] == 0
        self.neighbours = sorted(graph[rank])
        self.random = random.Random(seed * 7919 + rank)
        self.lock = threading.Lock()
        self.bytes_sent = 0
        self.averages = 0
        self.params: list[torch.Tensor] = []
        """The parameters and floating-point buffers, averaged together."""
        self.server: threading.Thread | None = None
        self.error: BaseException | None = None

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        model = model.to(device)
        self.params = model_state(model)
        self.dtype = flatten(self.params).dtype
        """Of the flat model that travels (the parameters' and buffers' common dtype)."""
        self.group = cpu_group(timeout_s=self.timeout_s, own=True)
        if not self.active:
            self.server = threading.Thread(target=self._serve, name="tandem-ad-psgd", daemon=True)
            self.server.start()
        return model

    def update(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> bool:
        if self.error is not None:
            raise self.error
        if self.active and self.neighbours:
            peer = self.random.choice(self.neighbours)
            mine = flatten(self.params)
            outgoing = mine.cpu()
            theirs = torch.empty_like(outgoing)
            with self.action("GX"):
                dist.send(torch.tensor([_REQUEST], dtype=torch.float64), peer, group=self.group,
                          tag=_TAG_HEADER)
                dist.send(outgoing, peer, group=self.group, tag=_TAG_MINE)
                dist.recv(theirs, peer, group=self.group, tag=_TAG_THEIRS)
            self.bytes_sent += mine.numel() * mine.element_size()
            with self.lock:
                change = (theirs.to(mine.device) - mine) / 2
                unflatten_into(flatten(self.params) + change, self.params)
                self.averages += 1
        with self.lock:
            self.step_optimizer(optimizer)
        return False

    def _serve(self) -> None:
        """Passive side: answer averaging requests until every active neighbour says stop."""
        try:
            remaining = len(self.neighbours)
            while remaining:
                header = torch.empty(1, dtype=torch.float64)
                work = dist.irecv(header, src=None, group=self.group, tag=_TAG_HEADER)
                assert work is not None  # None only for a rank outside the group
                work.wait()
                peer = source_rank(work, self.group)
                if header[0] == _STOP:
                    remaining -= 1
                    continue
                theirs = torch.empty(sum(p.numel() for p in self.params), dtype=self.dtype)
                dist.recv(theirs, peer, group=self.group, tag=_TAG_MINE)
                with self.lock:
                    mine = flatten(self.params)
                    unflatten_into(mine + (theirs.to(mine.device) - mine) / 2, self.params)
                    self.averages += 1
                dist.send(mine.cpu(), peer, group=self.group, tag=_TAG_THEIRS)
                self.bytes_sent += mine.numel() * mine.element_size()
        except BaseException as exc:  # noqa: BLE001 - reported by the training thread
            self.error = exc

    def finish(self) -> None:
        if self.active:
            for peer in self.neighbours:
                dist.send(torch.tensor([_STOP], dtype=torch.float64), peer, group=self.group,
                          tag=_TAG_HEADER)
        elif self.server is not None:
            self.server.join()
            if self.error is not None:
                raise self.error

    def consensus(self, module: nn.Module) -> None:
        average_model(module)

    def stats(self) -> dict[str, float]:
        return {"sync_bytes": self.bytes_sent, "pairwise_averages": self.averages}
