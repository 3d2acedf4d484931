"""Messages between parameter servers and workers, how shards travel in them, and how
parameters are sharded over servers.

Every message is one ``uint8`` tensor: a header of ``float64`` numbers, then the body (one
message per exchange, so each costs one network round trip):

    worker -> server   PUSH    header + gradient shard (float32, or a codec's payloads)
                       PULL    header + unused bytes (the first request, for exact parameters)
                       BYE     header + unused bytes
    server -> worker   PARAMS  header + parameter shard: float32 for the first reply to a worker
                               (and always without ``--compress``), else C(x - x̂_w)

Messages with server 0 also carry the model's buffers (BatchNorm's running statistics, ...)
after the body, exact in their own dtypes (:class:`Buffers`): a push carries the worker's
buffers after its forward passes, a reply the server's. In ``sync`` mode the server takes the
buffers of the lowest-ranked worker whose push the step applies (DDP broadcasts rank 0's), in
``async`` and ``ssp`` those of each push it applies (the pushing worker's replace its own).

Every message from a worker to a server has the size of a push, and every reply has a size the
worker knows (the first is exact, the others compressed), so receive buffers are allocated in
advance. A push's header also carries the worker's :class:`Traffic` so far, which server 0 sums
into the job's byte counts.

With ``--compress``, pulls use difference tracking: the server keeps, per worker, the copy
``x̂_w`` of its shard that the worker holds, sends ``q = C(x - x̂_w)`` and both add the decoded
``q`` to ``x̂_w`` (:class:`PullEncoder`, :class:`PullDecoder`; QSGD's ``q`` is scaled down so
that it shrinks the difference, see :func:`~tandem.sync.gossip.tracking_scale`). What ``C``
drops stays in ``x - x̂_w`` and goes with a later reply: the downlink's error feedback.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence

import torch

from tandem.compress import Codec, Payload, build_codec
from tandem.compress.hooks import from_bytes, to_bytes
from tandem.compress.sparse import RandomK
from tandem.spec.codec import CodecSpec, CodecUse
from tandem.sync.gossip import plain, tracking_scale

PUSH, PULL, BYE, PARAMS = 1, 2, 3, 4
TO_SERVER, TO_WORKER, GATHER, CLIP = 11, 13, 15, 17


@dataclasses.dataclass(kw_only=True, slots=True)
class Traffic:
    """Bytes of one worker's messages with all servers so far (or of several workers')."""

    pushed_bytes: float = 0.0
    """Worker to servers: pushes, the first pull request and the goodbye, headers included."""
    pulled_bytes: float = 0.0
    """Servers to worker: every reply, headers included."""
    raw_pushed_bytes: float = 0.0
    """What the pushed messages would have been without ``--compress``."""
    raw_pulled_bytes: float = 0.0
    """What the replies would have been without ``--compress``."""

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                          for f in dataclasses.fields(Traffic)})

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                          for f in dataclasses.fields(Traffic)})

    @property
    def sent_bytes(self) -> float:
        """Both directions together."""
        return self.pushed_bytes + self.pulled_bytes

    @property
    def compression_ratio(self) -> float:
        """Uncompressed bytes over bytes sent (1 without ``--compress``)."""
        raw = self.raw_pushed_bytes + self.raw_pulled_bytes
        return raw / self.sent_bytes if self.sent_bytes else 1.0


@dataclasses.dataclass(kw_only=True, slots=True)
class Header:
    """The numbers in front of every message (``float64``: integers exact up to 2**53)."""

    kind: int
    step: int = 0
    """PUSH: the servers' version the gradient was computed on (the global batch in ``sync``
    mode; ``version // workers`` otherwise). PARAMS in ``async`` and ``ssp`` modes: the update
    of the run the worker computes next (-1 for none: other modes, or a stop)."""
    version: int = 0
    """PUSH: the shard's version the gradient was computed at; PARAMS: the server's version."""
    loss: float = 0.0
    """PUSH: summed loss of the batch, for server 0's metrics."""
    count: int = 0
    """PUSH: predictions in that sum."""
    stop: bool = False
    """PARAMS: training is over; the worker says BYE."""
    traffic: Traffic = dataclasses.field(default_factory=Traffic)
    """From a worker: its traffic so far, this message included."""

    def encode(self) -> torch.Tensor:
        """The header as ``HEADER_BYTES`` bytes."""
        numbers = [self.kind, self.step, self.version, self.loss, self.count, float(self.stop),
                   *dataclasses.astuple(self.traffic)]
        return torch.tensor(numbers, dtype=torch.float64).view(torch.uint8)

    @staticmethod
    def decode(message: torch.Tensor) -> Header:
        """The header at the start of ``message``."""
        numbers = message[:HEADER_BYTES].view(torch.float64).tolist()
        kind, step, version, loss, count, stop, *traffic = numbers
        return Header(kind=int(kind), step=int(step), version=int(version), loss=loss,
                      count=int(count), stop=bool(stop),
                      traffic=Traffic(**dict(zip(_TRAFFIC_FIELDS, traffic))))


