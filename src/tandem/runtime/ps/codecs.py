"""A server's codecs, one pair per worker: the decoder of its pushes and the encoder of the
replies to it (with the copy of the shard the worker holds), and, as a component of the
server, their state in checkpoints."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from tandem.runtime.component import Component, StepEnd
from tandem.runtime.ps import protocol
from tandem.spec.codec import CodecSpec


class WireCodecs(Component):
    """Per worker, how this server decodes its pushes and encodes its replies (``spec``, the
    plan's codec; None: plain float32 both ways, and no state: the server leaves it out of its
    components).

    As a component, it takes a snapshot of its state at every step a checkpoint is taken after
    (:attr:`StepEnd.saving`), which the server calls before that version's replies advance the
    encoders; its :meth:`state_dict` is that snapshot."""

    name = "codecs"

    def __init__(self, spec: CodecSpec | None, shapes: Sequence[torch.Size],
                 keys: Sequence[str]) -> None:
        self.spec = spec
        self.shapes, self.keys = list(shapes), list(keys)
        self.decoders: dict[int, protocol.ShardCodec] = {}
        """Per worker: decodes its pushes (a codec of its own, for codecs with shared state)."""
        self.encoders: dict[int, protocol.PullEncoder] = {}
        """Per worker: its copy of this shard, and how replies to it are encoded."""
        self.snapshot: dict[str, Any] | None = None
        """The state at the last step a checkpoint is taken after (:meth:`current_state`),
        taken before that step's replies advance the encoders."""

    def codec(self, *, feedback: bool) -> protocol.ShardCodec:
        """A fresh codec of this server's shard (``feedback``: with error feedback, as the
        workers push)."""
        return protocol.ShardCodec(self.spec, self.shapes, self.keys, feedback=feedback)

    def decode(self, worker: int, data: torch.Tensor) -> torch.Tensor:
        """The gradient shard ``worker`` pushed as ``data`` (decoded in the order it sent)."""
        if worker not in self.decoders:
            self.decoders[worker] = self.codec(feedback=False)
        return self.decoders[worker].decode(data)

    def encode(self, worker: int, flat: torch.Tensor) -> torch.Tensor:
        """The body of a reply to ``worker`` carrying the shard ``flat``."""
        if worker not in self.encoders:
            self.encoders[worker] = protocol.PullEncoder(self.codec(feedback=False))
        return self.encoders[worker].encode(flat)

    def after_step(self, end: StepEnd) -> None:
        if end.saving:
            self.snapshot = self.current_state()

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint holds: the snapshot of the last step one is taken after
        (the state now, before any)."""
        return self.snapshot if self.snapshot is not None else self.current_state()

    def current_state(self) -> dict[str, Any]:
        """With a codec, per worker: the state of the decoder of its pushes, and the copy of
        the shard it holds (``x̂_w``) with the encoder of its pulls (their workers save theirs
        in ``worker-K.pt`` at the same update)."""
        if self.spec is None:
            return {}
        return copy.deepcopy({  # a snapshot: encoding the next replies changes these in place
            "decoders": {w: d.codec.state_dict() for w, d in self.decoders.items() if d.codec},
            "encoders": {w: {"copy": e.copy, "codec": e.codec.codec.state_dict()
                             if e.codec.codec else {}} for w, e in self.encoders.items()},
        })

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state."""
        for worker, saved in state.get("decoders", {}).items():
            decoder = self.decoders[worker] = self.codec(feedback=False)
            if decoder.codec is not None:
                decoder.codec.load_state_dict(saved)
        for worker, saved in state.get("encoders", {}).items():
            encoder = self.encoders[worker] = protocol.PullEncoder(self.codec(feedback=False))
            encoder.copy = saved["copy"]
            if encoder.codec.codec is not None:
                encoder.codec.codec.load_state_dict(saved["codec"])
