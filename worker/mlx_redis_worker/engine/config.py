"""Engine and scheduler configuration: one frozen-by-convention dataclass each, checked on build."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from mlx_redis_worker.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one request's format (its response_format, or the grammar of its tools' calls) may
    cost; over any, the request is refused with a ``ValueError`` naming the limit (the
    worker's ``invalid_job``), or ends with ``GrammarLimitError`` when it goes over while it
    runs. The names are the worker's settings of the same name.

    Counted in llguidance's units of work, which a busy machine does not change (the figures
    in brackets: this project's 2-core CPU at idle, from llguidance's own rates):
    ``max_schema_bytes``, the format as given (its schema as compact JSON, its pattern, its
    Lark text); ``max_grammar_symbols``, the grammar's size; ``max_grammar_lexer_fuel``,
    building its lexer (~20 ms); ``max_mask_items``, the Earley items of one token's mask
    (~2.5 ms); ``max_mask_lexer_fuel``, the lexer work of one token's mask (~14 ms);
    ``max_lexer_states``, the lexer states one grammar may build (its memory: 1-2 kB each).

    Far outer safety nets, in wall-clock time, for a machine stalled far beyond any load:
    ``max_grammar_compile_ms`` (compiling, off the engine thread: a compile past it is
    refused, finishes in the background and is cached) and ``max_mask_us`` (one token's mask:
    a sequence over it more than a few times is refused).
    """

    max_schema_bytes: int = 128 * 1024
    max_grammar_symbols: int = 500_000
    max_grammar_lexer_fuel: int = 1_000_000
    max_mask_items: int = 50_000
    max_mask_lexer_fuel: int = 200_000
    max_lexer_states: int = 50_000
    max_grammar_compile_ms: int = 30_000
    max_mask_us: int = 250_000

    def __post_init__(self) -> None:
        for limit in fields(self):
            name, value = limit.name, getattr(self, limit.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GrammarLimits.{name} must be an integer >= 1, got {value!r}")


# GrammarLimits' fields, in order (the worker's settings of the same names).
GRAMMAR_LIMITS = tuple(limit.name for limit in fields(GrammarLimits))


# How many measured decode steps one step's prefill may take beside decoding streams.
DEFAULT_MAX_PREFILL_STALL = 0.2


@dataclass(slots=True)
class SchedulerConfig:
    """How the scheduler batches work over mlx-lm's BatchGenerator.

    ``max_num_seqs`` is the decode batch (sequences generating at once); requests beyond it wait
    in a queue capped at ``max_waiting_requests`` (a full queue is a clear error to the caller,
    never unbounded memory). Waiting requests are prefilled in groups of ``prefill_batch_size``,
    in chunks of ``prefill_step_size`` tokens, shortest prompt first; one that has waited
    ``max_prefill_wait`` seconds goes before any shorter one (oldest first), so none starves.
    A request's first token leaves in the step its prefill ends.

    Stall-free: while sequences are decoding, every step decodes them and does a bounded amount
    of prefill beside it, so no prompt freezes running streams. The bound is time: a step's
    prefill may take about ``max_prefill_stall`` times the measured decode step (prefill speed
    and decode step time are measured as the engine runs), turned into a token budget of at
    least ``min_prefill_tokens`` (long prompts always progress) and at most
    ``prefill_step_size``, given first to the prompts with the fewest tokens left. With nothing
    decoding, a pass prefills what the measured speed does in ``max_prefill_pass`` seconds (at
    most a whole chunk; 0: a whole chunk), so a request arriving meanwhile (another tenant's
    chat beside a long prompt) waits at most about that long for its own prefill; where one
    pass ends every short prompt in prefill (each row's chunk at most ``prefill_step_size``,
    as mlx-lm's) within ``max_prefill_wait``, it takes that pass, and a burst's streams start
    and finish together (``Scheduler._whole_pass``). Prompts of
    more than ``prefill_step_size`` tokens to prefill and shorter ones prefill in lanes of
    their own, each of ``prefill_batch_size`` rows (``PromptLane``). A larger stall gives
    prompts arriving
    beside running streams their first tokens sooner; ``inf`` prefills a whole chunk each step.
    The bound protects a stream from work that came after it: while every decoding stream queued
    together with the prompts in prefill (one burst), a step may skip its decode and prefill
    what fits in ``max_prefill_wait`` from those streams' last tokens, when that ends a prompt
    (``Scheduler._burst_slack``).
    A request over ``max_prompt_tokens`` or asking
    for more than ``max_logprobs`` top log-probabilities per token is refused (``ValueError``),
    and so is a response_format over one of ``grammar_limits``.
    """

    max_num_seqs: int = 32
    prefill_batch_size: int = 4
    prefill_step_size: int = 2048
    max_waiting_requests: int = 1024
    max_prefill_wait: float = 1.0
    max_prefill_stall: float = DEFAULT_MAX_PREFILL_STALL
    max_prefill_pass: float = 0.1
    min_prefill_tokens: int = 32
    max_prompt_tokens: int = 32768
    max_logprobs: int = SamplingParams.MAX_LOGPROBS
    max_kv_size: int | None = None
    enable_prefix_cache: bool = True
    prefix_cache_max_entries: int = 64
    prefix_cache_max_bytes: int = 2 << 30
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    # Speculative decoding drafts only while the decode batch has at most this many sequences
    # (a larger batch is compute-bound: verifying drafts would cost more than it gains).
    speculative_max_batch: int = 8

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "prefill_batch_size",
            "prefill_step_size",
            "max_prompt_tokens",
            "prefix_cache_max_entries",
            "prefix_cache_max_bytes",
            "speculative_max_batch",
            "min_prefill_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests < 0:
            raise ValueError("SchedulerConfig.max_waiting_requests must be >= 0")
        if not self.max_prefill_wait >= 0:  # NaN too
            raise ValueError("SchedulerConfig.max_prefill_wait must be >= 0")
        if not 0 <= self.max_prefill_pass < math.inf:  # NaN too; 0: whole chunks
            raise ValueError("SchedulerConfig.max_prefill_pass must be >= 0 and finite")
        if not self.max_prefill_stall >= 0:  # NaN too; inf: whole chunks
            raise ValueError("SchedulerConfig.max_prefill_stall must be >= 0 (inf allowed)")
        if not 0 <= self.max_logprobs <= SamplingParams.MAX_LOGPROBS:
            raise ValueError(
                f"SchedulerConfig.max_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}]"
            )
        if self.max_kv_size is not None and self.max_kv_size < 1:
            raise ValueError("SchedulerConfig.max_kv_size must be >= 1 or None")


@dataclass(frozen=True, slots=True)
class DraftModel:
    """A small model of the target's tokenizer that drafts for ``SpeculativeParams(method=
    "draft_model")`` requests (loaded like the target, ``mlx_redis_worker.models.load_model``;
    ``name`` is what the operator gave, for messages and stats)."""

    name: str
    model: Any
    tokenizer: Any


@dataclass(slots=True)
class EngineConfig:
    """Configuration for the engine (names and defaults match the reference API).

    ``step_interval`` is accepted (>= 0) for the reference API and has no effect: the
    reference polls for work every ``step_interval`` seconds, while this engine's idle thread
    blocks until a request, command or stop arrives, and steps back to back while there is
    work. ``stream_interval`` coalesces that many tokens per streamed output (no token is
    lost); ``gpu_memory_utilization`` is the share of device memory above which the engine
    thread frees MLX's buffer cache. ``draft``: the draft model for requests that speculate
    with ``draft_model`` (none: such a request is refused with a ``ValueError``); the engine
    refuses one whose vocabulary differs from the target's.
    """

    model_name: str = ""
    scheduler_config: SchedulerConfig | None = None
    step_interval: float = 0.001
    stream_interval: int = 1
    gpu_memory_utilization: float = 0.9
    draft: DraftModel | None = None

    def __post_init__(self) -> None:
        if self.step_interval < 0:
            raise ValueError("EngineConfig.step_interval must be >= 0")
        if self.stream_interval < 1:
            raise ValueError("EngineConfig.stream_interval must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("EngineConfig.gpu_memory_utilization must be in (0, 1]")
