"""Each token's own bytes, for logprobs that name their tokens.

A token is not always text: byte-level BPE splits a multi-byte character across tokens, so
only its bytes say exactly what it adds to the output. They are read from the table mlx-lm's
streaming detokenizer already holds for the model's kind of tokenizer (byte-level BPE: token
strings in GPT-2's byte alphabet; SentencePiece: UTF-8 with ``▁`` for a space and ``<0xNN>``
byte tokens), so a token's bytes are exactly what that detokenizer appends for it; a tokenizer
of another kind decodes the token alone. Engine thread only (any thread would do: no MLX).
"""

from __future__ import annotations

from typing import Any, Final

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

_SPACE: Final = "\u2581".encode()  # SentencePiece's word boundary
# GPT-2's alphabet: one printable character per byte.
_BYTE_OF: Final = {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """``token_bytes(token_id)``: the token's bytes (``b""`` for an id past the vocabulary)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        detokenizer = tokenizer.detokenizer
        self._table: list[Any] | None = getattr(detokenizer, "tokenmap", None)
        if isinstance(detokenizer, BPEStreamingDetokenizer):
            self._kind = "bpe"
        elif isinstance(detokenizer, SPMStreamingDetokenizer):
            self._kind = "spm"
        else:
            self._kind, self._table = "decode", None
        self._known: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        known = self._known.get(token_id)
        if known is None:
            known = self._known[token_id] = self._bytes(token_id)
        return known

    def _bytes(self, token_id: int) -> bytes:
        if self._table is None:
            return str(self._tokenizer.decode([token_id])).encode()
        if not 0 <= token_id < len(self._table):
            return b""
        entry = self._table[token_id]
        if self._kind == "spm":
            return bytes(entry).replace(_SPACE, b" ")
        # A character outside the byte alphabet (an added token's) stands for itself, as in
        # mlx-lm's detokenizer.
        return b"".join(
            bytes([_BYTE_OF[char]]) if char in _BYTE_OF else char.encode() for char in str(entry)
        )
