"""The scheduler: a waiting queue in front of mlx-lm's continuous-batching BatchGenerator.

Engine thread only. Each ``step`` admits waiting requests into the free rows of the prefill
batch (shortest prompt first, with an age bound: ``admission``), reusing prefix-cache hits;
then runs the generator's phases (``phased_generator``): a decode step for running sequences,
every step (stall-free: no prompt freezes streams that were running before it), a prefill
chunk within the step's token budget (``prefill_pace``: about ``max_prefill_stall`` decode
steps' time; with nothing decoding, about ``max_prefill_wait`` seconds; a burst's prefill
alone while every decoding stream is of that burst: ``_burst_slack``), and the first token of
every sequence whose prefill just ended. It turns
each sequence's token into text and, every ``stream_interval`` tokens, a ``RequestOutput``. A
failure in one sequence's processing finishes that sequence with ``finish_reason="error"``; a
failure of the batch step itself fails the sequences in the batch and starts a fresh generator,
leaving waiting requests untouched.

Prefix cache: a request that declares a shared prefix (``prefix_boundary``) is prefilled in two
segments, and the KV state at the end of the first is stored as the prefix's entry as soon as
prefill gets there (whatever becomes of the request). A finished sequence is stored whole,
unless its shared prefix is an entry of its own: that one entry serves every request behind it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import structlog

from mlx_redis_worker.engine.admission import pick_prefill_group
from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.errors import QueueFullError
from mlx_redis_worker.engine.grammar_rows import GrammarBatch, GrammarProcessor
from mlx_redis_worker.engine.output_collector import RequestStreamState
from mlx_redis_worker.engine.phased_generator import PhasedBatchGenerator, SplitModel
from mlx_redis_worker.engine.prefill_pace import PrefillPace
from mlx_redis_worker.engine.prefix_cache import SHARED_PREFIX, Admission, PrefixCache
from mlx_redis_worker.engine.prompt import model_vocab_size
from mlx_redis_worker.engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from mlx_redis_worker.engine.sampling import (
    CategoricalSampler,
    GuardedSampler,
    Sampler,
    build_logits_processors,
    build_sampler,
    build_stop_sequences,
    guard_processor,
)
from mlx_redis_worker.engine.sequence import Sequence, token_logprobs
from mlx_redis_worker.engine.speculative_batch import (
    ModelDrafter,
    SpeculationCounters,
    SpeculativeBatchGenerator,
    SpeculativeSequence,
)
from mlx_redis_worker.engine.stats import (
    PrefixCacheStats,
    RequestProgress,
    SchedulerStats,
    SpeculationStats,
)
from mlx_redis_worker.engine.structured import GrammarCompiler
from mlx_redis_worker.engine.text_stream import TextStream, TokenText, stream_detokenizer
from mlx_redis_worker.engine.token_bytes import TokenBytes
from mlx_redis_worker.engine.vision import vision_model_of
from mlx_redis_worker.engine.vision_queue import VisionQueue

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's outputs, at most one per request."""

    outputs: list[RequestOutput] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: SchedulerConfig | None = None,
        draft_model: Any = None,
    ) -> None:
        self.model = model
        # Drafts for draft_model requests (EngineCore checked that it shares the tokenizer).
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}
        self._requests: dict[str, Sequence] = {}
        self._generator: SpeculativeBatchGenerator | None = None
        self._stream: Any = None
        self._finished: SchedulerOutput = SchedulerOutput()
        self.prefix_cache = (
            PrefixCache(self.config.prefix_cache_max_entries, self.config.prefix_cache_max_bytes)
            if self.config.enable_prefix_cache
            else None
        )
        self.eos_token_ids = sorted(getattr(tokenizer, "eos_token_ids", None) or ())
        self.grammars = GrammarCompiler(
            getattr(tokenizer, "_tokenizer", tokenizer),
            model_vocab_size(model, tokenizer),
            self.config.grammar_limits,
        )
        # The constrained rows of the batch, their masks computed together.
        self.grammar_rows = GrammarBatch(self.grammars.stats, self.grammars.vocab_size)
        self.token_bytes = TokenBytes(tokenizer)
        # Each token's bytes for the requests' detokenizers (see CachedBPEDetokenizer).
        self._token_text: dict[int, TokenText] = {}
        vision = vision_model_of(model)
        # Image requests between admission and their prefill (a vision-language model's).
        self.vision_queue = VisionQueue(vision) if vision is not None else None
        self.num_requests_processed = 0
        self.num_requests_failed = 0
        self.total_prompt_tokens = 0
        self.total_completion_tokens = 0
        self.batch_failures = 0
        self.pace = PrefillPace(
            self.config.max_prefill_stall,
            self.config.min_prefill_tokens,
            self.config.prefill_step_size,
            max_pass_seconds=self.config.max_prefill_pass,
        )
        # When the last decode step's tokens left (monotonic): see _burst_slack.
        self._last_decode = -math.inf
        # When a prompt's pass and a long-context decode batch's are both due: whose turn.
        self._side_turn = True
        # Wall time inside the generator's phases (model, sampling, waiting on the device): the
        # rest of a step's time is the engine's own host work.
        self.model_seconds = 0.0
        self.speculation = SpeculationCounters()

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(
                f"waiting queue full ({self.config.max_waiting_requests} requests); retry later"
            )
        sequence = Sequence(
            request=request,
            text=TextStream(
                stream_detokenizer(self.tokenizer, self._token_text),
                request.sampling_params.stop,
            ),
            stream_state=RequestStreamState(request.stream_interval),
        )
        self.waiting.append(sequence)
        self._requests[request.request_id] = sequence

    def abort_request(
        self, request_id: str, reason: str = "abort", message: str | None = None
    ) -> bool:
        """Finish a waiting or running request now; False when it is not in flight."""
        sequence = self._requests.get(request_id)
        if sequence is None:
            return False
        self._finish(sequence, reason, error=message)
        return True

    def reject(self, request: Request, message: str) -> None:
        """Finish a request that could not be queued with a final ``error`` output."""
        request.status = RequestStatus.FINISHED_ERROR
        request.finish_reason = "error"
        request.error = message
        self._finished.outputs.append(
            RequestOutput(
                request_id=request.request_id,
                finished=True,
                finish_reason="error",
                prompt_tokens=request.num_prompt_tokens,
                error=message,
            )
        )

    def abort_all(self, reason: str = "abort", message: str | None = None) -> SchedulerOutput:
        for sequence in list(self._requests.values()):
            self._finish(sequence, reason, error=message)
        return self._take_finished()

    def has_requests(self) -> bool:
        return bool(self._requests) or bool(self._finished.outputs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Requests holding a decode slot: in the generator, or admitted and waiting for their
        images' encoding."""
        return len(self.running) + (len(self.vision_queue) if self.vision_queue else 0)

    # -- stepping ----------------------------------------------------------------------------

    def attach_stream(self, stream: Any) -> None:
        """Use ``stream`` (made on the engine thread) for all generation from now on; check
        there, once per model, whether prefill passes can yield first-token logits, so that
        the generator the first request makes finds the answer made (not on its path)."""
        self.close()
        self._stream = stream
        with mx.stream(stream):
            SplitModel.of(self.model)

    def step(self) -> SchedulerOutput:
        self._admit()
        self._encode_parked()
        generator = self._generator
        if generator is not None and self.running:
            started = time.perf_counter()
            try:
                generated = []
                decoding = generator.num_decoding > 0
                if generator.has_prefill_work:
                    self.pace.lane = generator.prepare_pass()
                budget = self.pace.budget(decoding)
                if not decoding and generator.has_prefill_work:
                    whole = self._whole_pass(generator, self.config.max_prefill_wait)
                    budget = max(budget, whole)
                if decoding and generator.has_prefill_work:
                    # A burst's step prefills the lane of the prompt it ends, at that lane's
                    # speed (the other lane's pass could take all the slack and end nothing).
                    shortest = generator.shortest_prompt_left
                    fair_lane, self.pace.lane = self.pace.lane, generator.shortest_lane
                    slack = self._burst_slack(self.pace.lane)
                    burst = max(self.pace.burst_budget(slack), self._whole_pass(generator, slack))
                    if shortest is not None and burst >= max(budget, shortest):
                        decoding, budget = False, burst  # this step: the burst's prefill only
                        self.pace.burst_steps += 1
                        generator.prepare_pass(self.pace.lane)
                    else:
                        self.pace.lane = fair_lane
                if decoding:
                    prefill_due = False
                    if generator.has_prefill_work:
                        self.pace.earn(chat=self._chat_prompt_next(generator))
                        budget = self.pace.budget(decoding)
                        prefill_due = budget > 0
                    # One pass beside the steady batch's a step: a prompt's or a long-context
                    # batch's, in turn when both are due (both would stretch it twice).
                    with self.grammar_rows.decoding():
                        generated = generator.decode(sides=not prefill_due or self._side_turn)
                    if prefill_due:
                        # The pass must not be charged for the decode still on the device. In
                        # other steps mlx-lm's overlap of a step's host work with the last
                        # step's compute stays (waiting in every step beside a long prompt
                        # in prefill made the victim's decode steps 13% slower on tiny).
                        generator.wait_for_decode()
                    plan = generator.last_decode_plan
                    # The pace measures the steady batch's step.
                    seconds = time.perf_counter() - started
                    self.pace.observe_decode(seconds * plan.steady_fraction)
                    if prefill_due and not math.isinf(self.config.max_prefill_stall):
                        self._side_turn = plan.side_steps == 0.0
                        if not self._side_turn:
                            budget = 0  # the prompts' pass waits for the next step
                if generator.has_prefill_work:
                    short_floor = self.pace.short_pass_tokens() if decoding else 0
                    prefill = generator.prefill(budget, short_floor)
                    self.pace.observe_prefill(
                        generator.last_prefill_tokens, generator.last_prefill_seconds
                    )
                    if decoding:
                        self.pace.spend(generator.last_prefill_seconds)
                    self._store_prefixes(generator, prefill)
                generated += generator.start_generation()
            except Exception as exc:
                self._fail_batch(exc)
                return self._take_finished()
            finally:
                self.model_seconds += time.perf_counter() - started
            logprobs = self._logprobs_of(generated)
            for index, response in enumerate(generated):
                sequence = self.running.get(response.uid)
                if sequence is not None:
                    self._on_token(sequence, response, logprobs.get(index))
            if decoding:
                self._last_decode = time.monotonic()
            for sequence in [s for s in self.running.values() if s.failure is not None]:
                self._finish(sequence, "error", error=_describe(sequence.failure))
        return self._take_finished()

    def _whole_pass(self, generator: PhasedBatchGenerator, slack: float) -> int:
        """The tokens of one pass that ends every short prompt in prefill (each row's chunk
        up to ``prefill_step_size``, as mlx-lm's), where the measured speed says it takes at
        most ``slack`` seconds; 0 otherwise, or when the pass is the long lane's.

        Prompts that start decoding together finish together. Bounded by time alone (a pass
        of ``max_prefill_pass``, a burst step of at most a chunk in all), a burst of 128
        short prompts on an H100 (8B) started in three groups: its first streams waited
        for the others' prefill in their decode window, and the groups left the batch apart
        (9 partial cache removals instead of one). A request arriving meanwhile waits for
        this pass, at most ``slack`` (``max_prefill_wait`` with nothing decoding, the
        burst's own slack in a burst step); long prompts keep the time bound."""
        if self.pace.lane != 0:
            return 0
        tokens = generator.pass_ending_short_lane()
        return tokens if tokens and self.pace.seconds_for(tokens) <= slack else 0

    def _chat_prompt_next(self, generator: PhasedBatchGenerator) -> bool:
        """Whether the next pass prefills the short lane and can end a prompt there within
        a short pass (``PrefillPace.short_pass_tokens``): a chat-size prompt. Not while a
        long prompt is in prefill: the credit is the lanes' to share, and the long lane's
        passes would spend the chat's share (smollm2, a victim beside four 2,300-token
        prompts kept 0.66 of its speed alone with it, 0.91 without)."""
        left = generator.shortest_prompt_left
        return (
            self.pace.lane == 0
            and not generator.long_prompts_in_prefill
            and left is not None
            and left <= self.pace.short_pass_tokens()
        )

    def _burst_slack(self, burst_lane: int) -> float:
        """Seconds this step's prefill may take with no decode beside it, prefilling
        ``burst_lane`` (the generator's ``shortest_lane``).

        A burst: requests that queued together. A decoding stream and a prompt now in prefill
        are of one burst when the prompt was still waiting to start its prefill while the
        stream was still waiting for its first token (it arrived before that first token, and
        the stream arrived before its prefill started): the stream is ahead only by the order
        in which the burst's prompts were taken, and may wait up to ``max_prefill_wait`` from
        its last token for the rest of the burst. A stream that was already streaming when a
        prompt arrived, or arrived while that prompt was already in prefill, is protected by
        the stall bound: then the slack is negative, and the step decodes.

        Which rows the pass takes is the generator's choice: the scheduler asks for a burst
        step only when the pass can end a prompt (``shortest_prompt_left``), so a long prompt
        that no pass finishes gets the stall bound's chunks, whoever arrived first."""
        newest_arrival = -math.inf
        first_start = math.inf
        # Only the prompts of the lane the burst's pass prefills: another tenant's long
        # prompt in the other lane, in prefill since before this burst, is not of it (it kept
        # every chat burst beside it from its burst steps: half the burst's prompts waited for
        # the stall credit).
        for sequence in self.running.values():
            if sequence.request.first_token_time is None and (
                self._in_long_lane(sequence) == bool(burst_lane)
            ):
                newest_arrival = max(newest_arrival, sequence.request.arrival_time)
                first_start = min(first_start, sequence.prefill_started)
        last_token = math.inf  # the longest-waiting decoding stream's last token
        for sequence in self.running.values():
            request = sequence.request
            first = request.first_token_time
            if first is None:
                continue
            if first < newest_arrival or request.arrival_time > first_start:
                return -1.0
            if len(request.transcript.token_ids) > 1:
                # It has streamed: from its second token on the stall bound protects it, so a
                # prompt that queued beside it (another tenant's, say) cannot hold it a second
                # time.
                return -1.0
            # A stream that decoded since its first token got a token in the last decode (the
            # decode right after a join feeds the first token back: one step early, at most).
            last_token = min(last_token, max(first, self._last_decode))
        return self.config.max_prefill_wait - (time.monotonic() - last_token)

    def _admit(self) -> None:
        """Fill the prefill batch's free rows (``prefill_batch_size``) from the waiting queue,
        choosing as late as that: a short prompt that arrived meanwhile goes first, and one
        long prompt in prefill (its chunks bounded while others decode) does not hold back
        the short ones behind it."""
        prefilling = self._generator.num_prefilling if self._generator is not None else 0
        # Prompts of more than a chunk prefill in a lane of their own (``PromptLane``), each
        # lane ``prefill_batch_size`` rows: a short prompt arriving behind four 30k-token
        # prompts of one tenant neither waits for a row nor rides in their passes.
        long_tokens = self.config.prefill_step_size
        long_prefilling = sum(
            1
            for s in self.running.values()
            if s.request.first_token_time is None and self._in_long_lane(s)
        )
        lane_rows = self.config.prefill_batch_size
        long_room = lane_rows - long_prefilling
        short_room = lane_rows - max(0, prefilling - long_prefilling)
        group = pick_prefill_group(
            self.waiting,
            min(self.config.max_num_seqs - self.num_running, long_room + short_room),
            time.monotonic(),
            self.config.max_prefill_wait,
            length=lambda s: s.request.num_prompt_tokens,
            arrival=lambda s: s.request.arrival_time,
            long_room=long_room,
            long_tokens=long_tokens,
            short_room=short_room,
        )
        for sequence in group:
            self.waiting.remove(sequence)
            try:
                self._insert(sequence)
            except Exception as exc:
                self._finish(sequence, "error", error=_describe(exc))

    def _in_long_lane(self, sequence: Sequence) -> bool:
        """Whether a started sequence's prompt prefills in the long lane (``PromptLane``): more
        than a chunk of it was not in the prefix cache."""
        request = sequence.request
        return request.num_prompt_tokens - request.cached_tokens > self.config.prefill_step_size

    def _insert(self, sequence: Sequence) -> None:
        request = sequence.request
        prompt = request.prompt_token_ids
        admission = (
            self.prefix_cache.admit(prompt, request.prefix_boundary, request.cache_key)
            if self.prefix_cache
            else Admission.uncached(prompt)
        )
        if request.vision is not None and request.vision.needs_encoding(admission.cached_tokens):
            assert self.vision_queue is not None  # EngineCore refuses images without a model
            request.status = RequestStatus.RUNNING
            self.vision_queue.park(sequence, admission)
            return
        self._start(sequence, admission)

    def _encode_parked(self) -> None:
        """Encode the images of parked requests, a prefill chunk's worth of image tokens a step
        (at least one request), and start their prefill."""
        if not self.vision_queue:
            return
        for encoded in self.vision_queue.encode(self.config.prefill_step_size):
            sequence = encoded.sequence
            try:
                if encoded.error is not None:
                    raise encoded.error
                assert encoded.embeddings is not None
                self._start(sequence, encoded.admission)
                assert self._generator is not None and sequence.uid is not None
                embeddings = (encoded.start, encoded.embeddings)
                self._generator.prompt_embeddings[sequence.uid] = embeddings
            except Exception as exc:
                self._finish(sequence, "error", error=_describe(exc))

    def _start(self, sequence: Sequence, admission: Admission) -> None:
        """Insert an admitted sequence into the generator: its prefill starts."""
        request = sequence.request
        params = request.sampling_params
        prompt = request.prompt_token_ids
        request.cached_tokens = admission.cached_tokens
        sequence.prefix_pending = admission.stores_prefix
        sampler: Sampler | None = build_sampler(params)
        processors = build_logits_processors(params) + list(params.logits_processors or ())
        if request.grammar is not None:
            # Last: the mask applies to the logits every other processor has shaped.
            assert params.response_format is not None  # what request.grammar was compiled from
            sequence.grammar = GrammarProcessor(
                self.grammars, self.grammar_rows, request.grammar, params.response_format.subject
            )
            processors.append(sequence.grammar)
            sampler = sequence.grammar.sampler(sampler)
        generator = self._ensure_generator()
        (uid,) = generator.insert_segments(
            [admission.segments],
            max_tokens=[params.max_tokens],
            caches=[admission.cache],
            all_tokens=[prompt[: admission.cached_tokens]],
            samplers=[GuardedSampler(sampler, sequence.fail) if sampler else None],
            logits_processors=[[guard_processor(p, sequence.fail) for p in processors]],
            stop_sequences=[build_stop_sequences(self.eos_token_ids, params)],
        )
        sequence.uid = uid
        if sequence.prefix_pending:
            # The prefix is stored as mlx-lm keeps prompts: all but the last token cached.
            generator.last_token_apart.add(uid)
        speculative = params.speculative
        # Logits processors (penalties, a grammar) see one position per step: no drafts.
        if (
            speculative is not None
            and not processors
            and (sampler is None or isinstance(sampler, CategoricalSampler))
        ):
            drafter = None
            if speculative.method == "draft_model":
                # EngineCore refuses draft_model requests on an engine without a draft.
                assert self.draft_model is not None
                drafter = ModelDrafter(self.draft_model)
            generator.speculate(
                uid,
                SpeculativeSequence(
                    speculative.num_draft_tokens, sampler, sequence.fail, drafter=drafter
                ),
            )
        request.status = RequestStatus.RUNNING
        sequence.prefill_started = time.monotonic()
        self.running[uid] = sequence

    def _store_prefixes(self, generator: PhasedBatchGenerator, prefill: list[Any]) -> None:
        """Store the KV state of each shared prefix that this step's prefill completed. The
        generator reports the end of a prompt segment without a token: nothing to stream."""
        uids = [
            r.uid
            for r in prefill
            if r.end_of_segment and r.uid in self.running and self.running[r.uid].prefix_pending
        ]
        if not uids or self.prefix_cache is None:
            return
        for uid, (cache, tokens) in generator.extract_cache(uids).items():
            sequence = self.running[uid]
            sequence.prefix_pending = False
            try:
                key = sequence.request.cache_key_of(list(tokens))
                self.prefix_cache.store(key, cache, SHARED_PREFIX)
            except Exception as exc:
                sequence.fail(exc)

    def _logprobs_of(self, generated: list[Any]) -> dict[int, TokenLogprob]:
        """The logprobs of each token in ``generated`` (by its index there) whose request asked
        for them, computed together (``token_logprobs``); a failure fails those sequences."""
        wanted: list[tuple[int, Sequence, tuple[mx.array, int, int]]] = []
        for index, response in enumerate(generated):
            sequence = self.running.get(response.uid)
            # A "stop" is a stop token, not output (``_on_token``).
            if sequence is None or response.finish_reason == "stop":
                continue
            top = sequence.request.sampling_params.logprobs
            if top is not None:
                wanted.append((index, sequence, (response.logprobs, int(response.token), top)))
        if not wanted:
            return {}
        try:
            entries = token_logprobs([row for _, _, row in wanted], self.token_bytes)
        except Exception as exc:
            for _, sequence, _ in wanted:
                sequence.fail(exc)
            return {}
        return {index: entry for (index, _, _), entry in zip(wanted, entries, strict=True)}

    def _on_token(
        self, sequence: Sequence, response: Any, logprob: TokenLogprob | None = None
    ) -> None:
        # Runs for every token of every sequence: kept to the few operations each token needs.
        request = sequence.request
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        reason = response.finish_reason  # not None: the generator has let the sequence go
        try:
            stopped_by_text = False
            # A "stop" from the generator is a stop token (EOS or stop_token_ids): not output.
            if reason != "stop":
                token = int(response.token)
                transcript = request.transcript
                transcript.token_ids.append(token)
                if logprob is not None:
                    sequence.pending_logprobs.append(logprob)
                text = sequence.text.add_token(token)
                if text:
                    transcript.text_parts.append(text)
                stopped_by_text = sequence.text.stopped
            if reason is not None and response.prompt_cache:
                self._remember(request, list(response.all_tokens), response.prompt_cache)
        except Exception as exc:
            sequence.fail(exc)
        if sequence.failure is not None:
            self._finish(
                sequence, "error", error=_describe(sequence.failure), in_generator=reason is None
            )
        elif reason is not None:
            self._finish(sequence, reason, in_generator=False)
        elif stopped_by_text:
            self._finish(sequence, "stop")
        elif not getattr(response, "more", False) and sequence.stream_state.should_send(
            len(request.transcript.token_ids), False
        ):
            self._emit(sequence)

    # -- finishing ---------------------------------------------------------------------------

    def _finish(
        self,
        sequence: Sequence,
        reason: str,
        error: str | None = None,
        in_generator: bool = True,
    ) -> None:
        request = sequence.request
        if sequence.grammar is not None:
            sequence.grammar.close()
        if sequence.uid is not None:
            self.running.pop(sequence.uid, None)
            if in_generator and self._generator is not None:
                # Only a sequence past its prefill has a cache that is whole (no batch padding).
                decoding = request.first_token_time is not None
                keep = decoding and reason in ("stop", "abort")
                self._release_from_generator(sequence, keep_cache=keep)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        elif self.vision_queue is not None:
            self.vision_queue.discard(sequence)
        self._requests.pop(request.request_id, None)
        if reason != "error":
            text = sequence.text.finish()
            if text:
                request.transcript.text_parts.append(text)
        request.status = RequestStatus.for_finish_reason(reason)
        request.finish_reason = reason
        request.error = error
        self.num_requests_processed += 1
        self.num_requests_failed += reason == "error"
        self.total_prompt_tokens += request.num_prompt_tokens
        self.total_completion_tokens += request.num_output_tokens
        if error is not None:
            log.warning("request_failed", request_id=request.request_id, error=error)
        self._emit(sequence, finished=True)

    def _release_from_generator(self, sequence: Sequence, keep_cache: bool) -> None:
        assert self._generator is not None and sequence.uid is not None
        store = keep_cache and self.prefix_cache is not None
        caches = self._generator.remove([sequence.uid], return_prompt_caches=store)
        if store and sequence.uid in caches:
            cache, tokens = caches[sequence.uid]
            self._remember(sequence.request, list(tokens), cache)

    def _remember(self, request: Request, tokens: list[int], cache: list[Any]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.store_finished(
                request.cache_key, request.prefix_boundary, request.cache_key_of(tokens), cache
            )

    def _fail_batch(self, exc: BaseException) -> None:
        """The batch step itself failed: fail what was in it and start over with a fresh one."""
        self.batch_failures += 1
        log.error("batch_step_failed", error=_describe(exc), running=len(self.running))
        generator, self._generator = self._generator, None
        for sequence in list(self.running.values()):
            self._finish(
                sequence, "error", error=f"batch step failed: {_describe(exc)}", in_generator=False
            )
        if generator is not None:
            generator.close()

    def _emit(self, sequence: Sequence, finished: bool = False) -> None:
        self._finished.outputs.append(sequence.output(finished))

    def _take_finished(self) -> SchedulerOutput:
        finished, self._finished = self._finished, SchedulerOutput()
        return finished

    def _ensure_generator(self) -> SpeculativeBatchGenerator:
        if self._generator is None:
            self._generator = SpeculativeBatchGenerator(
                self.model,
                counters=self.speculation,
                max_batch=self.config.speculative_max_batch,
                completion_batch_size=self.config.max_num_seqs,
                prefill_batch_size=self.config.prefill_batch_size,
                prefill_step_size=self.config.prefill_step_size,
                max_kv_size=self.config.max_kv_size,
                stream=self._stream,
                decode_share=self.config.max_prefill_stall,
            )
        return self._generator

    # -- caches and stats --------------------------------------------------------------------

    def clear_prefix_cache(self) -> dict[str, int]:
        return self.prefix_cache.clear() if self.prefix_cache else {"entries": 0, "bytes": 0}

    def cache_stats(self) -> PrefixCacheStats | None:
        return self.prefix_cache.stats() if self.prefix_cache else None

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_waiting=self.num_waiting,
            num_running=self.num_running,
            num_requests_processed=self.num_requests_processed,
            num_requests_failed=self.num_requests_failed,
            total_prompt_tokens=self.total_prompt_tokens,
            total_completion_tokens=self.total_completion_tokens,
            batch_failures=self.batch_failures,
            model_seconds=self.model_seconds,
            speculation=SpeculationStats.of(self.speculation),
            vision=self.vision_queue.stats() if self.vision_queue is not None else None,
            prefill_pace=self.pace.stats(),
        )

    def open_requests(self) -> tuple[RequestProgress, ...]:
        """Waiting and running requests (any thread: reads a copy of the table)."""
        now = time.monotonic()
        return tuple(s.progress(now) for s in list(self._requests.values()))

    def close(self) -> None:
        """Drop the generator (engine thread); requests must have been finished first."""
        generator, self._generator = self._generator, None
        if generator is not None:
            generator.close()


def _describe(exc: BaseException | None) -> str:
    return f"{type(exc).__name__}: {exc}" if exc is not None else "unknown error"
