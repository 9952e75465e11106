"""Size limits enforced while decoding, so no input can make a reader allocate without bound."""

from __future__ import annotations

from dataclasses import dataclass, fields

_MIB = 1024 * 1024
_KIB = 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """Decode-time limits. The defaults suit one worker with a 32k-token context.

    The msgpack-level limits (``max_str_len``, ``max_bin_len``, ``max_array_len``,
    ``max_map_len``) are handed to msgpack itself, which refuses a too-long header before
    allocating anything; the field-level ones are checked on the decoded values.
    """

    max_message_bytes: int = _MIB
    max_str_len: int = 256 * _KIB
    max_bin_len: int = 64 * _KIB
    max_array_len: int = 32768
    max_map_len: int = 256
    max_prompt_tokens: int = 32768
    max_messages: int = 256
    max_stop: int = 16
    max_stop_len: int = 256
    max_stop_token_ids: int = 256
    max_tokens: int = 32768
    max_logprobs: int = 20
    max_token_bytes: int = 1024  # one token's bytes, in a logprob
    max_metadata_bytes: int = 16 * _KIB
    max_metadata_depth: int = 8
    max_schema_depth: int = 32
    max_embedding_inputs: int = 2048  # an embedding job's ``input`` items

    def __post_init__(self) -> None:
        for limit in fields(self):
            name, value = limit.name, getattr(self, limit.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")


DEFAULT_LIMITS = Limits()
