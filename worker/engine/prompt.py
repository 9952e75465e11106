"""Text prompts to token ids, one rule for the engine and for the daemon's chat rendering."""

from __future__ import annotations

from typing import Any


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``; the tokenizer's special prefix (BOS) is added unless the text
    already starts with it (a rendered chat template usually does)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def shared_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length
