"""Speculative decoding inside mlx-lm's continuous batch.

A speculating sequence drafts up to k tokens, from prompt lookup (engine/prompt_lookup.py) or
from a small draft model of the same tokenizer (``ModelDrafter`` below), and the whole batch is
verified in one forward pass of the model: each row feeds its pending token and its drafts
(rows with fewer drafts are padded; padding is never accepted). Position j's logits are the
model's distribution after the j-th draft, so one pass checks every draft and also yields the
token after the last accepted one:

- greedy: a draft is accepted while it equals the argmax at its position;
- sampled: a draft d is accepted with probability min(1, p(d) / q(d)) and on rejection the
  token is drawn from norm(max(0, p - q)); the standard rule, so the output keeps the
  distribution of the request's own sampler (same filters, temperature and PRNG key; the key
  is split differently, so a seed gives other, equally likely, tokens). q is the draft model's
  distribution under the same sampler; a prompt-lookup draft is one token, q(d) = 1, so it is
  accepted with probability p(d) and a rejection draws from p with d removed;
- a row without drafts (speculation off, logits processors, a grammar) is sampled from
  position 0 exactly as the plain step does.

Rows accept different numbers of drafts while the batch's KV cache (``BatchKVCache``) keeps
one length for all: the tail of the rejected drafts is trimmed for all rows, and a row that
accepted fewer is shifted right by the difference, its rejected entries becoming left padding
(mlx-lm's own ``prepare(right_padding)`` / ``finalize``, used for ragged prompts).

A step without any draft is mlx-lm's own (pipelined) step, untouched.

Backing off where drafting does not pay: a decode batch of more than ``max_batch`` rows drafts
nothing (the verify pass multiplies the batch's compute by the draft width, and a large batch
is compute-bound already), and a sequence whose drafts keep being rejected (its acceptance,
a moving average, under ``MIN_ACCEPTANCE``) pauses drafting for a number of steps that doubles
each time it happens again, then tries anew. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import (
    BatchKVCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from mlx_redis_worker.engine.config import DraftModel
from mlx_redis_worker.engine.phased_generator import PhasedBatchGenerator
from mlx_redis_worker.engine.prompt import model_vocab_size
from mlx_redis_worker.engine.prompt_lookup import PromptLookup
from mlx_redis_worker.engine.row_slots import RowSlotCounters, SlottedGenerationBatch
from mlx_redis_worker.engine.sampling import CategoricalSampler, GuardedSampler, draw_rows

# Acceptance (accepted / drafted, averaged over recent verify steps) under which a sequence
# pauses drafting: a verify row then yields about 1.4 tokens for up to 5 positions of compute.
MIN_ACCEPTANCE = 0.3
# Weight of the latest step in the moving average.
ACCEPTANCE_WEIGHT = 0.3
# Steps a sequence pauses at its first backoff; doubled at each further one, up to the cap.
FIRST_PAUSE = 4
MAX_PAUSE = 128


# Tokens a draft model takes in one forward pass while it catches up with a sequence (its
# prompt, or what was emitted while drafting paused): bounds the pass's activations.
DRAFT_PREFILL_CHUNK = 512


def check_draft_model(model: Any, tokenizer: Any, draft: DraftModel) -> None:
    """``ValueError`` unless ``draft`` can draft for ``model``: the same tokens under the same
    ids (its drafts are fed to the target as they are), logits of the same width (q and p are
    compared token by token), and a KV cache that can be trimmed (rejected drafts leave it)."""
    if draft.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            f"draft model {draft.name!r} has another tokenizer than the model it drafts for "
            "(its vocabulary differs): a draft must share the target's tokenizer"
        )
    sizes = model_vocab_size(draft.model, draft.tokenizer), model_vocab_size(model, tokenizer)
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"draft model {draft.name!r} has {sizes[0]} logits per token, the model it drafts "
            f"for {sizes[1]}: a draft must share the target's vocabulary"
        )
    if not can_trim_prompt_cache(make_prompt_cache(draft.model)):
        raise ValueError(
            f"draft model {draft.name!r} has a KV cache that cannot be trimmed (a sliding "
            "window?): its rejected drafts could not be taken back"
        )


class ModelDrafter:
    """A draft model's batch-1 KV cache for one sequence and the tokens in it.

    The target's context only grows by appending (prompt, then emitted tokens); the draft's
    cache holds a prefix of it plus the drafts of the last step. Before drafting, the cache is
    trimmed back to what the two share (the accepted drafts stay, the rejected ones go) and
    catches up on the rest, so it is in step with the target whatever happened in between
    (a rejection, a pause, steps without drafts). A finished or aborted sequence drops its
    drafter with its ``SpeculativeSequence``. Engine thread only.
    """

    __slots__ = ("_agreed", "_cache", "_fed", "_model")

    def __init__(self, model: Any) -> None:
        self._model = model
        self._cache: list[Any] = make_prompt_cache(model)
        # The tokens in the cache, and how many of them are known to be the target's context.
        self._fed: list[int] = []
        self._agreed = 0

    def __len__(self) -> int:
        return len(self._fed)

    def draft(
        self,
        context: list[int],
        pending: int,
        limit: int,
        sampler: CategoricalSampler | None,
    ) -> tuple[mx.array, mx.array | None]:
        """Lazy: ``limit`` (>= 1) draft tokens after ``context`` + ``pending``, argmax for a
        greedy request, else drawn from the request's sampler over the draft's logits; and for
        a sampled request the distributions q they were drawn from, (limit, vocab). The caller
        evaluates them and hands the tokens to ``drafted``."""
        target = [*context, pending]
        fed = self._fed
        common = min(self._agreed, len(fed))
        end = min(len(fed), len(target))
        while common < end and fed[common] == target[common]:
            common += 1
        if common == len(target):  # the cache holds all of it: feed the last token again
            common -= 1
        if common < len(fed):
            trim_prompt_cache(self._cache, len(fed) - common)
            del fed[common:]
        rest = target[common:]
        for start in range(0, len(rest) - DRAFT_PREFILL_CHUNK, DRAFT_PREFILL_CHUNK):
            self._model(mx.array([rest[start : start + DRAFT_PREFILL_CHUNK]]), cache=self._cache)
            mx.eval([c.state for c in self._cache])
        tail = len(rest) - (len(rest) - 1) % DRAFT_PREFILL_CHUNK - 1
        logits = self._model(mx.array([rest[tail:]]), cache=self._cache)[:, -1, :]
        fed += target[common:]
        self._agreed = len(target)
        tokens: list[mx.array] = []
        dists: list[mx.array] = []
        for j in range(limit):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            if sampler is None:
                token = mx.argmax(logprobs, axis=-1)
            else:
                scaled = sampler.logits(logprobs)
                token = mx.random.categorical(scaled, key=sampler.next_key())
                dists.append(mx.softmax(scaled, axis=-1))
            tokens.append(token)
            if j + 1 < limit:  # the last draft is verified by the target, never fed here
                logits = self._model(token.reshape(1, 1), cache=self._cache)[:, -1, :]
        drafted = mx.concatenate(tokens)
        return drafted, mx.concatenate(dists) if dists else None

    def drafted(self, tokens: list[int]) -> None:
        """The evaluated drafts of the last ``draft``: all but the last are in the cache."""
        self._fed += tokens[:-1]


@dataclass(slots=True)
class SpeculativeSequence:
    """A sequence's drafting state beside mlx-lm's: its draft length, its sampler (None for
    greedy), its draft source (the draft model's ``drafter``, else its n-gram index) and its
    backoff."""

    num_draft_tokens: int
    sampler: CategoricalSampler | None
    on_error: Callable[[BaseException], None]
    lookup: PromptLookup = field(default_factory=PromptLookup)
    drafter: ModelDrafter | None = None
    # Optimistic at first: a sequence drafts until its own drafts say otherwise.
    acceptance: float = 1.0
    paused_until: int = 0
    pause: int = FIRST_PAUSE

    def observe(self, accepted: int, drafted: int, step: int) -> bool:
        """Fold one verify step in; True when the sequence backs off now."""
        self.acceptance += ACCEPTANCE_WEIGHT * (accepted / drafted - self.acceptance)
        if self.acceptance >= MIN_ACCEPTANCE:
            if self.acceptance >= 2 * MIN_ACCEPTANCE:
                self.pause = FIRST_PAUSE
            return False
        self.paused_until = step + self.pause
        self.pause = min(2 * self.pause, MAX_PAUSE)
        # Back at the threshold: one bad step after the pause backs off again, a good one not.
        self.acceptance = MIN_ACCEPTANCE
        return True


# Decode batches of more rows than this draft nothing (SchedulerConfig.speculative_max_batch).
DEFAULT_MAX_BATCH = 8


@dataclass(slots=True)
class SpeculationCounters:
    """Since the scheduler was made: verify steps, the rows in them, drafts fed and accepted,
    and the tokens those steps emitted."""

    steps: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    # Sequences that paused drafting (low acceptance), and steps that drafted nothing because
    # the decode batch was over max_batch.
    backoffs: int = 0
    batch_backoffs: int = 0
    # Of rows, drafted and accepted: those of draft-model rows (the rest are prompt lookup's).
    model_rows: int = 0
    model_drafted: int = 0
    model_accepted: int = 0
    # Verify steps with a drafting row of each method: a step may hold both, so these cannot
    # be told apart from steps after the fact.
    lookup_steps: int = 0
    model_steps: int = 0


@dataclass
class SpeculativeResponse(GenerationBatch.Response):  # type: ignore[misc]
    """mlx-lm's response; ``more``: another token of the same sequence follows in this step."""

    more: bool = False


@dataclass(slots=True)
class _Verdict:
    accepted: int
    next_token: int
    next_logprobs: mx.array


class SpeculativeGenerationBatch(SlottedGenerationBatch):
    Response = SpeculativeResponse
    # mlx-lm's: the token each row feeds next (sampled, not yet in the cache) and its logprobs.
    _next_tokens: mx.array
    _next_logprobs: list[mx.array]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.speculating: dict[int, SpeculativeSequence] = {}
        self.counters = SpeculationCounters()
        self.max_batch = DEFAULT_MAX_BATCH
        self.step_count = 0
        super().__init__(*args, **kwargs)

    def next(self) -> list[Any]:
        self.step_count += 1
        drafts = self._drafts() if self.uids else None
        if drafts is None:
            return list(super().next())
        self.compact()  # a verify pass trims and shifts every cache row: live rows only
        return self._verify(*drafts)

    def _step(self) -> tuple[list[int], list[mx.array]]:
        """mlx-lm's decode step (the contract ``next`` reads), with per-row work only in the
        rows that need it. mlx-lm slices every row through the processors once one row has a
        processor, and samples every row alone once one row has a sampler of its own (a
        grammar row, a stochastic request): on tiny, 8 greedy rows beside 4 constrained ones at
        temperature 1 stepped in 34.2 ms, 31.5 ms here. Here the rows with processors are
        processed and written back into the batch's logits, the batch is sampled by the shared
        sampler in one call, and the rows with a sampler of their own are drawn by it and
        written over theirs."""
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        contexts: list[mx.array] = []
        rows = range(len(self.uids))
        processed = [e for e in rows if self.logits_processors and self.logits_processors[e]]
        if processed:
            outputs = []
            for e in processed:
                row, context = self._processed_row(e, inputs[e : e + 1], logits[e : e + 1])
                contexts.append(context)
                outputs.append(row)
            logits = _written_over(logits, processed, outputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        shared = self.fallback_sampler
        if self.samplers and len({id(sampler) for sampler in self.samplers}) == 1:
            shared = self.samplers[0] or shared  # one sampler for every row
        own = [e for e in rows if self.samplers and self.samplers[e] not in (None, shared)]
        sampled = self._draw(shared(logprobs), logprobs, own)
        self._next_tokens = sampled
        self._next_logprobs = list(logprobs)
        # The next step computes while this one's tokens are handed out.
        mx.async_eval(self._next_tokens, self._next_logprobs, contexts)  # type: ignore[no-untyped-call]
        mx.eval(inputs, self._current_logprobs)
        tokens: list[int] = inputs.tolist()  # type: ignore[assignment]
        for row_tokens, token in zip(self.tokens, tokens, strict=True):
            row_tokens.append(token)
        return tokens, self._current_logprobs

    def _draw(self, sampled: mx.array, logprobs: mx.array, own: list[int]) -> mx.array:
        """``sampled`` with the ``own`` rows drawn by their own samplers: every plain
        categorical one together (``draw_rows``), the others (a grammar row's) one by one."""
        plain = {
            e: categorical
            for e in own
            if isinstance(sampler := self.samplers[e], GuardedSampler)
            and (categorical := sampler.categorical) is not None
        }
        if len(plain) < 2:
            plain = {}  # one row alone: its own call is the same draw
        alone = [e for e in own if e not in plain]
        sampled = _written_over(
            sampled, alone, [self.samplers[e](logprobs[e : e + 1]) for e in alone]
        )
        if not plain:
            return sampled
        together = list(plain)
        try:
            drawn = draw_rows(list(plain.values()), logprobs[mx.array(together)])
        except Exception:  # a filter's failure: each row's own sampler contains its own
            drawn = mx.concatenate([self.samplers[e](logprobs[e : e + 1]) for e in together])
        return _written_over(sampled, together, [drawn])

    def filter(self, keep: list[int]) -> None:
        kept = {self.uids[i] for i in keep}
        gone = [uid for uid in self.uids if uid not in kept]
        super().filter(keep)
        for uid in gone:
            self.speculating.pop(uid, None)

    # -- drafting ----------------------------------------------------------------------------

    def _drafts(self) -> tuple[list[int], list[list[int]], list[mx.array | None]] | None:
        """Each row's pending token, drafts, and (a draft model's sampled rows) the draft
        distributions q; None when no row drafts (a plain step)."""
        speculating = self.speculating
        entries = [speculating.get(uid) for uid in self.uids]
        if not any(entries) or not all(type(c) is BatchKVCache for c in self.prompt_cache):
            return None
        if len(entries) > self.max_batch:
            self.counters.batch_backoffs += 1
            return None
        mx.eval(self._next_tokens)
        pending = cast(list[int], self._next_tokens.tolist())
        drafts: list[list[int]] = []
        dists: list[mx.array | None] = [None] * len(entries)
        # A draft model's rows: drafted lazily, all evaluated together below.
        modelled: list[tuple[int, SpeculativeSequence, mx.array]] = []
        for i, entry in enumerate(entries):
            drafts.append([])
            if entry is None or entry.paused_until > self.step_count:
                continue
            # The pending token is emitted too: drafts past max_tokens would be thrown away.
            limit = min(entry.num_draft_tokens, self.max_tokens[i] - self._num_tokens[i] - 1)
            if entry.drafter is None:
                entry.lookup.sync(self.tokens[i])
                drafts[i] = entry.lookup.draft(pending[i], limit)
            elif limit > 0:
                try:
                    tokens, dists[i] = entry.drafter.draft(
                        self.tokens[i], pending[i], limit, entry.sampler
                    )
                except Exception as exc:  # the draft model failed: this sequence only
                    entry.on_error(exc)
                    continue
                modelled.append((i, entry, tokens))
        if modelled:
            mx.eval([tokens for _, _, tokens in modelled])
            for i, entry, tokens in modelled:
                drafts[i] = cast(list[int], tokens.tolist())
                assert entry.drafter is not None
                entry.drafter.drafted(drafts[i])
        if not any(drafts):
            return None
        return pending, drafts, dists

    # -- verifying ---------------------------------------------------------------------------

    def _verify(
        self, pending: list[int], drafts: list[list[int]], dists: list[mx.array | None]
    ) -> list[Any]:
        width = max(len(d) for d in drafts)
        inputs = mx.array(
            [
                [token, *d] + [0] * (width - len(d))
                for token, d in zip(pending, drafts, strict=True)
            ],
            dtype=mx.uint32,
        )
        logits = self.model(inputs, cache=self.prompt_cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy = mx.argmax(logprobs, axis=-1)
        decide = [
            self._decision(e, inputs, logits, logprobs, d, dists[e]) for e, d in enumerate(drafts)
        ]
        mx.eval(logprobs, greedy, [lazy for _, lazy in decide])
        greedy_rows = cast(list[list[int]], greedy.tolist())
        verdicts = [
            settle(greedy_rows[e], drafts[e], lazy) for e, (settle, lazy) in enumerate(decide)
        ]
        self._fix_cache(width, [v.accepted for v in verdicts])
        return self._emit(pending, drafts, logprobs, verdicts)

    def _decision(
        self,
        e: int,
        inputs: mx.array,
        logits: mx.array,
        logprobs: mx.array,
        draft: list[int],
        dist: mx.array | None,
    ) -> tuple[Callable[[list[int], list[int], Any], _Verdict], Any]:
        """Row ``e``'s lazy arrays to evaluate and how to turn them (with the row's argmax)
        into a verdict, so that the whole batch is evaluated once."""
        entry = self.speculating.get(self.uids[e])
        if not draft:
            row = self._plain_row(e, inputs, logits)
            sampler = self.samplers[e] if self.samplers else self.fallback_sampler
            token = sampler(row)
            return (lambda _g, _d, t: _Verdict(0, int(t.item()), row[0])), token
        assert entry is not None
        if entry.sampler is None:
            return (lambda g, d, _t: _greedy_verdict(g, d, logprobs[e])), None
        try:
            lazy = _rejection_arrays(entry.sampler, logprobs[e, : len(draft) + 1], draft, dist)
        except Exception as exc:
            entry.on_error(exc)
            return (lambda g, _d, _t: _Verdict(0, g[0], logprobs[e, 0])), None
        return (lambda _g, d, arrays: _sampled_verdict(d, arrays, logprobs[e])), lazy

    def _plain_row(self, e: int, inputs: mx.array, logits: mx.array) -> mx.array:
        """Position 0 of row ``e`` through its logits processors, as mlx-lm's step does."""
        row = logits[e : e + 1, 0]
        if self.logits_processors and self.logits_processors[e]:
            row, _ = self._processed_row(e, inputs[e : e + 1, 0], row)
        return row - mx.logsumexp(row, axis=-1, keepdims=True)

    def _processed_row(self, e: int, token: mx.array, row: mx.array) -> tuple[mx.array, mx.array]:
        """Row ``e``'s logits ``row`` through its logits processors, its token context first
        extended by the ``token`` it feeds; and that context."""
        context = self._token_context[e].update_and_fetch(token)
        for processor in self.logits_processors[e]:
            row = processor(context, row)
        return row, context

    def _fix_cache(self, width: int, accepted: list[int]) -> None:
        """Keep each row's pending token and accepted drafts in the KV cache, nothing after."""
        most = max(accepted)
        if width > most:
            for cache in self.prompt_cache:
                cache.trim(width - most)
        shifts = [most - a for a in accepted]
        if any(shifts):
            for cache in self.prompt_cache:
                cache.prepare(right_padding=shifts)
                cache.finalize()

    def _emit(
        self,
        pending: list[int],
        drafts: list[list[int]],
        logprobs: mx.array,
        verdicts: list[_Verdict],
    ) -> list[Any]:
        counters = self.counters
        counters.steps += 1
        # Compared after the loop: which methods' rows drafted in this step.
        rows_before, model_rows_before = counters.rows, counters.model_rows
        responses: list[Any] = []
        keep: list[int] = []
        for e, verdict in enumerate(verdicts):
            a = verdict.accepted
            emitted = [pending[e], *drafts[e][:a]]
            rows: list[mx.array] = [self._next_logprobs[e]]
            rows += (logprobs[e, j] for j in range(a))
            if drafts[e]:
                counters.rows += 1
                counters.drafted += len(drafts[e])
                counters.accepted += a
                entry = self.speculating.get(self.uids[e])
                if entry is not None and entry.drafter is not None:
                    counters.model_rows += 1
                    counters.model_drafted += len(drafts[e])
                    counters.model_accepted += a
                if entry is not None and entry.observe(a, len(drafts[e]), self.step_count):
                    counters.backoffs += 1
            self.tokens[e].extend(emitted)
            finish_reason = None
            count = 0
            for token in emitted:
                count += 1
                self._num_tokens[e] += 1
                if self._num_tokens[e] >= self.max_tokens[e]:
                    finish_reason = "length"
                if self._matchers[e].advance(token):
                    finish_reason = "stop"
                if finish_reason is not None:
                    break
            counters.emitted += count
            uid = self.uids[e]
            cache = all_tokens = None
            if finish_reason is None:
                keep.append(e)
            else:
                surplus = len(emitted) - count
                cache = self._extract_trimmed(e, surplus)
                all_tokens = self.tokens[e][: len(self.tokens[e]) - surplus]
            for j in range(count):
                last = j == count - 1
                responses.append(
                    SpeculativeResponse(
                        uid=uid,
                        token=emitted[j],
                        logprobs=rows[j],
                        finish_reason=finish_reason if last else None,
                        prompt_cache=cache if last else None,
                        all_tokens=all_tokens if last else None,
                        more=not last,
                    )
                )
        model_rows = counters.model_rows - model_rows_before
        if model_rows:
            counters.model_steps += 1
        if counters.rows - rows_before > model_rows:
            counters.lookup_steps += 1
        self._current_tokens = mx.array(pending, dtype=mx.uint32)
        self._next_tokens = mx.array([v.next_token for v in verdicts], dtype=mx.uint32)
        self._next_logprobs = [v.next_logprobs for v in verdicts]
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses

    def _extract_trimmed(self, e: int, surplus: int) -> list[Any]:
        """Row ``e``'s cache without the ``surplus`` accepted tokens after its finish."""
        caches = self.extract_cache(e)
        if surplus:
            for cache in caches:
                cache.offset -= surplus
                cache.keys = cache.keys[..., : cache.offset, :]
                cache.values = cache.values[..., : cache.offset, :]
        return list(caches)


def _written_over(batch: mx.array, rows: list[int], values: list[mx.array]) -> mx.array:
    """``batch`` with its ``rows`` replaced by ``values`` (concatenated, a row each), in one
    op."""
    if not rows:
        return batch
    if len(rows) == batch.shape[0]:
        return mx.concatenate(values, axis=0)
    batch[mx.array(rows)] = mx.concatenate(values, axis=0).astype(batch.dtype)
    return batch


def _greedy_verdict(targets: list[int], draft: list[int], logprobs: mx.array) -> _Verdict:
    accepted = 0
    while accepted < len(draft) and draft[accepted] == targets[accepted]:
        accepted += 1
    return _Verdict(accepted, targets[accepted], logprobs[accepted])


def _rejection_arrays(
    sampler: CategoricalSampler,
    logprobs: mx.array,
    draft: list[int],
    dist: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Lazy: for each draft whether it is accepted (u < p(d) / q(d)), and for each position
    the token drawn on rejection there (norm(max(0, p - q)); after the last draft, p itself).

    ``dist``: the distributions q the drafts were drawn from, (k, vocab); None for drafts that
    are one token each (prompt lookup), q(d) = 1: accepted with p(d), redrawn from p without d.
    """
    k = len(draft)
    logits = sampler.logits(logprobs)  # (k + 1, vocab): the sampler's own distribution
    probs = mx.softmax(logits, axis=-1)
    drafted = mx.array(draft, dtype=mx.uint32)
    if dist is None:
        dist = (mx.arange(logits.shape[-1])[None, :] == drafted[:, None]).astype(probs.dtype)
    p_draft = mx.take_along_axis(probs[:k], drafted[:, None], axis=-1)[:, 0]
    q_draft = mx.take_along_axis(dist, drafted[:, None], axis=-1)[:, 0]
    # u < p / q without dividing (q(d) > 0: d was drawn from q).
    accept = mx.random.uniform(shape=(k,), key=sampler.next_key()) * q_draft < p_draft
    residual = mx.log(mx.maximum(probs[:k] - dist, 0.0))
    redraw = mx.random.categorical(
        mx.concatenate([residual, logits[k:]], axis=0), key=sampler.next_key()
    )
    return accept, redraw


def _sampled_verdict(
    draft: list[int], arrays: tuple[mx.array, mx.array], logprobs: mx.array
) -> _Verdict:
    accept = cast(list[bool], arrays[0].tolist())
    redraw = cast(list[int], arrays[1].tolist())
    accepted = 0
    while accepted < len(draft) and accept[accepted]:
        accepted += 1
    return _Verdict(accepted, redraw[accepted], logprobs[accepted])


class SpeculativeBatchGenerator(PhasedBatchGenerator):
    """mlx-lm's BatchGenerator whose decode batch speculates for the sequences registered with
    ``speculate``; the others decode exactly as before."""

    def __init__(
        self, model: Any, *, counters: SpeculationCounters, max_batch: int, **kwargs: Any
    ) -> None:
        super().__init__(model, **kwargs)
        self._speculation_counters = counters
        self._speculation_max_batch = max_batch
        # Shared by every decode batch: a sequence speculates in whichever batch it is.
        self.speculating: dict[int, SpeculativeSequence] = {}
        self.slot_counters = RowSlotCounters()

    def _empty_decode_batch(self) -> SlottedGenerationBatch:
        batch: SpeculativeGenerationBatch
        batch = SpeculativeGenerationBatch.empty(self.model, self.sampler)
        batch.counters = self._speculation_counters
        batch.max_batch = self._speculation_max_batch
        batch.speculating = self.speculating
        batch.slot_counters = self.slot_counters
        return batch

    def speculate(self, uid: int, sequence: SpeculativeSequence) -> None:
        self.speculating[uid] = sequence

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        for uid in uids:
            self.speculating.pop(uid, None)
        return super().remove(uids, return_prompt_caches=return_prompt_caches)
