"""Requests, their sampling parameters and the outputs streamed back to callers."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

from mlx_redis_protocol.codec_job import MAX_DRAFT_TOKENS

if TYPE_CHECKING:
    from mlx_redis_worker.engine.vision import VisionPrompt

# (generated token ids so far as an mx.array, logits) -> logits; runs on the engine thread.
LogitsProcessor = Callable[[Any, Any], Any]


FormatType = Literal["json_object", "json_schema", "regex", "grammar"]
FORMAT_TYPES: Final[tuple[FormatType, ...]] = ("json_object", "json_schema", "regex", "grammar")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What a request's output must match: ``json_object`` (any JSON object),
    ``json_schema`` (``schema``), ``regex`` (``pattern``, the whole output) or ``grammar``
    (``lark``, a Lark grammar in llguidance's dialect)."""

    type: FormatType
    schema: Mapping[str, Any] | None = None
    pattern: str | None = None
    lark: str | None = None
    # What the request sent that this format enforces, as its errors name it: its
    # ``response_format``, or its ``tools`` (the grammar of their calls). Not in ``key``.
    subject: str = "response_format"
    # ``source()``, made once: a new 112 KiB schema was dumped to JSON three times (its key,
    # its size, llguidance's parse of the dict), holding the GIL for ~6 ms of every compile
    # while other tenants' steps waited for it.
    _source: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        needs = {"json_schema": "schema", "regex": "pattern", "grammar": "lark"}
        if self.type not in FORMAT_TYPES:
            raise ValueError(f"response_format type must be one of {FORMAT_TYPES}")
        wanted = needs.get(self.type)
        for name in ("schema", "pattern", "lark"):
            given = getattr(self, name) is not None
            if given != (name == wanted):
                rule = "needs" if name == wanted else "does not take"
                raise ValueError(f"response_format {self.type!r} {rule} {name!r}")

    def source(self) -> str:
        """The format as given: its schema as compact JSON (keys in the schema's order), its
        pattern or its Lark grammar; empty for ``json_object``."""
        if self._source is None:
            if self.type == "json_schema":
                text = json.dumps(self.schema, separators=(",", ":"), default=str)
            else:
                text = self.pattern or self.lark or ""
            object.__setattr__(self, "_source", text)  # frozen: a cache, not a field
            return text
        return self._source

    def key(self) -> str:
        """The hash of the format as given: its compiled grammar's cache key. Key order counts:
        llguidance emits an object's properties in the schema's order, so the same schema
        with its properties in another order is another grammar (sorting the keys here would
        hand a request the order of whichever variant was compiled first)."""
        return hashlib.sha256(f"{self.type}\n{self.source()}".encode()).hexdigest()


SpeculativeMethod = Literal["prompt_lookup", "draft_model"]
SPECULATIVE_METHODS: Final[tuple[SpeculativeMethod, ...]] = ("prompt_lookup", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """Speculative decoding for one request: ``method`` drafts up to ``num_draft_tokens``
    tokens per step (``prompt_lookup``: from n-gram matches against the prompt and the output
    so far; ``draft_model``: from the engine's draft model, ``EngineConfig.draft``) and the
    model checks them all in one forward pass. The output is the one the
    request would get without it: greedy token for token, sampled in distribution."""

    method: SpeculativeMethod = "prompt_lookup"
    num_draft_tokens: int = 4

    MAX_DRAFT_TOKENS: ClassVar[int] = MAX_DRAFT_TOKENS

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}")
        if (
            not isinstance(self.num_draft_tokens, int)
            or isinstance(self.num_draft_tokens, bool)
            or not 1 <= self.num_draft_tokens <= self.MAX_DRAFT_TOKENS
        ):
            raise ValueError(
                f"speculative num_draft_tokens must be an integer in [1, {self.MAX_DRAFT_TOKENS}]"
            )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.name.startswith("FINISHED")

    @classmethod
    def for_finish_reason(cls, reason: str) -> RequestStatus:
        return {
            "stop": cls.FINISHED_STOPPED,
            "length": cls.FINISHED_LENGTH,
            "error": cls.FINISHED_ERROR,
        }.get(reason, cls.FINISHED_ABORTED)


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling, honoured per sequence inside a shared batch.

    ``temperature == 0`` is greedy. ``seed`` makes sampling reproducible (same seed and prompt,
    same text). ``stop`` strings end generation and never appear in the text; ``stop_token_ids``
    end it too (in addition to the model's EOS) and are not part of the output. ``logprobs``:
    None for none, 0 for the sampled token's logprob, k > 0 to add the top-k alternatives.
    ``logits_processors`` are extra in-process callables (not part of the wire protocol); one
    that raises fails only its own request.
    """

    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context_size: int = 20
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    logits_processors: list[LogitsProcessor] | None = None
    # The output must match it (JSON schema, regex, Lark grammar), enforced token by token.
    response_format: ResponseFormat | None = None
    # Draft and verify several tokens per step; same output (engine/speculative_batch.py).
    speculative: SpeculativeParams | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise bad("top_p", "must be in [0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        if not isinstance(self.penalty_context_size, int) or self.penalty_context_size < 1:
            raise bad("penalty_context_size", "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer or None")
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise bad("stop", "must be a list of non-empty strings")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
        ):
            raise bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be None or an integer in [0, {self.MAX_LOGPROBS}]")
        if self.logits_processors is not None and not all(
            callable(p) for p in self.logits_processors
        ):
            raise bad("logits_processors", "must be a list of callables")
        if self.response_format is not None and not isinstance(
            self.response_format, ResponseFormat
        ):
            raise bad("response_format", "must be a ResponseFormat or None")
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeParams):
            raise bad("speculative", "must be a SpeculativeParams or None")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class TokenLogprob:
    """The sampled token's log-probability and, when asked for, the top alternatives; with
    each token's bytes (``token_bytes``, and ``top_token_bytes`` in ``top_logprobs``' order)
    where the engine knows its tokenizer."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    token_bytes: bytes | None = None
    top_token_bytes: list[bytes] | None = None


