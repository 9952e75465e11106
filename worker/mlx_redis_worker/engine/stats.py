"""What the engine reports about itself: typed, frozen snapshots.

``EngineCore.stats()``, ``cache_stats()`` and ``memory_stats()`` return these; the reference
API's ``get_stats()`` / ``get_cache_stats()`` dicts are built from them (``as_dict``), so both
views always agree. No MLX at import: the daemon reads these on machines without it (a
simulated fleet's engine stand-in).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RequestProgress:
    """One open request (waiting or running)."""

    request_id: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    age_seconds: float


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """``healthy`` is False after a failed step (until one succeeds) or once the engine thread
    died; ``batch_failures`` counts batch steps that failed and were started over."""

    healthy: bool
    thread_alive: bool
    consecutive_failures: int
    batch_failures: int
    last_error: str | None
    fatal_error: str | None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The scheduler's counters since the engine was made."""

    num_waiting: int
    num_running: int
    num_requests_processed: int
    num_requests_failed: int
    total_prompt_tokens: int
    total_completion_tokens: int
    batch_failures: int
    # Wall time inside mlx-lm's BatchGenerator.next (model, sampling, waiting on the device).
    model_seconds: float
    speculation: SpeculationStats
    # A vision-language model's image work (None for a text model).
    vision: VisionStats | None = None
    # The prefill budget beside decode steps (None for an embedding model).
    prefill_pace: PrefillPaceStats | None = None


@dataclass(frozen=True, slots=True)
class PrefillPaceStats:
    """The current budget (tokens a step may prefill while sequences decode) and the measures
    it comes from (0.0 before the first measurement)."""

    budget_tokens: int
    decode_step_seconds: float
    prefill_tokens_per_second: float
    max_prefill_stall: float
    min_prefill_tokens: int
    # Steps that prefilled a burst's prompts with no decode beside them: every stream then
    # decoding had started in that burst (``PrefillPace.burst_budget``).
    burst_steps: int = 0


@dataclass(frozen=True, slots=True)
class VisionStats:
    """Image requests admitted and waiting for their vision encoding (each step encodes up to
    a prefill chunk's worth of image tokens), the requests, images and image tokens encoded
    since the engine was made, and the engine thread's seconds in the vision tower."""

    waiting_for_encoding: int
    requests_encoded: int
    images_encoded: int
    image_tokens_encoded: int
    encode_seconds: float


@dataclass(frozen=True, slots=True)
class SpeculationStats:
    """Speculative decoding since the engine was made: verify steps, the sequence rows in
    them that drafted, draft tokens fed and accepted, backoffs (a sequence pausing its drafts
    for low acceptance; a step drafting nothing because the batch was too large).
    ``acceptance_rate``: accepted / drafted; ``tokens_per_step``: tokens a drafting sequence
    got per verify step (1 + its accepted drafts, on average). ``prompt_lookup`` and
    ``draft_model``: the same figures of each method's rows alone (a verify step in which
    rows of both methods drafted counts as a step of each)."""

    steps: int
    rows: int
    draft_tokens: int
    accepted_tokens: int
    backoffs: int
    batch_backoffs: int
    acceptance_rate: float
    tokens_per_step: float
    prompt_lookup: MethodStats
    draft_model: MethodStats

    @classmethod
    def of(cls, counters: Any) -> SpeculationStats:
        """From the engine's live counters (any thread: plain ints, read as they stand)."""
        rows, drafted, accepted = counters.rows, counters.drafted, counters.accepted
        model_rows, model_drafted = counters.model_rows, counters.model_drafted
        model_accepted = counters.model_accepted
        return cls(
            steps=counters.steps,
            rows=rows,
            draft_tokens=drafted,
            accepted_tokens=accepted,
            backoffs=counters.backoffs,
            batch_backoffs=counters.batch_backoffs,
            acceptance_rate=_acceptance_rate(drafted, accepted),
            tokens_per_step=_tokens_per_step(rows, accepted),
            # The counters keep the totals and the draft model's part; the rest is lookup's.
            prompt_lookup=MethodStats.of(
                counters.lookup_steps,
                rows - model_rows,
                drafted - model_drafted,
                accepted - model_accepted,
            ),
            draft_model=MethodStats.of(
                counters.model_steps, model_rows, model_drafted, model_accepted
            ),
        )

    def methods(self) -> dict[str, MethodStats]:
        """Each method's figures by its name (``SpeculativeParams.method``)."""
        return {"prompt_lookup": self.prompt_lookup, "draft_model": self.draft_model}


