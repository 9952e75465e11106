"""Prompts to token ids: text, token ids and chat messages, one rule for every caller.

The engine tokenizes and checks a request's prompt here, in the caller, so bad input is a
``ValueError`` to whoever sent it. ``chat_prompt`` renders chat messages with the model's
template and finds where the leading system turns end (the shared prefix many requests reuse);
a vision model's template renders a message's image parts as its image placeholder, and a
video part becomes the video marker (``engine/vision.py`` puts the frames there).
Nothing here knows of Redis or of the wire format.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any

# Where a video's frames go in a text prompt (engine/vision.py: each frame becomes one image
# placeholder).
VIDEO_PLACEHOLDER = "<video>"

NO_CHAT_TEMPLATE = (
    "job.messages: the model has no chat template; send a `prompt` instead "
    "(mlx-worker submit --raw)"
)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text``; the tokenizer's special prefix (BOS) is added unless the text
    already starts with it (a rendered chat template usually does)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


def prompt_token_ids(
    tokenizer: Any, prompt: str | list[int], *, vocab_size: int, max_tokens: int
) -> list[int]:
    """The token ids of a request's ``prompt`` (text, or token ids checked against the
    vocabulary); ``ValueError`` for a prompt of another type, an empty one, or one over
    ``max_tokens``."""
    if isinstance(prompt, str):
        token_ids = encode_prompt(tokenizer, prompt)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        token_ids = list(prompt)
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    else:
        raise ValueError("prompt must be a string or a list of integer token ids")
    if not token_ids:
        raise ValueError("prompt is empty")
    if len(token_ids) > max_tokens:
        raise ValueError(f"prompt has {len(token_ids)} tokens, over the limit of {max_tokens}")
    return token_ids


def has_chat_template(tokenizer: Any) -> bool:
    """mlx-lm's TokenizerWrapper says so itself (a template in tokenizer_config.json, one that
    mlx-lm supplies, or a tokenizer with its own renderer); a bare Hugging Face tokenizer has
    one when its ``chat_template`` is set."""
    known = getattr(tokenizer, "has_chat_template", None)
    if isinstance(known, bool):
        return known
    return getattr(tokenizer, "chat_template", None) is not None


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    system_prefix: bool,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
) -> tuple[list[int], int]:
    """The token ids of ``messages`` rendered with the model's chat template (generation
    prompt included), and the shared-prefix boundary: where the leading system turns end in
    those tokens when ``system_prefix``, else 0. ``tools`` (OpenAI's shape) go to the
    template; ``thinking`` False asks a reasoning model's template to skip the thought
    (``enable_thinking``), None leaves the template's default.

    ``ValueError`` when the model has no chat template: transformers' own error (or, in older
    versions, a default template the model never saw) would leave the sender guessing what to
    send instead.
    """
    extra = _template_options(tools, thinking)
    token_ids = encode_prompt(
        tokenizer, chat_text(tokenizer, messages, tools=tools, thinking=thinking)
    )
    if not system_prefix:
        return token_ids, 0
    # The common prefix of the whole chat and its system turns rendered alone: exact even when
    # the template renders a lone system turn a little differently.
    system = list(takewhile(lambda m: m["role"] == "system", messages))
    system_ids = encode_prompt(
        tokenizer, _render(tokenizer, system, generation_prompt=False, **extra)
    )
    return token_ids, shared_prefix_length(system_ids, token_ids)


def _video_parts_as_markers(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content parts include a video (``{"type": "video"}``) with each such
    part as the text ``<video>``: the engine puts the video's frames there (engine/vision.py);
    chat templates render image parts but seldom video ones."""
    content = message.get("content")
    if not isinstance(content, list) or not any(_is_video(part) for part in content):
        return message
    parts = [
        {"type": "text", "text": VIDEO_PLACEHOLDER} if _is_video(part) else part for part in content
    ]
    return {**message, "content": parts}


def _is_video(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "video"


def chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool | None = None,
) -> str:
    """``messages`` rendered with the model's chat template as text, generation prompt
    included (a vision-language model's turns may hold ``{"type": "image"}`` parts: its
    template writes its own image markup, which the engine's processor expands; a
    ``{"type": "video"}`` part becomes the video marker, where the engine puts its frames)."""
    if not has_chat_template(tokenizer):
        raise ValueError(NO_CHAT_TEMPLATE)
    extra = _template_options(tools, thinking)
    messages = [_video_parts_as_markers(message) for message in messages]
    return _render(tokenizer, messages, generation_prompt=True, **extra)


def _template_options(tools: list[dict[str, Any]] | None, thinking: bool | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if tools is not None:
        extra["tools"] = tools
    if thinking is not None:
        extra["enable_thinking"] = thinking
    return extra


def shared_prefix_length(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], *, generation_prompt: bool, **extra: Any
) -> str:
    from jinja2 import TemplateError  # the chat templates' engine, with the tokenizer's stack

    try:
        rendered: str = tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
        )
    except TemplateError as exc:
        # The template's own refusal (``raise_exception``: roles out of turn, more calls in a
        # turn than the model takes): the sender's to fix, as any other bad chat.
        raise ValueError(f"job.messages: the model's chat template refused them: {exc}") from exc
    return rendered


def model_vocab_size(model: Any, tokenizer: Any) -> int:
    """The model's vocabulary (its logits' width; may exceed the tokenizer's, padded)."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return len(tokenizer.get_vocab())
