"""How a tensor travels between pipeline stages: as it is, or as one byte message of a codec.

Usage::

    wire = Wire.build("fp16", rank=0, world_size=2)
    message = wire.pack(activation, "activation")              # what the sender isends
    buffer = wire.receive_buffer(shape, torch.float32, device)  # what the receiver irecvs into
    activation = wire.unpack(buffer, shape, torch.float32, "activation")

A codec's payload sizes depend only on the tensor's shape and dtype, so the receiver sizes its
buffer from the shape it already expects: a *probe* (a second instance of the codec, so that
the real one's random state is untouched) encodes a zero tensor of that shape once, and the
shapes and dtypes of its payload are cached as the message's template. The sender checks every
message against the same template. Tensors that are not floating point (token ids) travel as
they are. Several tensors crossing one boundary (a skip connection, an attention mask) travel as
one message: their messages' bytes, concatenated (``pack_many``, ``unpack_many``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tandem.compress.codec import Codec
from tandem.compress.hooks import from_bytes, to_bytes
from tandem.compress.registry import build_codec
from tandem.spec.codec import CodecSpec, CodecUse

Template = tuple[tuple[torch.Size, torch.dtype], ...]
"""Shape and dtype of each tensor of a codec's payload."""


@dataclasses.dataclass(slots=True)
class Traffic:
    """Bytes one worker has sent while training, by what they carried."""

    activation_bytes: int = 0
    """Activations and activation gradients sent, at the size they were computed."""
    message_bytes: int = 0
    """What went on the wire for them (the codec's messages; the same bytes without one)."""
    other_bytes: float = 0.0
    """Weight versions (vertical sync) and the replicas' gradient allreduces (as a ring)."""

    @property
    def total_bytes(self) -> float:
        """Everything this worker sent."""
        return self.message_bytes + self.other_bytes


class Wire:
    """Packs tensors into messages whose size the receiver knows from the shape alone."""

    def __init__(self, codec: Codec | None = None, probe: Codec | None = None) -> None:
        """``codec`` encodes and decodes; ``probe``, another instance of it, sizes messages."""
        assert (codec is None) == (probe is None), "a codec needs a probe of its own"
        self.codec, self.probe = codec, probe
        self.templates: dict[tuple[torch.Size, torch.dtype], Template] = {}

    @classmethod
    def build(cls, spec: CodecSpec | str | None, *, rank: int, world_size: int) -> Wire:
        """The wire of ``--compress spec`` (plain for None) for worker ``rank``."""
        if spec is None:
            return cls()
        codec = build_codec(spec, strategy=CodecUse.ACTIVATIONS)
        codec.start(rank, world_size)
        return cls(codec, build_codec(spec, strategy=CodecUse.ACTIVATIONS))

    def compresses(self, dtype: torch.dtype) -> bool:
        """Whether tensors of ``dtype`` are encoded (only floating-point ones are)."""
        return self.codec is not None and dtype.is_floating_point

    def template(self, shape: Sequence[int], dtype: torch.dtype) -> Template:
        """Shapes and dtypes of the payload of a ``shape`` tensor (cached per shape)."""
        key = (torch.Size(shape), dtype)
        if key not in self.templates:
            assert self.probe is not None
            payload = self.probe.encode(torch.zeros(key[0], dtype=dtype), "probe")
            self.templates[key] = tuple((t.shape, t.dtype) for t in payload)
        return self.templates[key]

    def message_bytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Bytes of the message that carries a ``shape`` tensor of ``dtype``."""
        if not self.compresses(dtype):
            return torch.Size(shape).numel() * dtype.itemsize
        return sum(size.numel() * kind.itemsize for size, kind in self.template(shape, dtype))

    def receive_buffer(self, shape: Sequence[int], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
        """An empty tensor to receive the message of a ``shape`` tensor into."""
        if not self.compresses(dtype):
            return torch.empty(tuple(shape), dtype=dtype, device=device)
        return torch.empty(self.message_bytes(shape, dtype), dtype=torch.uint8, device=device)

    def pack(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """The message that carries ``tensor`` (``key`` names what it is for the codec)."""
        if not self.compresses(tensor.dtype):
            return tensor.contiguous()
        assert self.codec is not None
        message = to_bytes(self.codec.encode(tensor, key))
        expected = self.message_bytes(tensor.shape, tensor.dtype)
        if message.numel() != expected:
            raise RuntimeError(
                f"--compress {self.codec.spec} encoded a {tuple(tensor.shape)} tensor into "
                f"{message.numel()} bytes, but its receiver expects {expected}: a codec's "
                f"payload sizes must depend only on the tensor's shape and dtype"
            )
        return message

    def layout(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of the message that carries a ``shape`` tensor of ``dtype``."""
        if not self.compresses(dtype):
            return torch.Size(shape), dtype
        return torch.Size([self.message_bytes(shape, dtype)]), torch.uint8

    def receive_many(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
                     device: torch.device) -> torch.Tensor:
        """An empty tensor to receive the message of several tensors into (one: as
        :meth:`receive_buffer`; none: one byte)."""
        if len(shapes) == 1:
            return self.receive_buffer(shapes[0], dtypes[0], device)
        total = sum(self.message_bytes(shape, dtype) for shape, dtype in zip(shapes, dtypes))
        return torch.empty(total if shapes else 1, dtype=torch.uint8, device=device)

    def pack_many(self, tensors: Sequence[torch.Tensor], key: str,
                  device: torch.device | None = None) -> torch.Tensor:
        """The one message that carries ``tensors`` (none: one byte on ``device``)."""
        if len(tensors) == 1:
            return self.pack(tensors[0], key)
        if not tensors:
            return torch.zeros(1, dtype=torch.uint8, device=device)
        return to_bytes([self.pack(tensor, key) for tensor in tensors])

    def unpack_many(self, message: torch.Tensor, shapes: Sequence[Sequence[int]],
                    dtypes: Sequence[torch.dtype], key: str) -> list[torch.Tensor]:
        """The tensors a message of :meth:`pack_many` carries."""
        if len(shapes) == 1:
            return [self.unpack(message, shapes[0], dtypes[0], key)]
        layouts = [[self.layout(shape, dtype)] for shape, dtype in zip(shapes, dtypes)]
        parts = from_bytes(message, layouts)
        return [self.unpack(part[0], shape, dtype, key)
                for part, shape, dtype in zip(parts, shapes, dtypes)]

    def unpack(self, message: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               key: str) -> torch.Tensor:
        """The tensor a received ``message`` carries."""
        if not self.compresses(dtype):
            return message
        assert self.codec is not None
        payload = from_bytes(message, [self.template(shape, dtype)])[0]
        like = torch.empty(tuple(shape), dtype=dtype, device=message.device)
        return self.codec.decode(payload, like, key)
