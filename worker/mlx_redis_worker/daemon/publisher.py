"""Engine outputs → protocol events → Redis, one round trip per engine step.

The engine calls ``on_step`` once per step with every streamed output; the events it makes are
drafts until a flush gives them their ``seq`` and sends them all through the PUBLISH_EVENTS
script, which appends each to its request's log and publishes it on its channel: one call per
step on a single server (redis-py's packing and parsing cost per command, not per byte), one
per node on a Redis Cluster, pipelined. When Redis fails the flush keeps the numbered
batch and sends it again with backoff; the script writes nothing twice, so a batch that ran
before its reply was lost is harmless. Meanwhile new deltas of a request merge into its unsent
delta, so the buffer stays one delta plus one terminal event per request and no token and no
terminal event is lost. A slow subscriber costs nothing here: Redis buffers pub/sub output
per client.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import structlog

from mlx_redis_protocol.activity import RequestActivity
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    ResetEvent,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from mlx_redis_protocol.redis_retry import retry_until_done
from mlx_redis_protocol.replay_log import Outcome, publish_events
from mlx_redis_worker.daemon.activity import TokenHistory
from mlx_redis_worker.engine import RequestOutput
from mlx_redis_worker.engine.output_parser import OutputParser, Split

log = structlog.get_logger(__name__)

# Vector bytes per ``embedding`` event: a job's many vectors leave in events of at most this
# much, well under the protocol's 1 MiB message limit.
EMBEDDING_EVENT_BYTES = 256 * 1024


@dataclass(slots=True)
class _Stream:
    """Publishing state of one request attempt."""

    request_id: str
    attempt: int
    run: str  # the token BEGIN_ATTEMPT fenced the request with for this run
    next_seq: int
    metadata: Mapping[str, Any] | None
    # When the producer queued the job (epoch seconds, Redis' clock: its entry id) and when
    # this attempt opened (this host's clock): usage timings count from the arrival.
    arrival: float
    opened: float
    written: asyncio.Future[None]
    model: str | None = None  # the fleet's name of the model running it (for on_done)
    tokens: int = 0  # completion tokens this attempt streamed so far
    # Prompt tokens the engine computed for it (not found in the prefix cache): with
    # ``tokens``, the request's service, what fair share charges its tenant.
    prefill: int = 0
    # Splits the text into content, reasoning and tool calls (None: text as it is).
    parser: OutputParser | None = None


@dataclass(slots=True)
class _Draft:
    """An event waiting for its seq; deltas of one request merge while unsent."""

    stream: _Stream
    kind: str
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)

    def merge(self, split: Split) -> None:
        """Add a delta's pieces; a call's arguments pieces join while unsent."""
        self.new_text += split.content
        self.reasoning += split.reasoning
        for piece in split.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == piece.index and piece.name is None:
                self.tool_calls[-1] = replace(last, arguments=last.arguments + piece.arguments)
            else:
                self.tool_calls.append(piece)

    @property
    def terminal(self) -> bool:
        return self.kind in ("done", "error")

    def to_event(self, seq: int) -> Event:
        common: dict[str, Any] = {
            "request_id": self.stream.request_id,
            "seq": seq,
            "attempt": self.stream.attempt,
        }
        if self.kind == "delta":
            return DeltaEvent(
                **common,
                new_text=self.new_text,
                new_token_ids=tuple(self.new_token_ids),
                logprobs=tuple(self.logprobs) if self.logprobs is not None else None,
                reasoning=self.reasoning,
                tool_calls=tuple(self.tool_calls),
            )
        if self.kind == "reset":
            return ResetEvent(**common)
        if self.kind == "embedding":
            return EmbeddingEvent(**common, **self.fields)
        if self.kind == "done":
            return DoneEvent(**common, metadata=self.stream.metadata, **self.fields)
        return ErrorEvent(**common, metadata=self.stream.metadata, **self.fields)


@dataclass(frozen=True, slots=True)
class PublisherStats:
    steps: int  # engine steps whose outputs were handed over
    round_trips: int  # flushes (one script call per node on a Cluster each)
    events_published: int
    redis_failures: int  # flushes that failed and were sent again
    fenced: int  # requests whose events a newer attempt refused
    log_gaps: int  # requests whose log lost events this attempt wrote
    pending_events: int
    open_streams: int


class AttemptLost(Exception):
    """Raised by a request's ``written`` future when its attempt is over without a terminal
    event of ours: a newer attempt took the request over (``Outcome.FENCED``: we stalled past
    the lease, or the lease was lost) or its log lost events this attempt wrote
    (``Outcome.LOG_GAP``: a failover). Publish nothing more, do not acknowledge: the job is
    reclaimed after its lease and runs again as a new attempt, which starts with a reset."""

    def __init__(self, request_id: str, outcome: Outcome) -> None:
        super().__init__(f"attempt of {request_id} lost: {outcome.name}")
        self.request_id = request_id
        self.outcome = outcome


class EventPublisher:
    def __init__(
        self,
        *,
        redis: RedisClient,
        keys: Keys,
        log_ttl: int,
        on_done: Callable[[str | None, Usage], None] | None = None,
    ) -> None:
        """``on_done`` observes each done event's model and usage (metrics); a plain hook, so
        the publisher knows nothing of who listens."""
        self.redis = redis
        self.keys = keys
        self.log_ttl = log_ttl
        self.on_done = on_done
        # Observes each request's service when its publishing ends (finished, abandoned or
        # lost): the prompt tokens computed and the tokens generated, what fair share charges
        # its tenant.
        self.on_closed: Callable[[str, int], None] | None = None
        self.token_history = TokenHistory()
        self._streams: dict[str, _Stream] = {}
        self._drafts: list[_Draft] = []
        self._unsent_delta: dict[str, _Draft] = {}
        self._failed: list[tuple[_Draft, Event]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.steps = 0
        self.round_trips = 0
        self.events_published = 0
        self.redis_failures = 0
        self.fenced = 0
        self.log_gaps = 0

    # -- requests ----------------------------------------------------------------------------

    def open(
        self,
        request_id: str,
        attempt: int,
        run: str,
        first_seq: int,
        metadata: Mapping[str, Any] | None,
        *,
        arrival: float | None = None,
        model: str | None = None,
    ) -> asyncio.Future[None]:
        """Start publishing a request (its attempt begun with ``run``; ``arrival`` when its job
        was queued, default now). The future resolves once its terminal event is in Redis,
        raises ``AttemptLost`` when Redis refused the attempt's events, and is cancelled when
        the request is abandoned."""
        now = time.time()
        stream = _Stream(
            request_id=request_id,
            attempt=attempt,
            run=run,
            next_seq=first_seq,
            metadata=metadata,
            arrival=now if arrival is None else arrival,
            opened=now,
            written=asyncio.get_running_loop().create_future(),
            model=model,
        )
        self._streams[request_id] = stream
        return stream.written

    def split_output(self, request_id: str, parser: OutputParser) -> None:
        """Publish the request's text split by ``parser`` (content, reasoning, tool calls)."""
        self._streams[request_id].parser = parser

    def reset(self, request_id: str) -> None:
        self._add(_Draft(self._streams[request_id], "reset"))

    def error(self, request_id: str, code: str, message: str) -> None:
        self._add(
            _Draft(self._streams[request_id], "error", fields={"code": code, "message": message})
        )

    def done(
        self,
        request_id: str,
        finish_reason: str,
        output: RequestOutput | None = None,
        *,
        prompt_tokens: int = 0,
    ) -> None:
        """The request's ``done``; ``output`` is None for a job that never started (expired,
        aborted while it waited, or only counted: ``prompt_tokens``), whose other usage is
        all zero."""
        stream = self._streams[request_id]
        usage = _usage(stream, output) if output is not None else Usage(prompt_tokens, 0)
        fields: dict[str, Any] = {
            "finish_reason": finish_reason,
            "output_text": output.output_text if output else "",
            "usage": usage,
            "output_valid": output.output_valid if output else None,
            "stop_sequence": output.stop_reason if output else None,
        }
        if stream.parser is not None and output is not None:
            fields["output_text"] = stream.parser.content
            fields["reasoning_text"] = stream.parser.reasoning
            fields["tool_calls"] = tuple(stream.parser.calls)
        self._add(_Draft(stream, "done", fields=fields))
        if self.on_done is not None:
            # Called from the engine's step listener: an observer's bug must not cost the
            # step's other outputs.
            try:
                self.on_done(stream.model, usage)
            except Exception:
                log.exception("on_done_observer_failed")

    def abandon(self, request_id: str, lost: Outcome | None = None) -> None:
        """Stop publishing a request without a terminal event: at shutdown (it will be re-run;
        its future is cancelled), or because its attempt was ``lost`` (see ``AttemptLost``)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self._closed(stream)
        self._drafts = [d for d in self._drafts if d.stream is not stream]
        self._unsent_delta.pop(request_id, None)
        if stream.written.done():
            return
        if lost is None:
            stream.written.cancel()
        else:
            stream.written.set_exception(AttemptLost(request_id, lost))

    def on_step(self, outputs: list[RequestOutput]) -> None:
        """Engine step listener (event loop thread)."""
        self.steps += 1
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.embeddings is not None:
                # An embedding job's service (what fair share charges) is its inputs' tokens.
                stream.tokens = output.prompt_tokens
                self._add_embeddings(stream, output.embedding_index, output.embeddings)
            else:
                stream.prefill = max(output.prompt_tokens - output.cached_tokens, 0)
            stream.tokens += len(output.new_token_ids)
            self.token_history.add(len(output.new_token_ids))
            split = Split(content=output.new_text)
            if stream.parser is not None:
                split = stream.parser.feed(output.new_text)
                if output.finished:
                    split.add(stream.parser.finish())
            if output.new_token_ids or split.content or split.reasoning or split.tool_calls:
                self._add_delta(output, split)
            if output.finished:
                if output.finish_reason == "error":
                    # A request refused while it ran (its format over a limit) is the job's
                    # fault, as when refused up front.
                    code = "invalid_job" if output.request_fault else "engine_error"
                    self.error(output.request_id, code, output.error or "engine error")
                else:
                    self.done(output.request_id, output.finish_reason or "stop", output)

    # -- sending -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Flush forever; cancel to stop (``drain`` first to send what is pending). Restartable:
        a run that failed left its events pending, and the next one sends them first."""
        self._wake.set()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._failed or self._drafts:
                await retry_until_done(
                    self._flush_once,
                    "publish",
                    on_failure=self._count_failure,
                    pending=len(self._failed) + len(self._drafts),
                )
            self._idle.set()

    async def _count_failure(self, exc: Exception) -> None:
        self.redis_failures += 1

    async def drain(self, timeout: float) -> bool:
        """Wait until everything queued so far is in Redis; False on timeout."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return self._idle.is_set() and not self._drafts and not self._failed

    def running(self) -> list[RequestActivity]:
        """The requests being published now, with their tokens so far (for the activity key)."""
        return [
            RequestActivity(
                request_id=stream.request_id,
                model=stream.model,
                attempt=stream.attempt,
                tokens=stream.tokens,
                started_at=stream.opened,
            )
            for stream in self._streams.values()
        ]

    def stats(self) -> PublisherStats:
        return PublisherStats(
            steps=self.steps,
            round_trips=self.round_trips,
            events_published=self.events_published,
            redis_failures=self.redis_failures,
            fenced=self.fenced,
            log_gaps=self.log_gaps,
            pending_events=len(self._drafts) + len(self._failed),
            open_streams=len(self._streams),
        )

    async def _flush_once(self) -> None:
        batch = self._failed or self._number(self._take_drafts())
        self._failed = batch  # until Redis confirms it, it is the batch to resend
        runs = {draft.stream.request_id: draft.stream.run for draft, _ in batch}
        outcomes = await self._send([event for _, event in batch], runs)
        self._failed = []
        self.round_trips += 1
        self.events_published += len(batch)
        lost: dict[str, Outcome] = {}
        for (draft, event), outcome in zip(batch, outcomes, strict=True):
            if outcome is not Outcome.LOGGED:
                lost.setdefault(event.request_id, outcome)
            elif draft.terminal:
                self._finish(draft.stream)
        for request_id, outcome in lost.items():
            if outcome is Outcome.FENCED:  # a newer attempt owns the log: this one lost the job
                self.fenced += 1
                log.warning("events_fenced", request_id=request_id)
            else:  # Redis lost events of this attempt (a failover): it must start over
                self.log_gaps += 1
                log.warning("log_lost_events", request_id=request_id)
            self.abandon(request_id, lost=outcome)

    async def _send(self, events: list[Event], runs: Mapping[str, str]) -> list[Outcome]:
        """One round trip (one script call per node on a Cluster, pipelined)."""
        return await publish_events(
            self.redis, self.keys, events, ttl_seconds=self.log_ttl, runs=runs
        )

    def _take_drafts(self) -> list[_Draft]:
        drafts, self._drafts = self._drafts, []
        self._unsent_delta.clear()
        return drafts

    def _number(self, drafts: list[_Draft]) -> list[tuple[_Draft, Event]]:
        numbered = []
        for draft in drafts:
            numbered.append((draft, draft.to_event(draft.stream.next_seq)))
            draft.stream.next_seq += 1
        return numbered

    def _finish(self, stream: _Stream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self._closed(stream)
        if not stream.written.done():
            stream.written.set_result(None)

    def _closed(self, stream: _Stream) -> None:
        if self.on_closed is not None:
            try:
                self.on_closed(stream.request_id, stream.tokens + stream.prefill)
            except Exception:
                log.exception("on_closed_observer_failed")

    def _add_delta(self, output: RequestOutput, split: Split) -> None:
        pending = self._unsent_delta.get(output.request_id)
        logprobs = (
            [
                TokenLogprob(
                    lp.token_id,
                    lp.logprob,
                    tuple(lp.top_logprobs),
                    lp.token_bytes,
                    tuple(lp.top_token_bytes) if lp.top_token_bytes is not None else None,
                )
                for lp in output.logprobs
            ]
            if output.logprobs is not None
            else None
        )
        if pending is not None:
            pending.merge(split)
            pending.new_token_ids.extend(output.new_token_ids)
            if logprobs is not None:
                pending.logprobs = (pending.logprobs or []) + logprobs
            return
        draft = _Draft(
            self._streams[output.request_id],
            "delta",
            new_token_ids=list(output.new_token_ids),
            logprobs=logprobs,
        )
        draft.merge(split)
        self._add(draft)
        self._unsent_delta[output.request_id] = draft

    def _add_embeddings(self, stream: _Stream, index: int, vectors: list[bytes]) -> None:
        """A step's vectors of one request as ``embedding`` events, each within
        ``EMBEDDING_EVENT_BYTES`` of vectors (far below any reader's message limit)."""
        per_event = max(EMBEDDING_EVENT_BYTES // max(len(vectors[0]), 1), 1) if vectors else 1
        for start in range(0, len(vectors), per_event):
            chunk = tuple(vectors[start : start + per_event])
            self._add(
                _Draft(stream, "embedding", fields={"index": index + start, "vectors": chunk})
            )

    def _add(self, draft: _Draft) -> None:
        self._unsent_delta.pop(draft.stream.request_id, None)  # later deltas must follow this
        self._drafts.append(draft)
        self._idle.clear()
        self._wake.set()


def _usage(stream: _Stream, output: RequestOutput) -> Usage:
    """Usage of a finished run: timings from the job's arrival (its queue wait included), so
    ``ttft_ms`` is what the producer waited for the first token. Redis' clock and this host's
    may differ a little; no timing goes below zero."""
    waited = max(stream.opened - stream.arrival, 0.0)
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        cached_tokens=output.cached_tokens,
        ttft_ms=(waited + output.ttft) * 1000 if output.ttft is not None else None,
        tokens_per_second=output.tokens_per_second,
        duration_ms=max(time.time() - stream.arrival, 0.0) * 1000,
    )
