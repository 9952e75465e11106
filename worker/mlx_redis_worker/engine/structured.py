"""Structured output: a request's JSON schema, regex or Lark grammar, compiled for enforcing.

The grammar engine is llguidance (its choice, against xgrammar and outlines-core, is measured
in ops/grammar-engines/README.md). Compiling happens when a request is added, off the event
loop and off the engine thread (``compile_async``: one compile thread at the lowest priority),
so a format the engine cannot enforce is a ``ValueError`` before anything runs, never
unconstrained output: llguidance refuses the JSON-schema keywords it does not implement
(``uniqueItems``, ``not``, ``if``/``then``, ...) and unknown ``format`` values (it is not
lenient); keywords JSON Schema does not define at all are ignored, as the standard says.

What a format may cost is counted in llguidance's own units of work (``GrammarLimits``:
grammar symbols and lexer fuel to build it; Earley items and lexer fuel per token's mask;
lexer states), which a busy machine does not change: the same format gets the same verdict on
an idle and on a loaded engine. A format over one at compile (its first mask included) is
refused with a ``ValueError`` naming the limit and what the request sent (``response_format``
or ``tools``); one that goes over while it runs ends its request with ``GrammarLimitError``.
Wall-clock bounds (``max_grammar_compile_ms``, ``max_mask_us``) remain only as far outer
safety nets, for a machine stalled far beyond any load.

Compiling builds the format's matcher once (the expensive part: up to seconds for a large
schema) and computes its first mask, which builds the lexer states every copy shares; the
compiled grammar, matcher included, is cached by the hash of the format as given. Each request
gets a copy of that matcher (about 0.1 ms), so the engine thread never builds one; the copies
run in ``grammar_rows``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import mlx.core as mx
import numpy as np

from mlx_redis_worker.engine.config import GrammarLimits
from mlx_redis_worker.engine.request import ResponseFormat
from mlx_redis_worker.thread_priority import lower_this_thread

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions, LLParserLimits

# Compact JSON (one space after ':' and ','): flexible whitespace lets a small model wander
# into runs of blanks until max_tokens, which is output that does not parse.
_JSON_OPTIONS: Final[JsonCompileOptions] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_CACHED_GRAMMARS: Final = 256
_TIMES_KEPT: Final = 4096
# How often a request waiting for its compile looks at the clock.
_POLL_SECONDS: Final = 0.02
# llguidance's errors, by the words that name the limit a format went over.
_LIMIT_WORDS: Final = (
    ("Too many items", "max_mask_items"),
    ("too many expressions constructed", "max_mask_lexer_fuel"),
    ("too many states", "max_lexer_states"),
    ("initial_lexer_fuel", "max_grammar_lexer_fuel"),
    ("initial lexer configuration", "max_grammar_lexer_fuel"),
    ("fuel exhausted", "max_grammar_lexer_fuel"),
    ("grammar size", "max_grammar_symbols"),
)


class GrammarLimitError(ValueError):
    """A request's format went over one of ``GrammarLimits`` while it ran: the request's own
    fault (the worker's ``invalid_job``), not the engine's."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    key: str
    grammar: str
    compile_seconds: float
    # The grammar's matcher in its start state, never advanced: each request gets a copy.
    matcher: Any = field(default=None, compare=False, repr=False)
    # Its first token's mask on a copy, in microseconds (for stats: never a verdict).
    mask_us: float = 0.0


@dataclass(slots=True)
class GrammarStats:
    compiled: int = 0
    cache_hits: int = 0
    refused: int = 0
    # Matchers built from a grammar (one per compile) and copied from a compiled one (one per
    # constrained request): building is the expensive part, copying is not.
    matchers_built: int = 0
    matcher_copies: int = 0
    # Refusals by the limit they broke (GrammarLimits' field names), at compile or run time.
    over_limit: dict[str, int] = field(default_factory=dict)
    # Masks over max_mask_us while requests ran (engine thread).
    slow_masks: int = 0
    # Masks computed for several sequences in one call (grammar_rows.GrammarBatch), and the
    # sequences' masks they held.
    batched_calls: int = 0
    batched_masks: int = 0
    # The newest compiles' times: a daemon sent a new schema per request compiles without
    # end, and its stats must not grow with it.
    compile_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMES_KEPT))
    # Sampled tokens read from mlx-lm's token context, a device round trip each: only where
    # a sequence's own sampler failed.
    context_reads: int = 0

    def count_over(self, limit: str) -> None:
        self.over_limit[limit] = self.over_limit.get(limit, 0) + 1


