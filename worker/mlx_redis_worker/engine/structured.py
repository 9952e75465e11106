"""Structured output: a request's JSON schema, regex or Lark grammar, enforced token by token.

The grammar engine is llguidance (its choice, against xgrammar and outlines-core, is measured
in ops/grammar-engines/README.md). Compiling happens when a request is added, on the caller's
thread, so a format the engine cannot enforce is a ``ValueError`` before anything runs, never
unconstrained output: llguidance refuses the JSON-schema keywords it does not implement
(``uniqueItems``, ``not``, ``if``/``then``, ...) and unknown ``format`` values (it is not
lenient); keywords JSON Schema does not define at all are ignored, as the standard says.
Compiled grammars are cached by the hash of the format as given.

Inside the batch each constrained sequence has its own ``GrammarProcessor`` (one of mlx-lm's
per-sequence logits processors): before each token it advances its matcher by the token just
sampled, asks llguidance for the bitmask of allowed next tokens and sets every other logit to
-inf. Unconstrained sequences in the same batch have no processor and are untouched.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import mlx.core as mx
import numpy as np

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


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    key: str
    grammar: str
    compile_seconds: float


@dataclass(slots=True)
class GrammarStats:
    compiled: int = 0
    cache_hits: int = 0
    refused: int = 0
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
    added from the event loop, matchers made on the engine thread."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._bit_table: mx.array | None = None
        self._lock = threading.Lock()
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

    def compile(self, response_format: ResponseFormat) -> CompiledGrammar:
        """The checked grammar of ``response_format``; ``ValueError`` naming why the engine
        cannot enforce it."""
        from llguidance import LLMatcher

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
            self.stats.refused += 1
            raise ValueError(f"response_format cannot be enforced: {exc}") from exc
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:  # a warning is a constraint it would not enforce: refused
            self.stats.refused += 1
            raise ValueError(f"response_format cannot be enforced: {'; '.join(messages)}")
        compiled = CompiledGrammar(key, grammar, time.perf_counter() - started)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            self.stats.compiled += 1
            self.stats.compile_seconds.append(compiled.compile_seconds)
        return compiled

    def processor(self, compiled: CompiledGrammar) -> GrammarProcessor:
        """A matcher for one sequence (engine thread: its MLX arrays belong to that thread)."""
        return GrammarProcessor(self, compiled)

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
        from llguidance import LLMatcher

        self._matcher = LLMatcher(compiler.tokenizer, compiled.grammar)
        if self._matcher.is_error():
            raise ValueError(f"response_format cannot be enforced: {self._matcher.get_error()}")
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
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        # Each byte of the little-endian bitmask picks its 8 tokens' row of 0 / -inf.
        bias = self._table[mx.array(self._bitmask.view(np.uint8))].reshape(-1)
        return logits + bias[: logits.shape[-1]].astype(logits.dtype)

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
