"""A request in flight inside the scheduler, and the outputs it streams.

Engine thread only, except ``progress`` (a read for stats).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx

from mlx_redis_worker.engine.grammar_rows import GrammarProcessor
from mlx_redis_worker.engine.output_collector import RequestStreamState
from mlx_redis_worker.engine.request import Request, RequestOutput, TokenLogprob
from mlx_redis_worker.engine.stats import RequestProgress
from mlx_redis_worker.engine.structured import GrammarLimitError
from mlx_redis_worker.engine.text_stream import TextStream
from mlx_redis_worker.engine.token_bytes import TokenBytes


@dataclass(eq=False, slots=True)
class Sequence:
    """A request, its text stream and how much of it the outputs so far have carried."""

    request: Request
    text: TextStream
    stream_state: RequestStreamState
    uid: int | None = None  # in mlx-lm's BatchGenerator, once admitted
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    failure: BaseException | None = None
    # Prefill has yet to reach the end of the shared prefix, whose state is then stored.
    prefix_pending: bool = False
    # The response_format's matcher, once admitted: whether the output is complete.
    grammar: GrammarProcessor | None = None
    # When its prefill started (monotonic; inserted into the generator): see
    # Scheduler._burst_slack.
    prefill_started: float = 0.0

    def fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc

    def output(self, finished: bool = False) -> RequestOutput:
        """The output carrying what was produced since the previous one."""
        request = self.request
        transcript = request.transcript
        state = self.stream_state
        completion = len(transcript.token_ids)
        parts = len(transcript.text_parts)
        first = request.first_token_time
        decode_seconds = time.monotonic() - first if first is not None else 0.0
        logprobs = None
        if request.sampling_params.logprobs is not None:
            logprobs, self.pending_logprobs = self.pending_logprobs, []
        output = RequestOutput(
            request_id=request.request_id,
            new_text="".join(transcript.text_parts[state.sent_text_parts : parts]),
            new_token_ids=transcript.token_ids[state.sent_tokens : completion],
            finished=finished,
            finish_reason=request.finish_reason if finished else None,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=completion,
            cached_tokens=request.cached_tokens,
            ttft=first - request.arrival_time if first is not None else None,
            tokens_per_second=(
                max(completion - 1, 0) / decode_seconds if decode_seconds > 0 else 0.0
            ),
            logprobs=logprobs,
            error=request.error if finished else None,
            request_fault=finished and isinstance(self.failure, GrammarLimitError),
            output_valid=self._valid() if finished else None,
            stop_reason=self.text.stop_string if finished else None,
            transcript=transcript,
            text_parts=parts,
        )
        state.mark_sent(completion, parts)
        return output

    def _valid(self) -> bool | None:
        """A constrained request's output matches its format when it ended by the grammar's
        own end (the mask allowed EOS only there), or when max_tokens cut it exactly where a
        match is complete; aborted or failed, not."""
        if self.request.sampling_params.response_format is None:
            return None
        return (
            self.grammar is not None
            and self.request.finish_reason in ("stop", "length")
            and self.failure is None
            and self.grammar.matches(self.request.transcript.token_ids)
        )

    def progress(self, now: float) -> RequestProgress:
        request = self.request
        return RequestProgress(
            request_id=request.request_id,
            status=request.status.value,
            prompt_tokens=request.num_prompt_tokens,
            completion_tokens=request.num_output_tokens,
            cached_tokens=request.cached_tokens,
            age_seconds=now - request.arrival_time,
        )


def token_logprobs(
    rows: list[tuple[mx.array, int, int]], token_bytes: TokenBytes | None = None
) -> list[TokenLogprob]:
    """For each row (its log-probabilities over the vocabulary, the sampled token, how many
    top alternatives): the token's logprob and, for a top > 0, the top likeliest tokens', with
    their bytes when ``token_bytes`` is given. All rows in one evaluation: row by row, each
    token cost four device round trips and an ``argpartition`` of its own (tiny, every request
    asking for 20: 0.81-0.85 of the tok/s without, against 0.89-0.97 together)."""
    stacked = mx.stack([logprobs for logprobs, _, _ in rows])
    tokens = mx.array([[token] for _, token, _ in rows])
    chosen = mx.take_along_axis(stacked, tokens, axis=-1)[:, 0]
    most = min(max(top for _, _, top in rows), stacked.shape[-1])
    tops: list[tuple[list[int], list[float]]]
    if most == 0:  # `logprobs` without alternatives: no partition of the vocabulary
        mx.eval(chosen)
        tops = [([], [])] * len(rows)
    else:
        indices = mx.argpartition(-stacked, kth=most - 1, axis=-1)[:, :most]
        values = mx.take_along_axis(stacked, indices, axis=-1)
        mx.eval(chosen, indices, values)
        tops = list(
            zip(
                cast(list[list[int]], indices.tolist()),
                cast(list[list[float]], values.tolist()),
                strict=True,
            )
        )
    entries = []
    for (_, token, top), logprob, (ids, row_values) in zip(
        rows, cast(list[float], chosen.tolist()), tops, strict=True
    ):
        # The row's ``most`` likeliest hold its ``top`` likeliest: sorted, the first ones.
        best = sorted(zip(ids, row_values, strict=True), key=lambda pair: -pair[1])[:top]
        entry = TokenLogprob(token_id=token, logprob=logprob, top_logprobs=best)
        if token_bytes is not None:
            entry.token_bytes = token_bytes(token)
            entry.top_token_bytes = [token_bytes(alternative) for alternative, _ in best]
        entries.append(entry)
    return entries
