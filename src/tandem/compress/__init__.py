"""Gradient compression for data parallelism: codecs, error feedback and DDP hooks.

Usage::

    from tandem.compress import ByteMeter, build_compression

    compression = build_compression("topk:ratio=0.01")         # or fp16, qsgd:levels=7, sign, ...
    meter = ByteMeter(world_size=dist.get_world_size())
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(*compression.ddp_hook(model, meter))
    # meter.payload_bytes / meter.gradient_bytes: bytes sent vs uncompressed
"""

from tandem.compress.codec import Codec, Compression, Payload, payload_bytes
from tandem.compress.feedback import ErrorFeedback
from tandem.compress.meter import ByteMeter, ring_bytes
from tandem.compress.registry import CODECS, build_codec, build_compression, check_compress

__all__ = ["CODECS", "ByteMeter", "Codec", "Compression", "ErrorFeedback", "Payload",
           "build_codec", "build_compression", "check_compress", "payload_bytes", "ring_bytes"]
