"""One encoder and one validating decoder per message kind.

Decoders accept any bytes and either return a typed message or raise ProtocolError; limits
default to `protocol.limits.DEFAULT_LIMITS`.
"""

from __future__ import annotations

from protocol.codec_control import decode_command, decode_reply, encode_command, encode_reply
from protocol.codec_events import decode_event, encode_event
from protocol.codec_job import decode_job, encode_job

__all__ = [
    "decode_command",
    "decode_event",
    "decode_job",
    "decode_reply",
    "encode_command",
    "encode_event",
    "encode_job",
    "encode_reply",
]