@dataclass(frozen=True, slots=True)
class MethodStats:
    """The speculation figures of one drafting method's rows: the verify steps in which one
    of its rows drafted, those rows, their drafts and accepted drafts, and the rates."""

    steps: int
    rows: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    tokens_per_step: float

    @classmethod
    def of(cls, steps: int, rows: int, drafted: int, accepted: int) -> MethodStats:
        return cls(
            steps=steps,
            rows=rows,
            draft_tokens=drafted,
            accepted_tokens=accepted,
            acceptance_rate=_acceptance_rate(drafted, accepted),
            tokens_per_step=_tokens_per_step(rows, accepted),
        )


def _acceptance_rate(drafted: int, accepted: int) -> float:
    return accepted / drafted if drafted else 0.0


def _tokens_per_step(rows: int, accepted: int) -> float:
    # Each drafting row emits its pending token plus the drafts it accepted.
    return (rows + accepted) / rows if rows else 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    engine_id: str
    model_name: str
    running: bool
    uptime_seconds: float
    steps_executed: int
    engine_thread_cpu_seconds: float
    # Of step_seconds, scheduler.model_seconds went to mlx-lm's BatchGenerator; the rest is
    # the engine's own per-step and per-token host work.
    step_seconds: float
    active_requests: int
    stream_interval: int
    requests: tuple[RequestProgress, ...]
    health: EngineHealth
    scheduler: SchedulerStats

    def as_dict(self) -> dict[str, Any]:
        """The reference API's flat dict: the scheduler's counters beside the engine's."""
        view: dict[str, Any] = plain(self)
        scheduler = view.pop("scheduler")
        view["requests"] = list(view["requests"])
        return {**view, **scheduler}


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    enabled: bool
    entries: int
    memory_bytes: int
    max_entries: int
    max_bytes: int
    hits: int
    misses: int
    hit_rate: float
    tokens_saved: int
    evictions: int
    stores: int

    def as_dict(self) -> dict[str, Any]:
        view: dict[str, Any] = plain(self)
        return view


@dataclass(frozen=True, slots=True)
class MlxMemory:
    """MLX's allocator figures, in bytes: arrays alive, the buffer cache, the peak so far."""

    active_bytes: int
    cache_bytes: int
    peak_bytes: int


def read_mlx_memory() -> MlxMemory:
    """Engine thread: the one thread that touches MLX."""
    import mlx.core as mx

    return MlxMemory(
        active_bytes=int(mx.get_active_memory()),
        cache_bytes=int(mx.get_cache_memory()),
        peak_bytes=int(mx.get_peak_memory()),
    )


def plain(snapshot: Any) -> Any:
    """``dataclasses.asdict`` for stats snapshots, without its deep copy: dataclasses become
    dicts and every list, tuple and dict is made anew (so nothing the engine still changes is
    shared), the scalars in them are not copied. A worker's stats reply builds several such
    views; asdict's deep copy of every number was most of its cost."""
    kind = type(snapshot)
    if kind in _SCALARS:
        return snapshot
    if is_dataclass(snapshot) and not isinstance(snapshot, type):
        return {name: plain(getattr(snapshot, name)) for name in _field_names(kind)}
    if kind is list or kind is tuple:
        return kind(plain(item) for item in snapshot)
    if isinstance(snapshot, dict):
        return {key: plain(value) for key, value in snapshot.items()}
    return snapshot


_SCALARS = frozenset({int, float, str, bool, type(None)})


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(kind: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(field.name for field in fields(kind))
    return names
