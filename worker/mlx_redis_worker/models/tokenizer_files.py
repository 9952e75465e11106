"""Saving a ``tokenizers.Tokenizer`` as the Hugging Face files ``transformers`` loads.

Writes ``tokenizer.json``, ``tokenizer_config.json`` (class, special tokens, chat template)
and ``special_tokens_map.json``, which is what ``mlx_lm.load`` needs to build its
``TokenizerWrapper`` around a ``PreTrainedTokenizerFast``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from mlx_redis_worker.models.folder import write_json

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SpecialTokens:
    """The named special tokens of a tokenizer (text form); ``extra`` are the other controls."""

    eos: str
    bos: str | None = None
    pad: str | None = None
    unk: str | None = None
    extra: tuple[str, ...] = field(default_factory=tuple)

    def as_map(self) -> dict[str, Any]:
        named = {"bos_token": self.bos, "eos_token": self.eos}
        named |= {"pad_token": self.pad, "unk_token": self.unk}
        mapping: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
        named_values = set(mapping.values())
        extra = [t for t in self.extra if t not in named_values]
        if extra:
            mapping["additional_special_tokens"] = extra
        return mapping


def save_tokenizer(
    tokenizer: Tokenizer,
    folder: Path,
    special: SpecialTokens,
    chat_template: str,
    model_max_length: int,
) -> None:
    """Write the tokenizer files into ``folder``."""
    tokenizer.save(str(folder / "tokenizer.json"))
    added: dict[str, Any] = {}
    for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items()):
        added[str(token_id)] = {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }
    config |= special.as_map()
    write_json(folder / "tokenizer_config.json", config)
    write_json(folder / "special_tokens_map.json", special.as_map())