_TRAFFIC_FIELDS = [field.name for field in dataclasses.fields(Traffic)]
HEADER_BYTES = 8 * (6 + len(_TRAFFIC_FIELDS))


def message(header: Header, *parts: torch.Tensor | int) -> torch.Tensor:
    """Header and body parts in one ``uint8`` tensor on the CPU; an int part means that many
    unused bytes."""
    data = [torch.zeros(part, dtype=torch.uint8) if isinstance(part, int) else part.cpu()
            for part in parts]
    return torch.cat([header.encode(), *data])


def empty(body_bytes: int) -> torch.Tensor:
    """A receive buffer for a message with a body of ``body_bytes``."""
    return torch.empty(HEADER_BYTES + body_bytes, dtype=torch.uint8)


def body(received: torch.Tensor) -> torch.Tensor:
    """The bytes after the header."""
    return received[HEADER_BYTES:]


class Buffers:
    """A model's buffers as message bytes, each exact in its own dtype (float running
    statistics, integer counters such as ``num_batches_tracked``)."""

    def __init__(self, buffers: Sequence[torch.Tensor]) -> None:
        self.tensors = list(buffers)
        self.template = [[(b.shape, b.dtype)] for b in self.tensors]
        self.num_bytes = sum(b.numel() * b.element_size() for b in self.tensors)
        """Bytes of every buffer together."""

    def encode(self) -> torch.Tensor:
        """The buffers' current values as ``num_bytes`` bytes (on the CPU)."""
        if not self.tensors:
            return torch.empty(0, dtype=torch.uint8)
        return to_bytes([b.detach().cpu() for b in self.tensors])

    def load(self, data: torch.Tensor) -> None:
        """Set the buffers from :meth:`encode`'s bytes (of a peer's copy of the same model)."""
        for tensor, (value,) in zip(self.tensors, from_bytes(data, self.template)):
            tensor.data.copy_(value)


class ShardCodec:
    """A shard (tensors of ``shapes``, concatenated in one flat float32 tensor) as message bytes:
    its float32 values without a ``spec``, else one codec payload per tensor (keyed by
    ``keys``, so codec state stays per parameter).

    ``feedback`` keeps the registry's error feedback (gradient pushes); without it the codec is
    the plain one (pulls, whose difference tracking is their error feedback). Decoding a
    random-k payload needs the positions its encoding drew; a decoding side redraws them from
    the shared seed with a codec of its own that advances in step with the sender's (one
    message decoded per message encoded, in order).
    """

    def __init__(self, spec: CodecSpec | str | None, shapes: Sequence[torch.Size],
                 keys: Sequence[str], *, feedback: bool) -> None:
        assert len(shapes) == len(keys), (shapes, keys)
        self.shapes, self.keys = list(shapes), list(keys)
        self.sizes = [shape.numel() for shape in self.shapes]
        self.raw_bytes = 4 * sum(self.sizes)
        """Body bytes of the shard in float32."""
        self.codec: Codec | None = None
        self.template: list[list[tuple[torch.Size, torch.dtype]]] = []
        if spec is not None:
            codec = build_codec(spec, strategy=CodecUse.PUSHES)
            self.codec = codec if feedback else plain(codec)
            self.template = [[(t.shape, t.dtype) for t in payload]
                             for payload in self._zeros_payloads(spec)]
        self.body_bytes = self.raw_bytes if spec is None else sum(
            shape.numel() * torch.empty((), dtype=dtype).element_size()
            for payload in self.template for shape, dtype in payload)
        """Body bytes of an encoded shard."""
        self.redraws = self.codec is not None and isinstance(plain(self.codec), RandomK)
        self.scales = [tracking_scale(self.codec, size) if self.codec else 1.0
                       for size in self.sizes]
        """Per tensor, the factor on decoded differences that are tracked (pulls)."""

    def _zeros_payloads(self, spec: CodecSpec | str) -> list[Payload]:
        """Payloads of zeros from a codec of their own: their shapes and dtypes (which depend
        only on the tensors' shapes) without touching this codec's state."""
        scratch = plain(build_codec(spec, strategy=CodecUse.PUSHES))
        return [scratch.encode(torch.zeros(shape), key)
                for shape, key in zip(self.shapes, self.keys)]

    def start(self, rank: int, world_size: int) -> None:
        """Seed per-sender randomness (quantization noise) of the encoding side."""
        if self.codec is not None:
            self.codec.start(rank, world_size)

    def encode(self, flat: torch.Tensor) -> tuple[torch.Tensor, list[Payload]]:
        """The body bytes of ``flat`` and the payloads they hold (none without a codec)."""
        if self.codec is None:
            return flat.to(torch.float32).contiguous().view(torch.uint8), []
        payloads = [self.codec.encode(part.view(shape), key) for part, shape, key
                    in zip(torch.split(flat, list(self.sizes)), self.shapes, self.keys)]
        tensors = [t for payload in payloads for t in payload]
        data = to_bytes(tensors) if tensors else torch.empty(0, dtype=torch.uint8)
        return data, payloads

    def decode_payloads(self, payloads: Sequence[Payload], *,
                        tracked: bool = False) -> torch.Tensor:
        """The flat float32 shard that ``payloads`` (this side's own encoding) stand for; a
        ``tracked`` difference is scaled by :attr:`scales`."""
        assert self.codec is not None
        codec = plain(self.codec)
        parts = []
        for payload, shape, key, scale in zip(payloads, self.shapes, self.keys, self.scales):
            part = codec.decode(payload, torch.empty(shape), key).reshape(-1)
            parts.append(part * scale if tracked and scale != 1.0 else part)
        return torch.cat(parts) if parts else torch.zeros(0)

    def decode(self, data: torch.Tensor, *, tracked: bool = False) -> torch.Tensor:
        """The flat float32 shard of a body received from the other side."""
        if self.codec is None:
            return data.view(torch.float32)
        if self.redraws:
            for shape, key in zip(self.shapes, self.keys):
                plain(self.codec).encode(torch.zeros(shape), key)
        return self.decode_payloads(from_bytes(data, self.template), tracked=tracked)


