"""The typed messages of the protocol: jobs, stream events and control commands/replies.

These are plain values; `protocol.codec` turns them into msgpack maps and back (validating).
Lists are tuples so a message can't be changed after it was validated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, TypedDict

if TYPE_CHECKING:
    from mlx_redis_protocol.media_inputs import ImageLike, VideoLike

# Job fields that map 1:1 onto the engine's SamplingParams (same names, same meaning).
SAMPLING_FIELDS: Final = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
)

# `prefix_boundary: "system"`: the worker measures the leading system messages of a chat itself;
# `"prompt"`: all of the prompt but its last token (jobs of one prompt: the gateway's n > 1).
SYSTEM_PREFIX: Final = "system"
PROMPT_PREFIX: Final = "prompt"
PrefixBoundary = int | Literal["system", "prompt"]

FinishReason = Literal["stop", "length", "abort", "expired"]
FINISH_REASONS: Final[tuple[FinishReason, ...]] = ("stop", "length", "abort", "expired")

# The command kinds of this protocol version; a worker answers others with `unknown_command`.
CONTROL_KINDS: Final = (
    "abort",
    "stats",
    "cache_save",
    "cache_load",
    "cache_clear",
    "ping",
)


class JobOptions(TypedDict, total=False):
    """Optional job fields, as keyword arguments of `Client.submit` / `Client.generate`."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    stop: list[str] | tuple[str, ...]
    stop_token_ids: list[int] | tuple[int, ...]
    logprobs: int
    stream_interval: int
    prefix_boundary: PrefixBoundary
    deadline: float
    metadata: Mapping[str, Any]
    model: str
    response_format: Mapping[str, Any]
    tenant: str
    priority: int
    tools: list[Tool] | tuple[Tool, ...]
    # A ToolChoice, "auto" / "none" / "required", or {"name": FUNCTION}.
    tool_choice: ToolChoice | str | Mapping[str, str]
    parallel_tool_calls: bool
    thinking: bool
    speculative: Mapping[str, Any]
    # Bytes, paths or ImageInput; a video also as a list of frames (media_inputs).
    images: Sequence[ImageLike]
    videos: Sequence[VideoLike]


# An image's ``detail`` (OpenAI's): "low" shrinks it to fit LOW_DETAIL_SIDE pixels a side
# before the model sees it; "high" and "auto" leave its size to the model's processor.
ImageDetail = Literal["auto", "low", "high"]
IMAGE_DETAILS: Final[tuple[ImageDetail, ...]] = ("auto", "low", "high")
LOW_DETAIL_SIDE: Final = 512
# Frames sampled per second of a video file when its job names no rate.
DEFAULT_VIDEO_FPS: Final = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageInput:
    """One image of a job, from exactly one source: its file's bytes inline (``data``), a
    blob a producer stored in Redis (``blob``: the id of ``{prefix}:blob:{id}``), or an
    ``http(s)`` ``url`` (fetched only by workers whose operator allows its host)."""

    data: bytes | None = None
    blob: str | None = None
    url: str | None = None
    detail: ImageDetail | None = None

    @property
    def source(self) -> str:
        """Which source it has: "data", "blob" or "url"."""
        return "data" if self.data is not None else "blob" if self.blob is not None else "url"


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoInput:
    """One video of a job: a file (one source, as for an image) whose frames the worker
    samples at ``fps`` (at most ``max_frames`` of them), or the list of its ``frames``."""

    data: bytes | None = None
    blob: str | None = None
    url: str | None = None
    frames: tuple[ImageInput, ...] | None = None
    fps: float | None = None
    max_frames: int | None = None

    @property
    def source(self) -> str:
        """ "data", "blob", "url" or "frames"."""
        if self.frames is not None:
            return "frames"
        return "data" if self.data is not None else "blob" if self.blob is not None else "url"