def parser_limits(limits: GrammarLimits) -> LLParserLimits:
    """llguidance's limits for a matcher built under ``limits``."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        step_max_items=limits.max_mask_items,
        step_lexer_fuel=limits.max_mask_lexer_fuel,
        initial_lexer_fuel=limits.max_grammar_lexer_fuel,
        max_grammar_size=limits.max_grammar_symbols,
        max_lexer_states=limits.max_lexer_states,
        verbose_errors=False,  # an error names the limit, not the grammar's state
    )


def limit_named(error: str) -> str | None:
    """The ``GrammarLimits`` field an llguidance error is about (None: not a limit)."""
    return next((limit for words, limit in _LIMIT_WORDS if words in error), None)


def over_limit_message(subject: str, error: str, limits: GrammarLimits) -> str:
    """What a request is told when its format went over a limit (``error``: llguidance's)."""
    limit = limit_named(error)
    if limit is None:
        return f"{subject} cannot be enforced: {error}"
    return f"{subject} needs more than {limit} ({getattr(limits, limit)}) allows: {error}"


def _grammar_of(response_format: ResponseFormat) -> str:
    """The llguidance grammar (not yet checked: ``GrammarCompiler.compile`` does)."""
    from llguidance import LLMatcher

    if response_format.type == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if response_format.type == "json_schema":
        # Its text, not the dict: for a 112 KiB schema, 2 ms of which other threads wait
        # 0.8 for the GIL, against 8 ms and 4.6 converting the dict.
        return LLMatcher.grammar_from_json_schema(response_format.source(), overrides=_JSON_OPTIONS)
    if response_format.type == "regex":
        return LLMatcher.grammar_from_regex(response_format.pattern or "")
    return LLMatcher.grammar_from_lark(response_format.lark or "")


class GrammarCompiler:
    """Compiles response formats against one model's tokenizer (built on first use, ~1 s),
    keeping the last ``_CACHED_GRAMMARS`` compiled grammars by key. Thread-safe: requests are
    added from the event loop, compiled on the compile thread, copied on the engine thread."""

    def __init__(
        self, hf_tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None
    ) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._bit_table: mx.array | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.stats = GrammarStats()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size
                )
            return self._tokenizer

    async def compile_async(self, response_format: ResponseFormat) -> CompiledGrammar:
        """``compile`` on the compile thread, waiting at most ``max_grammar_compile_ms`` from the
        moment it starts (the tokenizer's one-time build and a wait behind another compile do
        not count). The work limits bound a compile long before that safety net: past it, a
        compile is refused here and goes on in the background to be cached."""
        started: list[float] = []

        def run() -> CompiledGrammar:
            self.tokenizer  # noqa: B018 - built before the clock starts
            started.append(time.monotonic())
            return self.compile(response_format)

        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        max_workers=1,
                        thread_name_prefix="mlxw-grammar",
                        initializer=lower_this_thread,  # before other tenants' steps
                    )
        limit_ms = self.limits.max_grammar_compile_ms
        limit = limit_ms / 1000
        job = self._pool.submit(run)
        waiting = asyncio.wrap_future(job)
        try:
            while not waiting.done():
                if started and time.monotonic() - started[0] > limit:
                    self._refuse_over("max_grammar_compile_ms")
                    raise ValueError(
                        f"{response_format.subject} took over max_grammar_compile_ms "
                        f"({limit_ms} ms) to compile"
                    )
                await asyncio.wait({waiting}, timeout=min(_POLL_SECONDS, limit))
            return waiting.result()
        finally:
            job.cancel()  # one still queued never runs: nobody waits for it any more
            # One left running (past its limit, or its caller cancelled) ends unobserved.
            waiting.add_done_callback(_observe)

    def compile(self, response_format: ResponseFormat) -> CompiledGrammar:
        """The checked grammar of ``response_format`` with its start-state matcher;
        ``ValueError`` naming why the engine cannot enforce it, or the limit it is over."""
        from llguidance import LLMatcher

        subject = response_format.subject
        size = _format_bytes(response_format)
        limit = self.limits.max_schema_bytes
        if size > limit:
            self._refuse_over("max_schema_bytes")
            raise ValueError(f"{subject} is {size} bytes, over max_schema_bytes ({limit})")
        key = response_format.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return cached
        tokenizer = self.tokenizer
        started = time.perf_counter()
        try:
            grammar = _grammar_of(response_format)
        except ValueError as exc:
            self._refuse()
            raise ValueError(f"{subject} cannot be enforced: {exc}") from exc
        # Builds and checks the grammar in one go (llguidance drops the GIL while it does).
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits(self.limits))
        with self._lock:
            self.stats.matchers_built += 1
        mask_us, first = 0.0, matcher
        if not matcher.is_error():
            mask_us, first = self._first_mask(matcher)
        messages = [first.get_error()] if first.is_error() else []
        messages += matcher.get_grammar_warnings()
        if messages:  # a warning is a constraint it would not enforce: refused
            error = "; ".join(messages)
            over = limit_named(error)
            if over is None:
                self._refuse()
            else:
                self._refuse_over(over)
            raise ValueError(over_limit_message(subject, error, self.limits))
        compiled = CompiledGrammar(
            key, grammar, time.perf_counter() - started, matcher=matcher, mask_us=mask_us
        )
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self.stats.compiled += 1
            self.stats.compile_seconds.append(compiled.compile_seconds)
        return compiled

    def _first_mask(self, matcher: Any) -> tuple[float, Any]:
        """The first token's mask on a copy, under the work limits, in microseconds, and the
        copy (in its error state when the mask went over one). It also builds the lexer states
        every copy shares, so requests do not build them on the engine thread."""
        bitmask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        copy = matcher.deep_copy()
        started = time.perf_counter()
        copy.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        return (time.perf_counter() - started) * 1e6, copy

    def forget(self, key: str) -> None:
        """Drop a cached grammar whose shared lexer went over a limit (it stays in its error
        state): the next request of that format compiles it afresh."""
        with self._lock:
            self._cache.pop(key, None)

    def _refuse(self) -> None:
        with self._lock:
            self.stats.refused += 1

    def _refuse_over(self, limit: str) -> None:
        with self._lock:
            self.stats.refused += 1
            self.stats.count_over(limit)

    def close(self) -> None:
        """Stop the compile thread once its compile (if any) ends; no new compile starts."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def bit_table(self) -> mx.array:
        """Row b: 0 for each bit set in byte b, -inf for each clear one (a 256 x 8 lookup that
        turns a bitmask into an additive mask with one gather)."""
        if self._bit_table is None:
            bits = (np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1
            self._bit_table = mx.array(np.where(bits == 1, 0.0, -np.inf).astype(np.float32))
        return self._bit_table


def _format_bytes(response_format: ResponseFormat) -> int:
    """The size of the format as given: its schema as compact JSON, or its pattern or Lark."""
    return len(response_format.source().encode())


def _observe(future: asyncio.Future[CompiledGrammar]) -> None:
    """Retrieve an abandoned compile's outcome, so asyncio does not log it as never read."""
    if not future.cancelled():
        future.exception()
