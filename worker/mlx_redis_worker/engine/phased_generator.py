"""mlx-lm's BatchGenerator with its step split into three phases that the scheduler orders.

mlx-lm's ``BatchGenerator.next()`` decodes the running batch, moves the sequences whose prompts
were processed by the *previous* call into the decode batch (running their first forward pass),
then processes the next prompt chunk, and returns everything at the end. A sequence's first
token therefore leaves two calls after its prefill ended, behind another prefill chunk. Here:

- ``prefill()`` processes one chunk of the prompt batch (taking queued sequences into it); a
  prompt's last chunk takes its last token too, and the pass yields that position's logits
  (mlx-lm runs the last token in a forward pass of its own: one pass per prefill group more),
- ``start_generation()`` moves every sequence whose prompt is now processed into the decode
  batch and samples its first token at once (returned in the same step as its prefill),
- ``decode()`` runs one decode step of the running batch; the scheduler runs it every step
  while sequences decode, with a bounded prefill beside it (``prefill(budget)``: stall-free).

Only the step is replaced: queueing, caches, removal and the batch classes are mlx-lm's. The
phases read ``BatchGenerator``'s internal fields, so the mlx-lm version is pinned below 0.33 in
``pyproject.toml``, and ``check_supported`` refuses a version whose fields moved.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import (
    BatchGenerator,
    GenerationBatch,
    PromptProcessingBatch,
    _right_pad_prompts,
)
from mlx_lm.models.cache import make_prompt_cache

from mlx_redis_worker.engine.decode_batches import DecodeBatches, DecodePlan
from mlx_redis_worker.engine.row_slots import SlottedGenerationBatch
from mlx_redis_worker.engine.vision import token_embeddings, vision_model_of

_FIELDS = (
    "_unprocessed_sequences",
    "_prompt_batch",
    "_currently_processing",
    "_generation_batch",
    "_counters",
    "_stream",
)


@dataclass(slots=True)
class PromptLane:
    """A prompt batch and its rows' progress (mlx-lm's ``_prompt_batch`` and
    ``_currently_processing``).

    Prompts in prefill are in two lanes: prompts of at most a chunk (``prefill_step_size``)
    and longer ones, each lane a prompt batch of up to ``prefill_batch_size`` rows, and a pass
    prefills one lane. In one batch a short prompt arriving beside long ones in prefill either
    rode in their passes (every row as wide as its chunk, each long row attending over its
    whole context) or split the batch and joined it again (copying every row's cache); here it
    takes a narrow pass of its own."""

    batch: PromptProcessingBatch
    processing: list[list[Any]]


class PhasedBatchGenerator(BatchGenerator):  # type: ignore[misc]  # mlx-lm is untyped
    def __init__(self, model: Any, *, decode_share: float = math.inf, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        # The running sequences, in decode batches grouped by context length (mlx-lm's own
        # ``_generation_batch`` stays empty): ``decode_share`` bounds a long-context batch's
        # passes beside the steady one, in steady steps a step (see decode_batches).
        self._decode_batches = DecodeBatches(
            self._empty_decode_batch,
            weight_bytes=_weight_bytes(model),
            share=decode_share,
            max_kv_size=kwargs.get("max_kv_size"),
        )
        self.last_decode_plan = DecodePlan()
        # Per prompt-batch sequence: [segments left, tokens processed, prompt tokens].
        self._currently_processing: list[list[Any]]
        self._prompt_batch: PromptProcessingBatch
        # Sequences whose first token start_generation handed out before feeding it.
        self._handed_out: set[int] = set()
        # The logits of each prompt whose last token its prefill pass took, until
        # start_generation samples its first token from them.
        self._first_logits: dict[int, mx.array] = {}
        # Sequences whose prompt must end as mlx-lm's does (all but the last token in the
        # cache): a prefix stored at that point is keyed by those tokens.
        self.last_token_apart: set[int] = set()
        # Input embeddings of a prompt whose positions are not all tokens (an image's features
        # at its image tokens), from a prompt position on: the prefill feeds these instead of
        # token ids, chunk by chunk (``_chunk_embeddings``).
        self.prompt_embeddings: dict[int, tuple[int, mx.array]] = {}
        # The last prefill() pass: tokens computed (padding included) and seconds.
        self.last_prefill_tokens = 0
        self.last_prefill_seconds = 0.0
        # Prompts in prefill are in two lanes, each a prompt batch of its own (see
        # ``PromptLane``): mlx-lm's ``_prompt_batch`` and ``_currently_processing`` hold the
        # lane in use, ``_other_lane`` the other one (``_use_lane`` swaps them).
        self._long_in_use = False
        self._other_lane = PromptLane(
            PromptProcessingBatch.empty(
                self.model, self.sampler, prefill_step_size=self.prefill_step_size
            ),
            [],
        )
        # Prefill seconds each lane (short, long) spent since both last had prompts to prefill.
        self._lane_seconds = [0.0, 0.0]
        # The lane ``prepare_pass`` chose for the next ``prefill()`` (None: choose then).
        self._chosen_lane: bool | None = None
        missing = [name for name in _FIELDS if not hasattr(self, name)]
        if missing:
            raise RuntimeError(
                f"this mlx-lm's BatchGenerator lacks {missing}: the engine's phased step "
                "supports mlx-lm 0.32.x"
            )
        # Checked once per model object (the engine checks when it starts: see SplitModel.of).
        with mx.stream(self._stream):
            self._split_model = SplitModel.of(self.model)

    @property
    def has_prefill_work(self) -> bool:
        """Sequences are queued or part-way through their prompts."""
        return bool(self._unprocessed_sequences) or self._prompt_rows > 0

    @property
    def shortest_prompt_left(self) -> int | None:
        """The fewest prompt tokens any sequence the next ``prefill()`` would take has left
        (its rows, and the queued sequences that would fill free rows); None without any."""
        left = self._left_in(False) + self._left_in(True)
        left += [_tokens_left(queued[1]) for queued in self._queued_to_take()]
        return min(left, default=None)

    def pass_ending_short_lane(self) -> int:
        """The tokens of one pass that ends the prompt of every row of the short lane with
        prompt left (each row padded to the longest, as a pass computes them), or 0 where some
        prompt cannot end in one pass (a segment boundary before its end: a pass takes one
        segment; more than a chunk left) or none is left."""
        rows = [p[0] for p in self._lane(False).processing if _has_prompt_left(p[0])]
        if not rows or not all(_one_segment_left(segments) for segments in rows):
            return 0
        longest = max(_tokens_left(segments) for segments in rows)
        return len(rows) * longest if longest <= self.prefill_step_size else 0

    @property
    def long_prompts_in_prefill(self) -> bool:
        """Whether a prompt of the long lane (more than a chunk) has tokens left."""
        return bool(self._left_in(True))

    @property
    def _prompt_rows(self) -> int:
        return len(self._prompt_batch) + len(self._other_lane.batch)

    def _lane(self, long: bool) -> PromptLane:
        """The long or the short lane, whether in mlx-lm's fields or not."""
        if long == self._long_in_use:
            return PromptLane(self._prompt_batch, self._currently_processing)
        return self._other_lane

    def _left_in(self, long: bool) -> list[int]:
        """The tokens each row of that lane with prompt left still has to prefill."""
        return [_tokens_left(p[0]) for p in self._lane(long).processing if _has_prompt_left(p[0])]

    def _is_long(self, segments: list[list[int]]) -> bool:
        return _tokens_left(segments) > int(self.prefill_step_size)

    def _queued_to_take(self) -> list[Any]:
        """The queued sequences the next ``prefill()`` takes into its lanes' free rows (in
        queue order, each lane up to ``prefill_batch_size`` rows, while the decode batches
        have room)."""
        room = self.completion_batch_size - self.num_decoding - self._prompt_rows
        free = {
            long: self.prefill_batch_size - len(self._lane(long).batch) for long in (False, True)
        }
        taken: list[Any] = []
        for queued in self._unprocessed_sequences:
            if len(taken) >= room:
                break
            long = self._is_long(queued[1])
            if free[long] > 0:
                free[long] -= 1
                taken.append(queued)
        return taken

    def _use_lane(self, long: bool) -> None:
        """Make the short or the long lane the one in mlx-lm's fields."""
        if long != self._long_in_use:
            other = self._other_lane
            self._other_lane = PromptLane(self._prompt_batch, self._currently_processing)
            self._prompt_batch, self._currently_processing = other.batch, other.processing
            self._long_in_use = long

    def _take_queued(self) -> None:
        """Move ``_queued_to_take`` into their lanes' prompt batches."""
        taking = self._queued_to_take()
        if not taking:
            return
        chosen = {id(queued) for queued in taking}
        rest = [queued for queued in self._unprocessed_sequences if id(queued) not in chosen]
        for long in (False, True):
            lane = [queued for queued in taking if self._is_long(queued[1]) == long]
            if lane:
                self._use_lane(long)
                self._unprocessed_sequences.clear()
                self._unprocessed_sequences.extend(lane)
                self._prompt_batch.extend(self._make_batch(len(lane)))
        self._unprocessed_sequences.clear()
        self._unprocessed_sequences.extend(rest)

    def prepare_pass(self, lane: int | None = None) -> int:
        """Take queued sequences into their lanes' free rows (as ``prefill()`` would) and say
        which lane the next ``prefill()`` prefills: 0 short prompts, 1 long ones (each lane
        has its own speed: ``PrefillPace.lane``). With ``lane``, that one (a burst's step
        prefills the lane of the prompt it ends)."""
        with mx.stream(self._stream):
            self._take_queued()
        self._chosen_lane = self._pass_lane() if lane is None else bool(lane)
        return int(bool(self._chosen_lane))

    @property
    def shortest_lane(self) -> int:
        """The lane of the prompt with the fewest tokens left (``shortest_prompt_left`` after
        ``prepare_pass``): 0 short, 1 long."""
        short, long = self._left_in(False), self._left_in(True)
        return int(bool(long) and (not short or min(long) < min(short)))

    def _pass_lane(self) -> bool | None:
        """The lane this pass prefills (True: the long one): the one with prompt left, or,
        when both have, the one that spent fewer prefill seconds since both had (short first
        on a tie): long prompts get at least half of the prefill time beside short ones, and a
        short prompt waits for at most one long pass."""
        busy = [long for long in (False, True) if self._left_in(long)]
        if not busy:
            return None
        if len(busy) == 1:
            self._lane_seconds = [0.0, 0.0]
            return busy[0]
        return self._lane_seconds[1] < self._lane_seconds[0]

    @property
    def num_decoding(self) -> int:
        """Sequences in the decode batches."""
        return len(self._decode_batches)

    @property
    def num_decode_batches(self) -> int:
        """The decode batches (forward passes) the running sequences are grouped in."""
        return self._decode_batches.count

    def _empty_decode_batch(self) -> SlottedGenerationBatch:
        return SlottedGenerationBatch.empty(self.model, self.sampler)  # type: ignore[no-any-return]

    @property
    def num_prefilling(self) -> int:
        """Sequences queued for prefill or part-way through their prompts."""
        return len(self._unprocessed_sequences) + self._prompt_rows

    def wait_for_decode(self) -> None:
        """Wait for the decode pass ``decode()`` left running on the device (mlx-lm
        evaluates a step's next tokens asynchronously): the time to here is the decode step's
        own, not charged to the prefill pass that would otherwise wait for it."""
        mx.synchronize(self._stream)

    def decode(self, sides: bool = True) -> list[GenerationBatch.Response]:
        """One decode step: a token for each sequence of the steady batch, and (``sides``) of
        the side batch whose pass is due (``last_decode_plan`` says which ran)."""
        plan = self._decode_batches.plan(sides)
        self.last_decode_plan = plan
        if not plan.batches:
            return []
        with mx.stream(self._stream):
            started = time.perf_counter()
            responses: list[GenerationBatch.Response] = []
            for part in plan.batches:
                responses += part.batch.next()
            if len(plan.batches) > 1 or any(r.finish_reason is not None for r in responses):
                self._decode_batches.tidy()  # finished rows left their batches
            if self._handed_out:
                responses = self._drop_handed_out(responses)
            counters = self._counters
            counters.decode_time += time.perf_counter() - started
            counters.generation_tokens += len(responses)
            counters.generation_steps += 1
            if counters.generation_steps % 512 == 0:
                mx.clear_cache()  # as mlx-lm's own step does
        return responses

    def _drop_handed_out(
        self, responses: list[GenerationBatch.Response]
    ) -> list[GenerationBatch.Response]:
        """Drop the first token each sequence that ``start_generation`` handed out is fed with
        (its first response of this step; it cannot finish it: see there)."""
        kept = []
        for response in responses:
            if response.uid in self._handed_out:
                self._handed_out.discard(response.uid)
                continue
            kept.append(response)
        return kept

    def prefill(
        self, budget: int | None = None, short_floor: int = 0
    ) -> list[PromptProcessingBatch.Response]:
        """Take queued sequences into the prompt batch (up to ``prefill_batch_size``, while the
        decode batch has room) and process the next chunk of each prompt: ``prefill_step_size``
        tokens each, or with a ``budget``, that many tokens in all (none: no pass, the prompt
        batch still takes queued sequences; the pass is as wide as its
        longest chunk). A budget is shared equally when each share finishes at least the prompt
        with the fewest tokens left (a pass no wider than the longest prompt it ends, when
        some prompt does not end in it), and when no prompt can end in it; otherwise it goes
        to the prompts with the fewest left,
        shortest first, each as wide as the shortest's remainder (or the whole budget to the
        shortest alone): shortest remaining prefill first, so that some first tokens come
        now rather than all of them later (the rows left out of a pass wait, their caches
        untouched). A pass of the short prompts' lane (a ``budget`` above 0) takes enough to
        end each row's prompt, up to ``short_floor`` tokens. Each response says how far its
        prompt got and whether a segment (e.g. a shared prefix) ended here."""
        self.last_prefill_tokens = 0
        self.last_prefill_seconds = 0.0
        with mx.stream(self._stream):
            self._take_queued()
            lane = self._pass_lane() if self._chosen_lane is None else self._chosen_lane
            self._chosen_lane = None
            if lane is None:
                return []
            self._use_lane(lane)
            width, taking = self._shape_pass(budget, short_floor)
            responses: list[PromptProcessingBatch.Response] = []
            chunks: list[list[int]] = []
            finishing: list[int] = []  # rows whose chunk takes the prompt's last token
            for row, (uid, progress) in enumerate(
                zip(self._prompt_batch.uids, self._currently_processing, strict=True)
            ):
                segments = progress[0]
                if row not in taking:
                    chunks.append([])  # prompt done (waits for start_generation), or not now
                    continue
                chunk = segments[0][:width]
                segments[0] = segments[0][len(chunk) :]
                end_of_segment = not segments[0]
                if end_of_segment:
                    segments.pop(0)
                    if (
                        _only_last_token(segments)
                        # A pass one wider than its budget, not a separate forward pass
                        # of the last token in start_generation.
                        and len(chunk) < self.prefill_step_size
                        and uid not in self.last_token_apart
                        and self._split_model is not None
                    ):
                        chunk = chunk + segments.pop(0)
                        finishing.append(row)
                progress[1] += len(chunk)
                chunks.append(chunk)
                responses.append(
                    PromptProcessingBatch.Response(
                        uid, (progress[1], progress[2]), end_of_segment, False
                    )
                )
            if any(chunks):
                self._prompt(chunks, finishing)
                self._lane_seconds[lane] += self.last_prefill_seconds
        return responses

    def _shape_pass(self, budget: int | None, short_floor: int) -> tuple[int, set[int]]:
        """The chunk width of this pass and the prompt-batch rows it takes (see ``prefill``)."""
        left = sorted(
            (_tokens_left(p[0]), row)
            for row, p in enumerate(self._currently_processing)
            if _has_prompt_left(p[0])
        )
        width = self.prefill_step_size
        if budget is None or not left:
            return width, {row for _, row in left}
        if budget <= 0:
            return width, set()  # no pass this step (queued sequences still take free rows)
        if not self._long_in_use:
            # A pass of short prompts may end each row's prompt, up to ``short_floor`` tokens
            # (a pass beyond its credit is paid back by the steps after it): shares of the
            # credit's 32 tokens took five passes, each waiting for its credit, to end four
            # 40-token prompts.
            budget = max(budget, min(short_floor, left[0][0] * len(left)))
        share = budget // len(left)
        if share >= left[0][0]:
            # Every row gets an equal share, and the pass is no wider than the longest prompt
            # it ends: a short prompt beside long ones (another tenant's chat beside a long
            # prompt) ends in a narrow pass, not one as wide as the long ones' shares.
            ending = [n for n, _ in left if n <= share]
            width = max(1, min(width, ending[-1] if len(ending) < len(left) else share))
            return width, {row for _, row in left}
        if left[0][0] > budget:
            # No prompt ends in this pass: equal shares, every row in it. Leaving rows out
            # splits the prompt batch and joins it again, copying every row's cache: with
            # four long prompts deep in prefill that copy took 40-170 ms a step on tiny, for
            # a 32-token budget whose pass takes 25.
            return max(1, share), {row for _, row in left}
        width = max(1, min(width, max(share, left[0][0])))
        return width, {row for _, row in left[: max(1, budget // width)]}

    def start_generation(self) -> list[GenerationBatch.Response]:
        """Move every sequence whose prompt is processed (all but its last token) into the
        decode batch and return its first token now.

        mlx-lm's ``generate()`` runs the last prompt token and samples the first token; its
        ``next()`` would then run the first token through the model (for the second) before
        handing the first out. Here the first tokens leave at once and their forward pass waits
        for the next ``decode()``, batched with every running sequence: during a burst, one
        pass over the weights per prefill group fewer before the next group's prefill. That
        ``decode()`` hands the first token out again (mlx-lm returns the token it feeds); it
        is dropped there. A group where any first token ends its sequence (a stop token, or
        ``max_tokens`` of 1) goes through ``next()`` as mlx-lm does, so every finish is
        mlx-lm's own."""
        responses: list[GenerationBatch.Response] = []
        for long in (self._long_in_use, not self._long_in_use):
            if self._lane(long).processing:  # an empty lane is not swapped in every step
                self._use_lane(long)
                responses += self._start_lane()
        return responses

    def _start_lane(self) -> list[GenerationBatch.Response]:
        """``start_generation`` of the lane in use."""
        ready = [
            i
            for i, p in enumerate(self._currently_processing)
            if not p[0] or _only_last_token(p[0])
        ]
        if not ready:
            return []
        with mx.stream(self._stream):
            for i in ready:
                self.prompt_embeddings.pop(self._prompt_batch.uids[i], None)
            records = [self._currently_processing[i] for i in ready]
            self._currently_processing = [
                p for i, p in enumerate(self._currently_processing) if i not in set(ready)
            ]
            batch = self._begin_generation(self._prompt_batch.split(ready), records)
            started = time.perf_counter()
            first = batch._next_tokens.tolist()
            if all(
                limit > 1 and not stops.matcher().advance(token)
                for token, limit, stops in zip(
                    first, batch.max_tokens, batch.stop_sequences, strict=True
                )
            ):
                responses = [
                    batch.Response(uid, token, logprobs, None, None, None)
                    for uid, token, logprobs in zip(
                        batch.uids, first, batch._next_logprobs, strict=True
                    )
                ]
                self._handed_out.update(batch.uids)
            else:
                responses = batch.next()
            self._counters.decode_time += time.perf_counter() - started
            self._counters.generation_tokens += len(responses)
            self._decode_batches.add(batch)
        return responses

    def _begin_generation(
        self, part: PromptProcessingBatch, records: list[list[Any]]
    ) -> GenerationBatch:
        """The decode batch of the sequences in ``part``, their first tokens sampled: from the
        logits their prefill pass kept, or (the last token still apart) by mlx-lm's own pass."""
        kept = [j for j, uid in enumerate(part.uids) if uid in self._first_logits]
        apart = [j for j, uid in enumerate(part.uids) if uid not in self._first_logits]
        batch: GenerationBatch | None = None
        if apart:
            rest = part.split(apart) if kept else part
            batch = rest.generate([records[j][0][0] for j in apart])
        if kept:
            logits = mx.stack([self._first_logits.pop(uid) for uid in part.uids])
            last = mx.array([tokens[-1] for tokens in part.tokens])
            # GenerationBatch samples from the logits of its inputs in its constructor, and
            # appends those inputs to the tokens it was given: hand it the logits the prefill
            # pass made, and the prompt without the last token it already holds.
            started = GenerationBatch(
                _Logits(logits),
                part.uids,
                last,
                part.prompt_cache,
                [tokens[:-1] for tokens in part.tokens],
                part.samplers,
                part.fallback_sampler,
                part.logits_processors,
                part.stop_sequences,
                part.max_tokens,
            )
            started.model = self.model
            if batch is None:
                batch = started
            else:
                batch.extend(started)
        assert batch is not None
        return batch

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> Any:
        self._handed_out.difference_update(uids)
        self.last_token_apart.difference_update(uids)
        for uid in uids:
            self._first_logits.pop(uid, None)
            self.prompt_embeddings.pop(uid, None)
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        # mlx-lm's remove takes queued and prefilling rows: of each lane in turn.
        for long in (self._long_in_use, not self._long_in_use):
            self._use_lane(long)
            super().remove(uids)
        self._decode_batches.remove(set(uids))
        return caches

    def extract_cache(self, uids: list[int]) -> dict[int, Any]:
        results: dict[int, Any] = {}
        for long in (self._long_in_use, not self._long_in_use):
            self._use_lane(long)
            results.update(super().extract_cache(uids))
        results.update(self._decode_batches.extract(set(uids)))
        return results

    @property
    def prompt_cache_nbytes(self) -> int:
        other = sum(int(c.nbytes) for c in self._other_lane.batch.prompt_cache)
        return int(super().prompt_cache_nbytes) + other + self._decode_batches.nbytes()

    def _prompt(self, chunks: list[list[int]], finishing: list[int]) -> None:
        """Process one chunk per prompt-batch sequence; a sequence with an empty chunk (its
        prompt is done) is left out of the forward pass, its cache untouched. The rows in
        ``finishing`` end their prompts here: their last position's logits are kept."""
        batch = self._prompt_batch
        active = [i for i, chunk in enumerate(chunks) if chunk]
        started = time.perf_counter()
        if len(active) == len(chunks):
            self._process(batch, chunks, finishing)
        else:
            part = batch.split(active)
            self._process(part, [chunks[i] for i in active], [active.index(i) for i in finishing])
            batch.extend(part)
            # extend() appends: put the processing records in the batch's new order.
            order = [i for i in range(len(chunks)) if i not in set(active)] + active
            self._currently_processing = [self._currently_processing[i] for i in order]
        seconds = time.perf_counter() - started
        self._counters.prompt_tokens += sum(len(c) for c in chunks)
        self._counters.prompt_time += seconds
        # The pass computes every row as wide as the longest chunk: its cost.
        self.last_prefill_tokens = len(active) * max(len(c) for c in chunks)
        self.last_prefill_seconds = seconds

    def _next(self) -> tuple[list[Any], list[Any]]:
        """mlx-lm's ``next()`` in the phased order (decode, prefill, first tokens)."""
        generated: list[Any] = self.decode()
        prompt: list[Any] = self.prefill()
        generated += self.start_generation()
        return prompt, generated

    def _process(
        self, batch: PromptProcessingBatch, chunks: list[list[int]], finishing: list[int]
    ) -> None:
        """``batch.prompt(chunks)``, and the logits of each ``finishing`` row's last position
        (its own length: chunks are right-padded to the longest) from the same pass. Rows with
        prompt embeddings feed those instead of their tokens (every row then goes in as
        embeddings)."""
        embeddings = self._chunk_embeddings(batch, chunks)
        if not finishing and embeddings is None:
            batch.prompt(chunks)
            return
        for tokens, chunk in zip(batch.tokens, chunks, strict=True):
            tokens += chunk
        lengths = [len(chunk) for chunk in chunks]
        padding = [max(lengths) - length for length in lengths]
        if any(padding):
            inputs = _right_pad_prompts(chunks, max_length=max(lengths))
            for layer in batch.prompt_cache:
                layer.prepare(lengths=lengths, right_padding=padding)
        else:
            inputs = mx.array(chunks)
        given = {} if embeddings is None else {"input_embeddings": embeddings}
        outputs: list[Any] = [layer.state for layer in batch.prompt_cache]
        logits = None
        if finishing:
            split = self._split_model
            assert split is not None
            hidden = split.body(inputs, cache=batch.prompt_cache, **given)
            rows = mx.array(finishing)
            logits = split.head(hidden[rows, mx.array([lengths[r] - 1 for r in finishing])])
            outputs.append(logits)
        else:
            self.model(inputs, cache=batch.prompt_cache, **given)
        mx.eval(outputs)
        if any(padding):
            for layer in batch.prompt_cache:
                layer.finalize()
            mx.eval([layer.state for layer in batch.prompt_cache])
        mx.clear_cache()
        if logits is not None:
            for row, row_logits in zip(finishing, logits, strict=True):
                self._first_logits[batch.uids[row]] = row_logits

    def _chunk_embeddings(
        self, batch: PromptProcessingBatch, chunks: list[list[int]]
    ) -> mx.array | None:
        """The input embeddings of this pass when a row has prompt embeddings (None when none
        does): those rows' next positions, the other rows' tokens embedded as the vision model
        embeds text, right-padded with zeros (padding the cache masks)."""
        held = self.prompt_embeddings
        if not held or not any(uid in held for uid in batch.uids):
            return None
        width = max(len(chunk) for chunk in chunks)
        rows = []
        for uid, tokens, chunk in zip(batch.uids, batch.tokens, chunks, strict=True):
            if uid in held:
                start, embeddings = held[uid]
                offset = len(tokens) - start  # tokens: what the cache holds before this chunk
                row = embeddings[offset : offset + len(chunk)]
            else:
                row = self._embed_tokens(chunk)
            if len(chunk) < width:
                row = mx.concatenate(
                    [row, mx.zeros((width - len(chunk), row.shape[-1]), row.dtype)]
                )
            rows.append(row)
        return mx.stack(rows)

    def _embed_tokens(self, tokens: list[int]) -> mx.array:
        vision = vision_model_of(self.model)
        assert vision is not None  # only a vision model's requests carry prompt embeddings
        return token_embeddings(vision, tokens)


class SplitModel:
    """A model's body (tokens to last hidden states) and head (hidden states to logits), when
    both are reachable and together give the model's own logits (checked once, on the engine
    thread: two forward passes of two tokens). mlx-lm's models keep the body
    as ``model.model`` and the head as ``lm_head`` or the tied embedding's ``as_linear``; a
    model that post-processes logits (soft-capping, scaling) fails the check and keeps its last
    token apart."""

    def __init__(self, body: Callable[..., mx.array], head: Callable[[mx.array], mx.array]):
        self.body = body
        self.head = head

    @classmethod
    def of(cls, model: Any) -> SplitModel | None:
        """Checked once per model object: an engine started again over a loaded model (a
        restart after a failed step, a benchmark's rotations) does not pay the passes again."""
        key = id(model)
        if key not in _CHECKED:
            split = cls._check(model)
            try:
                weakref.finalize(model, _CHECKED.pop, key, None)
            except TypeError:  # no weak references to it: checked each time
                return split
            _CHECKED[key] = split
        return _CHECKED[key]

    @classmethod
    def _check(cls, model: Any) -> SplitModel | None:
        body = getattr(model, "model", None)
        head = getattr(model, "lm_head", None)
        if head is None:
            head = getattr(getattr(body, "embed_tokens", None), "as_linear", None)
        if not callable(body) or not callable(head):
            return None
        split = cls(body, head)
        probe = mx.array([[1, 2]])
        try:
            whole = model(probe, cache=make_prompt_cache(model))[:, -1]
            parts = head(body(probe, cache=make_prompt_cache(model))[:, -1])
            # The same computation up to kernel choice (one position or two through the head,
            # bf16 on a GPU); a soft-capped or scaled head is off by far more than this.
            same = whole.shape == parts.shape and mx.allclose(whole, parts, 1e-2, 1e-3).item()
        except Exception:  # any model that does not split so: the last token stays apart
            return None
        return split if same else None


_CHECKED: dict[int, SplitModel | None] = {}


class _Logits:
    """Stands in for the model in the one forward pass GenerationBatch's constructor runs: the
    logits of the prompts' last tokens, which the prefill pass already made."""

    def __init__(self, logits: mx.array) -> None:
        self._logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self._logits[:, None, :]


def _weight_bytes(model: Any) -> int | None:
    """The bytes of the model's parameters (None for a model that does not list them)."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    return sum(int(v.nbytes) for _, v in tree_flatten(parameters()))


def _has_prompt_left(segments: list[list[int]]) -> bool:
    """More than the last token is left (the last one goes with the final chunk or apart)."""
    return bool(segments) and not _only_last_token(segments)


def _tokens_left(segments: list[list[int]]) -> int:
    """The prompt tokens a sequence has yet to prefill (its last one included)."""
    return sum(len(segment) for segment in segments)


def _one_segment_left(segments: list[list[int]]) -> bool:
    """One segment is left to prefill (the last token apart from it or not)."""
    return len(segments) == 1 or (len(segments) == 2 and _only_last_token(segments[1:]))


def _only_last_token(segments: list[list[int]]) -> bool:
    return len(segments) == 1 and len(segments[0]) == 1
