"""Structured output: a request's JSON schema, regex or Lark grammar, enforced token by token.

The grammar engine is llguidance (its choice, against xgrammar and outlines-core, is measured
in ops/grammar-engines/README.md). Compiling happens when a request is added, off the event
loop and off the engine thread (``compile_async``: one low-priority compile thread, a deadline),
so a format the engine cannot enforce is a ``ValueError`` before anything runs, never
unconstrained output: llguidance refuses the JSON-schema keywords it does not implement
(``uniqueItems``, ``not``, ``if``/``then``, ...) and unknown ``format`` values (it is not
lenient); keywords JSON Schema does not define at all are ignored, as the standard says. A
format over one of ``GrammarLimits`` (bytes, compile time, one token's mask time) is refused
the same way, naming the limit.

Compiling builds the format's matcher once (the expensive part: up to seconds for a large
schema) and computes its first mask, which builds the lexer states every copy shares; the
compiled grammar, matcher included, is cached by the hash of the format as given. Each request
gets a ``deep_copy`` of that matcher (about 0.1 ms), so the engine thread never builds one.

At run time each mask is timed: a sequence whose masks take over ``max_mask_us`` more than
``SLOW_MASKS_ALLOWED`` times is refused there (``GrammarLimitError``: its request ends with
an error the worker reports as ``invalid_job``), so a grammar that turns slow mid-output costs
the batch a few slow steps, not its whole length. llguidance's own fuel limits bound each mask.

Inside the batch each constrained sequence has its own ``GrammarProcessor`` (one of mlx-lm's
per-sequence logits processors): before each token it advances its matcher by the token just
sampled, asks llguidance for the bitmask of allowed next tokens and sets every other logit to
-inf. Unconstrained sequences in the same batch have no processor and are untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import mlx.core as mx
import numpy as np

from mlx_redis_worker.engine.config import GrammarLimits
from mlx_redis_worker.engine.request import ResponseFormat
from mlx_redis_worker.engine.sampling import Sampler

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON (one space after ':' and ','): flexible whitespace lets a small model wander
# into runs of blanks until max_tokens, which is output that does not parse.
_JSON_OPTIONS: Final[JsonCompileOptions] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_CACHED_GRAMMARS: Final = 256
_TIMES_KEPT: Final = 4096
# Tries of the mask probe, the fastest counted: one slow try on a busy machine is noise.
_MASK_PROBES: Final = 3
# How often a request waiting for its compile looks at the clock.
_POLL_SECONDS: Final = 0.02
# Compile threads run at this niceness (Linux: per thread), so on a machine short of cores
# the engine thread's decode steps come before another tenant's compile.
_COMPILE_NICENESS: Final = 10
# Masks over max_mask_us a sequence may take before it is refused: one slow mask on a busy
# machine is noise, a run of them is the grammar.
SLOW_MASKS_ALLOWED: Final = 3


class GrammarLimitError(ValueError):
    """A request's response_format went over one of ``GrammarLimits`` while it ran: the
    request's own fault (the worker's ``invalid_job``), not the engine's."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    key: str
    grammar: str
    compile_seconds: float
    # The grammar's matcher in its start state, never advanced: each request gets a copy.
    matcher: Any = field(default=None, compare=False, repr=False)
    # One token's mask on a fresh copy (the fastest of a few tries), in microseconds.
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
    # The newest compiles' times: a daemon sent a new schema per request compiles without
    # end, and its stats must not grow with it.
    compile_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=_TIMES_KEPT))
    # Sampled tokens read from mlx-lm's token context, a device round trip each: only where
    # a sequence's own sampler failed.
    context_reads: int = 0


