"""What the engine runs for a job: its prompt, its grammar, and how its output is read.

Chat jobs are rendered with the model's template, with the job's tools when it offers any
(natively or by the fallback prompt, :mod:`mlx_redis_worker.engine.tool_calls`); a job that
may call tools is constrained by the tool grammar; a reasoning model's output and a job's
calls are split by an :class:`OutputParser`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_redis_protocol.messages import PROMPT_PREFIX, SYSTEM_PREFIX, Job
from mlx_redis_worker.engine import ResponseFormat
from mlx_redis_worker.engine.output_parser import OutputParser
from mlx_redis_worker.engine.prompt import chat_prompt, chat_text, encode_prompt
from mlx_redis_worker.engine.tool_calls import (
    Markers,
    fallback_messages,
    template_tools,
    template_turns,
    tool_grammar,
    tool_syntax,
)

# How many of the prompt's last tokens are read back to see whether it opened a thought.
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True, slots=True)
class JobPrompt:
    prompt: str | list[int]
    prefix_boundary: int
    response_format: ResponseFormat | None
    # None: the output is passed on as it is (no reasoning, no tools).
    parser: OutputParser | None


def thought_markers(tokenizer: Any) -> tuple[str, str] | None:
    """The model's think markers: mlx-lm's, from the vocabulary, else ``<think>`` /
    ``</think>`` when its chat template uses them as text."""
    if getattr(tokenizer, "has_thinking", False):
        return str(tokenizer.think_start), str(tokenizer.think_end)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "<think>" in template and "</think>" in template:
        return "<think>", "</think>"
    return None


def job_prompt(job: Job, tokenizer: Any) -> JobPrompt:
    """``ValueError`` for what the model cannot do (no chat template, a response_format
    beside tools it may call)."""
    boundary = job.prefix_boundary if isinstance(job.prefix_boundary, int) else 0
    response_format = _response_format(job)
    if job.prompt is not None:
        if job.has_media():  # the engine puts the media before the text, or at its markers
            return JobPrompt(job.prompt, 0, response_format, None)
        if job.prefix_boundary == PROMPT_PREFIX:
            return _whole_prompt(encode_prompt(tokenizer, job.prompt), response_format, None)
        return JobPrompt(job.prompt, boundary, response_format, None)
    if job.prompt_token_ids is not None:
        if job.has_media():
            raise ValueError("a job with images or videos needs prompt or messages, not token ids")
        prompt = list(job.prompt_token_ids)
        if job.prefix_boundary == PROMPT_PREFIX:
            return _whole_prompt(prompt, response_format, None)
        return JobPrompt(prompt, boundary, response_format, None)
    calls = job.calls_tools()
    if calls and response_format is not None:
        raise ValueError("job.response_format cannot go with tools the model may call")
    syntax = tool_syntax(tokenizer)
    messages = job.chat_messages() or []
    tools = template_tools(job.tools or ()) if calls and syntax.native else None
    if not syntax.native and (calls or _has_tool_turns(messages)):
        messages = fallback_messages(messages, job.tools if calls else None)
    messages = template_turns(messages, syntax)
    system_prefix = job.prefix_boundary == SYSTEM_PREFIX
    thought = thought_markers(tokenizer)
    # mlx-lm turns thinking off for a model whose vocabulary has no think tokens; a
    # template that thinks in text keeps its own default.
    thinking = job.thinking if job.thinking is not None or thought is None else True
    text: str | None = None
    if job.has_media():
        # A vision-language model's engine takes the text with the template's image markup
        # (its processor expands it); the prefix cache keys its images by content instead.
        text = chat_text(tokenizer, messages, tools=tools, thinking=thinking)
        token_ids, system_end = encode_prompt(tokenizer, text), 0
    else:
        token_ids, system_end = chat_prompt(
            tokenizer, messages, system_prefix=system_prefix, tools=tools, thinking=thinking
        )
    thought_open = thought is not None and _opens_thought(tokenizer, token_ids, thought)
    if thought is not None and not thought_open and _closes_thought(tokenizer, token_ids, thought):
        thought = None  # thinking turned off: the template closed an empty thought
    if calls:
        assert job.tools is not None
        grammar = tool_grammar(
            syntax,
            job.tools,
            job.tool_choice,
            parallel=job.parallel_tool_calls is not False,
            markers=Markers.of(tokenizer),
            thought=thought,
            thought_open=thought_open,
        )
        response_format = ResponseFormat(type="grammar", lark=grammar, subject="tools")
    parser = None
    if calls or thought is not None:
        parser = OutputParser(
            syntax=syntax if calls else None, thought=thought, thought_open=thought_open
        )
    if text is not None:
        return JobPrompt(text, 0, response_format, parser)
    if job.prefix_boundary == PROMPT_PREFIX:
        return _whole_prompt(token_ids, response_format, parser)
    return JobPrompt(token_ids, system_end if system_prefix else boundary, response_format, parser)


def _whole_prompt(
    token_ids: list[int], response_format: ResponseFormat | None, parser: OutputParser | None
) -> JobPrompt:
    """``prefix_boundary: "prompt"``: all but the last token shared, so the entry a copy of
    the prompt finds holds all its prefill but the step that gives its first token."""
    return JobPrompt(token_ids, max(len(token_ids) - 1, 0), response_format, parser)


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(turn["role"] == "tool" or turn.get("tool_calls") for turn in messages)


def _tail(tokenizer: Any, token_ids: list[int]) -> str:
    return str(tokenizer.decode(token_ids[-_PROMPT_TAIL_TOKENS:])).rstrip()


def _opens_thought(tokenizer: Any, token_ids: list[int], thought: tuple[str, str]) -> bool:
    return _tail(tokenizer, token_ids).endswith(thought[0])


def _closes_thought(tokenizer: Any, token_ids: list[int], thought: tuple[str, str]) -> bool:
    return _tail(tokenizer, token_ids).endswith(thought[1])


def _response_format(job: Job) -> ResponseFormat | None:
    """The engine's form of the job's response_format (the decoder checked its shape; the
    engine checks that it can enforce it, or refuses the job)."""
    if job.response_format is None:
        return None
    # The decoder leaves ``type`` and that type's one field: ResponseFormat's own names.
    return ResponseFormat(**job.response_format)