@dataclass(frozen=True, slots=True)
class ContentPart:
    """A piece of a chat turn: text, or the place of the job's next image or video."""

    type: Literal["text", "image", "video"]
    text: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tool:
    """A function the model may call: its ``parameters`` are a JSON Schema (an object's)."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    # The producer's OpenAI-style flag; the worker enforces every call's arguments anyway.
    strict: bool | None = None


# ``tool_choice`` modes; "function" names the one function the model must call.
ToolChoiceMode = Literal["auto", "none", "required", "function"]
TOOL_CHOICE_MODES: Final[tuple[ToolChoiceMode, ...]] = ("auto", "none", "required")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the model may (auto), must not (none), must (required) call a tool, or must
    call the function ``name``."""

    mode: ToolChoiceMode
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made: ``arguments`` is the JSON text of its arguments (an object)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of the ``index``-th call of a request: its first piece carries ``id`` and
    ``name``; the ``arguments`` pieces joined are the call's arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat turn; the worker renders the list with the model's chat template.

    An assistant turn may hold the ``tool_calls`` it made; a ``tool`` turn answers the call
    ``tool_call_id`` (its ``name`` the function's)."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # A turn of text, image and video parts (``content`` is its text joined): the job's
    # images and videos take the places of its media parts, in order.
    parts: tuple[ContentPart, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """A generation request, or an embedding request. Exactly one of prompt /
    prompt_token_ids / messages / input is set (input: an embedding job).

    Sampling fields left at None mean "the engine's default".
    """

    request_id: str
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    logprobs: int | None = None
    stream_interval: int | None = None
    prefix_boundary: PrefixBoundary | None = None
    deadline: float | None = None
    metadata: Mapping[str, Any] | None = None
    # The fleet's name of the model to run it with; None: the fleet's default model.
    model: str | None = None
    # What the output must match: {"type": "json_object"} | {"type": "json_schema", "schema":
    # {...}} | {"type": "regex", "pattern": "..."} | {"type": "grammar", "lark": "..."}.
    response_format: Mapping[str, Any] | None = None
    # Who the job is run for: workers share each model's slots fairly between tenants. None:
    # the default tenant (``DEFAULT_TENANT``).
    tenant: str | None = None
    # Lower runs first, among one tenant's jobs (MIN_PRIORITY..MAX_PRIORITY); None: 0.
    priority: int | None = None
    # Functions the model may call, and how (None: "auto" when there are tools).
    tools: tuple[Tool, ...] | None = None
    tool_choice: ToolChoice | None = None
    # False: at most one call per answer (None: as many as the model makes).
    parallel_tool_calls: bool | None = None
    # False: a model that reasons asks its chat template to skip it (None: the model's
    # default).
    thinking: bool | None = None
    # Speculative decoding: {"method": "prompt_lookup" | "draft_model" | "off",
    # "num_draft_tokens": 1..16}; None: the worker's default.
    speculative: Mapping[str, Any] | None = None
    # An embedding job (instead of a prompt): the texts, or lists of token ids, to embed;
    # its vectors come in ``embedding`` events. ``dimensions``: shorter vectors, where the
    # model documents them (Matryoshka).
    input: tuple[str | tuple[int, ...], ...] | None = None
    dimensions: int | None = None
    # Images and videos the model sees (a vision-language model's job): placed where the
    # chat's media parts say, the rest in the last user turn.
    images: tuple[ImageInput, ...] | None = None
    videos: tuple[VideoInput, ...] | None = None

    def has_media(self) -> bool:
        """True when the job carries images or videos."""
        return bool(self.images) or bool(self.videos)

    def sampling_kwargs(self) -> dict[str, Any]:
        """The set sampling fields, ready for ``SamplingParams(**kwargs)`` (lists, not tuples)."""
        kwargs: dict[str, Any] = {}
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = list(value) if isinstance(value, tuple) else value
        return kwargs

    def chat_messages(self) -> list[dict[str, Any]] | None:
        """``messages`` in the shape chat templates take (OpenAI's, tool calls' arguments
        parsed), or None for a plain prompt."""
        if self.messages is None:
            return None
        return [chat_turn(m) for m in self.placed_messages()]

    def placed_messages(self) -> tuple[ChatMessage, ...]:
        """``messages`` with a place for each of the job's images and videos: those no media
        part places go at the start of the last user turn (images first), where a model's
        own prompt format puts a lone image."""
        messages = self.messages or ()
        unplaced = []
        for kind, media in (("image", self.images), ("video", self.videos)):
            places = sum(1 for m in messages for part in m.parts or () if part.type == kind)
            unplaced += [ContentPart(kind)] * (len(media or ()) - places)  # type: ignore[arg-type]
        users = [index for index, m in enumerate(messages) if m.role == "user"]
        if not unplaced or not users:
            return messages
        last = messages[users[-1]]
        text = (ContentPart("text", last.content),) if last.content else ()
        parts = last.parts if last.parts is not None else text
        placed = replace(last, parts=(*unplaced, *parts))
        return (*messages[: users[-1]], placed, *messages[users[-1] + 1 :])

    def calls_tools(self) -> bool:
        """True when the model is offered tools it may call (tools, and a choice not none)."""
        return bool(self.tools) and (self.tool_choice is None or self.tool_choice.mode != "none")

    def is_expired(self, now: float) -> bool:
        """True when the job has a deadline and ``now`` (epoch seconds) is past it."""
        return self.deadline is not None and now > self.deadline


def chat_turn(message: ChatMessage) -> dict[str, Any]:
    """One turn as chat templates take it: OpenAI's shape, arguments as a parsed object
    (what templates render with ``tojson``)."""
    content: Any = message.content
    if message.parts is not None:
        # The shape vision-language chat templates take: {"type": "image"} marks a place.
        content = [
            {"type": "text", "text": part.text} if part.type == "text" else {"type": part.type}
            for part in message.parts
        ]
    turn: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        turn["name"] = message.name
    return turn


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # the decoder checked it; a template still renders a string


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives, if asked for; each
    token's bytes where the worker sent them (``top_token_bytes`` in ``top_logprobs``' order):
    its text is those bytes as UTF-8, which a token that splits a character is only in part."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    token_bytes: bytes | None = None
    top_token_bytes: tuple[bytes, ...] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Counts and timings of a finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    ttft_ms: float | None = None
    tokens_per_second: float = 0.0
    duration_ms: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBase:
    """Fields every event carries. ``seq`` is per request, gapless across attempts."""

    request_id: str
    seq: int
    attempt: int

    type: ClassVar[str]
    terminal: ClassVar[bool] = False


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedEvent(EventBase):
    """Written by the producer (seq 0, attempt 0) before the job enters the queue."""

    type: ClassVar[str] = "queued"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaEvent(EventBase):
    """New text and tokens since the previous delta."""

    new_text: str
    new_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    # For a reasoning model: thinking text (not in ``new_text``); for a job with tools: the
    # pieces of the calls the model makes (their markup is not in ``new_text`` either).
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    type: ClassVar[str] = "delta"


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingEvent(EventBase):
    """Vectors of an embedding job: those of its inputs ``index``, ``index`` + 1, …; each
    little-endian float32 bytes, unit length."""

    index: int
    vectors: tuple[bytes, ...]

    type: ClassVar[str] = "embedding"


@dataclass(frozen=True, slots=True, kw_only=True)
class DoneEvent(EventBase):
    """The request finished; ``output_text`` is the whole text of the final attempt."""

    finish_reason: FinishReason
    output_text: str
    usage: Usage
    metadata: Mapping[str, Any] | None = None
    # For a job with a response_format: whether output_text matches it (False when cut short
    # by max_tokens or aborted); None for an unconstrained job.
    output_valid: bool | None = None
    # The whole reasoning text, and every complete call the model made (a job with tools).
    reasoning_text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()

    type: ClassVar[str] = "done"
    terminal: ClassVar[bool] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorEvent(EventBase):
    """The request failed; ``code`` is one of `mlx_redis_protocol.errors.ERROR_CODES`."""

    code: str
    message: str
    metadata: Mapping[str, Any] | None = None

    type: ClassVar[str] = "error"
    terminal: ClassVar[bool] = True


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetEvent(EventBase):
    """A redelivered job restarts as ``attempt``: drop the text received so far."""

    type: ClassVar[str] = "reset"


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(EventBase):
    """An event type this reader does not know (a newer protocol); skip it, keep its seq."""

    event_type: str
    fields: Mapping[str, Any]

    type: ClassVar[str] = "unknown"


Event = (
    QueuedEvent | DeltaEvent | EmbeddingEvent | DoneEvent | ErrorEvent | ResetEvent | UnknownEvent
)
TerminalEvent = DoneEvent | ErrorEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlCommand:
    """An operator command. Replies are RPUSHed to the list named by ``reply_to``."""

    kind: str
    id: str
    reply_to: str
    request_id: str | None = None
    name: str | None = None
    # Only workers serving this model act on the command (and answer it); None: every worker.
    model: str | None = None


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """Why a control command failed; ``code`` is one of `mlx_redis_protocol.errors.ERROR_CODES`."""

    code: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlReply:
    """One worker's answer to a control command."""

    id: str
    ok: bool
    worker_id: str
    result: Mapping[str, Any] | None = None
    error: ErrorInfo | None = None