def _grammar_of(response_format: ResponseFormat) -> str:
    """The llguidance grammar (not yet checked: ``GrammarCompiler.compile`` does)."""
    from llguidance import LLMatcher

    if response_format.type == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if response_format.type == "json_schema":
        schema = dict(response_format.schema or {})
        return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
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
        not count). A compile past the limit is refused here and goes on in the background to
        be cached: its cost is spent either way, and a repeat of the format is then a hit."""
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
                        initializer=_lower_priority,
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
                        f"response_format took over max_grammar_compile_ms ({limit_ms} ms) "
                        "to compile"
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

        size = _format_bytes(response_format)
        limit = self.limits.max_schema_bytes
        if size > limit:
            self._refuse_over("max_schema_bytes")
            raise ValueError(f"response_format is {size} bytes, over max_schema_bytes ({limit})")
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
            raise ValueError(f"response_format cannot be enforced: {exc}") from exc
        # Builds and checks the grammar in one go (llguidance drops the GIL while it does).
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        with self._lock:
            self.stats.matchers_built += 1
        messages = [matcher.get_error()] if matcher.is_error() else []
        messages += matcher.get_grammar_warnings()
        if messages:  # a warning is a constraint it would not enforce: refused
            self._refuse()
            raise ValueError(f"response_format cannot be enforced: {'; '.join(messages)}")
        mask_us = self._probe_mask_us(matcher)
        if mask_us > self.limits.max_mask_us:
            self._refuse_over("max_mask_us")
            raise ValueError(
                f"response_format needs {mask_us:.0f} us per token mask, over max_mask_us "
                f"({self.limits.max_mask_us})"
            )
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

    def _probe_mask_us(self, matcher: Any) -> float:
        """The first token's mask on fresh copies: the first try also builds the lexer states
        that every copy shares (so requests do not build them on the engine thread)."""
        bitmask = np.zeros((self.vocab_size + 31) // 32, dtype=np.int32)
        best = float("inf")
        for _ in range(_MASK_PROBES):
            copy = matcher.deep_copy()
            started = time.perf_counter()
            copy.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
            best = min(best, (time.perf_counter() - started) * 1e6)
        return best

    def _refuse(self) -> None:
        with self._lock:
            self.stats.refused += 1

    def _refuse_over(self, limit: str) -> None:
        with self._lock:
            self.stats.refused += 1
            self.stats.over_limit[limit] = self.stats.over_limit.get(limit, 0) + 1

    def processor(self, compiled: CompiledGrammar) -> GrammarProcessor:
        """A matcher for one sequence (engine thread: its MLX arrays belong to that thread)."""
        return GrammarProcessor(self, compiled)

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


class GrammarProcessor:
    """One constrained sequence's logits processor and its matcher (engine thread only)."""

    def __init__(self, compiler: GrammarCompiler, compiled: CompiledGrammar) -> None:
        self._matcher = compiled.matcher.deep_copy()
        compiler.stats.matcher_copies += 1  # engine thread only
        self._max_mask_seconds = compiler.limits.max_mask_us / 1e6
        self._slow_masks = 0
        # Called with the GrammarLimitError that refuses this sequence (its ``fail``).
        self.on_limit: Callable[[BaseException], None] | None = None
        self._bitmask = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
        self._table = compiler.bit_table()
        self._stats = compiler.stats
        self._started = False
        self._consumed = 0  # sampled tokens the matcher has advanced by
        self._sampled: mx.array | None = None  # what this sequence's sampler returned last

    def sampler(self, base: Sampler | None) -> Sampler:
        """This sequence's sampler (``base``, or greedy for None) keeping what it samples: the
        next mask needs that token, and the array the sampler returned is computed with the
        step, whereas the token context mlx-lm hands processors is a new array, one more
        kernel and device round trip per sequence and step to read."""

        def sample(logprobs: mx.array) -> mx.array:
            self._sampled = None  # should ``base`` fail, the next call reads the context
            sampled = base(logprobs) if base is not None else mx.argmax(logprobs, axis=-1)
            self._sampled = sampled
            return sampled

        return sample

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # The first call's last token is the prompt's; after that, the token just sampled.
        if self._started:
            last = self._sampled
            if last is None:
                self._stats.context_reads += 1
                last = tokens[-1]
            self._consume(int(last.item()))  # type: ignore[arg-type]
        self._started = True
        if self._matcher.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._matcher.get_error()}")
        started = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        seconds = time.perf_counter() - started
        if seconds > self._max_mask_seconds:
            self._on_slow_mask(seconds)
        # Each byte of the little-endian bitmask picks its 8 tokens' row of 0 / -inf.
        bias = self._table[mx.array(self._bitmask.view(np.uint8))].reshape(-1)
        return logits + bias[: logits.shape[-1]].astype(logits.dtype)

    def _on_slow_mask(self, seconds: float) -> None:
        """Count a mask over the limit; refuse the sequence at the limit's count. This token's
        mask still applies: the token it samples matches, and it is the last."""
        self._slow_masks += 1
        self._stats.slow_masks += 1
        if self._slow_masks <= SLOW_MASKS_ALLOWED or self.on_limit is None:
            return
        over = self._stats.over_limit
        over["max_mask_us"] = over.get("max_mask_us", 0) + 1
        limit_us = round(self._max_mask_seconds * 1e6)
        self.on_limit(
            GrammarLimitError(
                f"response_format's token masks took over max_mask_us ({limit_us}) "
                f"{self._slow_masks} times (the last {seconds * 1e6:.0f} us)"
            )
        )
        self.on_limit = None

    def matches(self, output_tokens: Sequence[int]) -> bool:
        """Whether ``output_tokens`` (the whole output, EOS left out) is a complete match. The
        matcher advances by a sampled token only when asked for the next mask, so the last
        token of an output that max_tokens cut is taken here."""
        for token in output_tokens[self._consumed :]:
            self._consume(token)
        return bool(self._matcher.is_accepting()) and not self._matcher.is_error()

    def _consume(self, token: int) -> None:
        self._matcher.consume_token(token)
        self._consumed += 1


def _format_bytes(response_format: ResponseFormat) -> int:
    """The size of the format as given: its schema as compact JSON, or its pattern or Lark."""
    if response_format.type == "json_schema":
        return len(json.dumps(response_format.schema, separators=(",", ":"), default=str).encode())
    return len((response_format.pattern or response_format.lark or "").encode())


def _observe(future: asyncio.Future[CompiledGrammar]) -> None:
    """Retrieve an abandoned compile's outcome, so asyncio does not log it as never read."""
    if not future.cancelled():
        future.exception()


def _lower_priority() -> None:
    """Compile threads yield the CPU to the engine thread. Linux only, where niceness is per
    thread and a thread id names the thread (elsewhere it could name another process)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICENESS)