class PullEncoder:
    """The server's side of one worker's pulls: exact the first time, then ``C(x - x̂_w)``."""

    def __init__(self, codec: ShardCodec) -> None:
        self.codec = codec
        self.copy: torch.Tensor | None = None
        """``x̂_w``: the shard as the worker holds it (kept only with a codec)."""

    @property
    def next_bytes(self) -> int:
        """Body bytes of the next reply."""
        return self.codec.body_bytes if self.copy is not None else self.codec.raw_bytes

    @property
    def raw_bytes(self) -> int:
        return self.codec.raw_bytes

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The body of the next reply for shard values ``flat``; updates ``x̂_w``."""
        if self.codec.codec is None:
            return flat.to(torch.float32).contiguous().view(torch.uint8)
        if self.copy is None:
            self.copy = flat.detach().to(torch.float32).clone()
            return self.copy.view(torch.uint8).clone()
        data, payloads = self.codec.encode(flat - self.copy)
        self.copy.add_(self.codec.decode_payloads(payloads, tracked=True))
        return data


class PullDecoder:
    """The worker's side of its pulls from one server: the mirror of :class:`PullEncoder`."""

    def __init__(self, codec: ShardCodec) -> None:
        self.codec = codec
        self.exact_received = False

    @property
    def next_bytes(self) -> int:
        """Body bytes of the next reply."""
        compressed = self.codec.codec is not None and self.exact_received
        return self.codec.body_bytes if compressed else self.codec.raw_bytes

    def apply(self, data: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
        """Set (first reply, or uncompressed) or advance (``x̂ += q``) ``params`` from a body."""
        offset = 0
        if self.codec.codec is None or not self.exact_received:
            values = data.view(torch.float32)
            self.exact_received = True
            for p in params:
                p.data.copy_(values[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
            return
        delta = self.codec.decode(data, tracked=True)
        for p in params:
            p.data.add_(delta[offset : offset + p.numel()].view_as(p).to(p.device))
            offset += p.numel()


def shard_ranges(sizes: Sequence[int], num_shards: int) -> list[tuple[int, int]]:
    """Split parameters (by element count, in order) into ``num_shards`` contiguous index ranges
    of near-equal total size; trailing shards are empty when there are more servers than tensors."""
    prefix = list(itertools.accumulate(sizes, initial=0))
    total = prefix[-1]
    cuts = [bisect.bisect_left(prefix, total * k / num_shards) for k in range(1, num_shards)]
    bounds = [0, *(min(cut, len(sizes)) for cut in cuts), len(sizes)]
    return list(itertools.pairwise(bounds))