@dataclass(slots=True)
class Transcript:
    """A request's generated tokens and text pieces, append-only.

    Every output of the request shares it and reads the prefix that existed when it was made,
    so making an output costs the same at token 4,000 as at token 4 (no cumulative copies).
    Appended to by the engine thread only; a prefix never changes once written.
    """

    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """One streamed update for a request.

    ``new_text``/``new_token_ids``/``logprobs`` are the delta since the previous output;
    ``output_text``/``output_token_ids`` are cumulative, built on access from the request's
    transcript (fresh copies, safe to keep). ``ttft`` is seconds from arrival to the first
    token; ``tokens_per_second`` is the decode rate so far. ``error`` carries the message when
    ``finish_reason == "error"``.
    """

    request_id: str
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    tokens_per_second: float = 0.0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    # With ``error``: the request itself is at fault (its response_format went over a limit
    # while it ran), not the engine.
    request_fault: bool = False
    # For a request with a response_format, once finished: whether the output matches it
    # (False when max_tokens cut it short of a match); None otherwise.
    output_valid: bool | None = None
    # Once finished by a stop string: that string (vLLM's name); None otherwise.
    stop_reason: str | None = None
    # From an embedding engine: the vectors this output carries (little-endian float32
    # bytes, unit length), those of the request's inputs ``embedding_index`` onwards.
    embeddings: list[bytes] | None = field(default=None, repr=False)
    embedding_index: int = 0
    transcript: Transcript | None = field(default=None, repr=False, compare=False)
    text_parts: int = field(default=0, repr=False, compare=False)

    @property
    def output_token_ids(self) -> list[int]:
        if self.transcript is None:
            return []
        return self.transcript.token_ids[: self.completion_tokens]

    @property
    def output_text(self) -> str:
        if self.transcript is None:
            return ""
        return "".join(self.transcript.text_parts[: self.text_parts])

    def merged_after(self, earlier: RequestOutput) -> RequestOutput:
        """This output with the deltas of an earlier, undelivered one prepended."""
        self.new_text = earlier.new_text + self.new_text
        self.new_token_ids = earlier.new_token_ids + self.new_token_ids
        if earlier.logprobs is not None or self.logprobs is not None:
            self.logprobs = (earlier.logprobs or []) + (self.logprobs or [])
        if earlier.embeddings is not None:
            self.embeddings = earlier.embeddings + (self.embeddings or [])
            self.embedding_index = earlier.embedding_index
        return self


@dataclass(eq=False)
class Request:
    """A request and its progress. Mutated only by the engine thread once submitted.

    The first ``prefix_boundary`` prompt tokens are a prefix that many requests share (a
    system prompt): the prefix cache keeps their KV state as one entry of its own.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prefix_boundary: int = 0
    stream_interval: int = 1
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    first_token_time: float | None = None
    transcript: Transcript = field(default_factory=Transcript)
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    # The compiled response_format (mlx_redis_worker.engine.structured.CompiledGrammar), if any.
    grammar: Any = None
    # The processed images of a request that has some: its prompt_token_ids hold their image
    # tokens, and its prefix-cache key their content.
    vision: VisionPrompt | None = None

    @property
    def cache_key(self) -> list[int]:
        """The prompt as the prefix cache knows it: image tokens stand for their images."""
        return self.vision.cache_key if self.vision is not None else self.prompt_token_ids

    def cache_key_of(self, tokens: list[int]) -> list[int]:
        """``tokens`` (a prefix of the prompt, or the prompt and output) as the prefix cache
        knows them."""
        if self.vision is None:
            return tokens
        prompt = len(self.prompt_token_ids)
        return self.vision.cache_key[: min(len(tokens), prompt)] + tokens[prompt:]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.transcript.token_ids

    @property
    def output_text(self) -> str:
        return "".join(self.transcript.text_parts)

    @property
    def num_output_tokens(self) -> int:
        return len(self.transcript.token_ids)
