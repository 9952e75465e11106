"""Rebuilding a Hugging Face byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata.

GGUF stores the vocabulary (in id order), the merges (``"a b"`` strings), a type per token
(1 normal, 3 control, 4 user-defined, ...) and the special token ids. For ``gpt2``-style models
that is all a ``tokenizers`` BPE needs; the pre-tokenizer comes from ``tokenizer.ggml.pre``
(SmolLM's splits digits one by one before the GPT-2 byte-level regex).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from mlx_redis_worker.models.gguf import meta_value
from mlx_redis_worker.models.tokenizer_files import SpecialTokens

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
# llama.cpp pre-tokenizer kinds whose first step isolates every digit.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell"}


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    return byte_level


def tokenizer_from_gguf(metadata: dict[str, Any]) -> tuple[Tokenizer, SpecialTokens]:
    """The tokenizer and its named special tokens, from GGUF metadata."""
    kind = meta_value(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are supported, got {kind!r}")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    types = meta_value(metadata, "tokenizer.ggml.token_type") or [1] * len(tokens)

    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(meta_value(metadata, "tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()

    controls = [t for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_CONTROL]
    user_defined = [t for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    if user_defined:
        tokenizer.add_tokens([AddedToken(t, normalized=False) for t in user_defined])

    def token(key: str) -> str | None:
        token_id = meta_value(metadata, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(token_id)] if token_id is not None else None

    eos = token("eos")
    if eos is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.eos_token_id")
    bos = token("bos")
    if bos is not None and meta_value(metadata, "tokenizer.ggml.add_bos_token", False):
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    special = SpecialTokens(
        eos=eos, bos=bos, pad=token("padding"), unk=token("unknown"), extra=tuple(controls)
    )
    return tokenizer, special
