"""Running one delivered job: validate, check, start, wait for its terminal event, acknowledge.

Order matters for at-least-once: the entry is acknowledged only after its terminal event is in
the request's log, and a job is skipped (but acknowledged) when its log already ends in a
terminal event, so a redelivery never runs a finished job twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from structlog.contextvars import bound_contextvars

from mlx_redis_protocol.codec_job import decode_job
from mlx_redis_protocol.connection import RedisClient, get_each
from mlx_redis_protocol.constants import DEFAULT_IDEMPOTENCY_SECONDS
from mlx_redis_protocol.control import marker_stops
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.identifiers import stream_id_time
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import ErrorEvent, Job
from mlx_redis_protocol.redis_retry import retry_until_done
from mlx_redis_protocol.replay_log import (
    DUPLICATE,
    FINISHED,
    REMEMBERED,
    STALE_ATTEMPT,
    Outcome,
    begin_attempt,
    new_run,
    parse_fence,
    publish_events,
)
from mlx_redis_worker.daemon.job_prompt import job_prompt, prompt_length
from mlx_redis_worker.daemon.job_queue import Delivery, JobQueue
from mlx_redis_worker.daemon.media_loader import LoadedMedia, MediaLoader, engine_media
from mlx_redis_worker.daemon.publisher import AttemptLost, EventPublisher
from mlx_redis_worker.engine import QueueFullError, SamplingParams, SpeculativeParams
from mlx_redis_worker.media.errors import MediaError

if TYPE_CHECKING:
    from mlx_redis_worker.engine import AnyEngine

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EarlyEnd:
    """How a job ends before (or instead of) generating: the terminal event it gets (an
    ``error`` when ``error`` is set, else ``done`` with ``finish_reason``), and where its entry
    goes: acknowledged, dead-lettered (``dead = (code, message)``) or, with ``requeue``, left
    pending for a retry after its lease (no terminal event)."""

    outcome: str
    finish_reason: str = ""
    error: tuple[str, str] | None = None
    dead: tuple[str, str] | None = None
    requeue: bool = False
    prompt_tokens: int = 0  # a ``count_only`` job's count, its done event's usage

    @classmethod
    def invalid(cls, code: str, message: str) -> EarlyEnd:
        return cls("invalid", error=("invalid_job", f"{code}: {message}"), dead=(code, message))


REQUEUED = EarlyEnd("requeued", requeue=True)

# Duplicate entries parked at once (per model): a producer that queues one request a million
# times gets the rest left pending, leases not kept, for a later reclaim to park them.
MAX_PARKED = 1024


@dataclass(frozen=True, slots=True)
class JobStats:
    in_flight: list[str]  # request ids running in the engine
    outcomes: dict[str, int]  # jobs handled, by outcome (completed, expired, lost_lease, ...)
    parked: int = 0  # duplicate entries waiting for another entry's run of their request


class JobRunner:
    def __init__(
        self,
        *,
        engine: AnyEngine,
        redis: RedisClient,
        keys: Keys,
        queue: JobQueue,
        publisher: EventPublisher,
        limits: Limits,
        max_deliveries: int,
        default_stream_interval: int,
        worker_id: str,
        model: str,
        idempotency_seconds: int = DEFAULT_IDEMPOTENCY_SECONDS,
        default_speculative: SpeculativeParams | None = None,
        media: MediaLoader | None = None,
    ) -> None:
        """``model``: the fleet's name of the engine's model; the queue is its stream;
        ``idempotency_seconds``: how long a finished request id is remembered."""
        self.idempotency_seconds = idempotency_seconds
        self.engine = engine
        self.model = model
        self.worker_id = worker_id
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.publisher = publisher
        self.limits = limits
        self.max_deliveries = max_deliveries
        self.default_stream_interval = default_stream_interval
        self.default_speculative = default_speculative
        self.media = media  # None: a worker that reads no media (jobs with any are refused)
        self.in_flight: dict[str, str] = {}  # request_id -> entry id
        # The engine's answer to the first abort of each running request (its marker's or its
        # command's): a second abort shares it, rather than hear from the engine that the
        # request it is stopping is no longer there.
        self.aborting: dict[str, asyncio.Future[bool]] = {}
        # Duplicates: entries of requests that another entry's run owns (BEGIN_ATTEMPT said
        # DUPLICATE). They hold no slot; their leases are kept, and once the owner's run ends
        # (``unpark``) they run again through ``run``, which acknowledges them.
        self.parked: dict[str, tuple[str, Delivery]] = {}  # entry id -> (request id, delivery)
        self.outcomes: dict[str, int] = {}
        self.draining = False
        # One attempt of a request at a time begins here: an abort that ends a waiting request
        # (``end_waiting``) and this worker's own delivery of it would otherwise both open
        # the request's events, and the publisher keeps one stream a request (the second
        # open replaced the first: the abort's reply never came, the job task failed).
        self._beginning: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    async def run(self, delivery: Delivery) -> None:
        try:
            job = decode_job(delivery.job_bytes, self.limits)
        except ProtocolError as exc:
            await self._reject(delivery, exc.request_id, exc.code, exc.message)
            return
        with bound_contextvars(request_id=job.request_id, entry_id=delivery.entry_id):
            await self._run_job(delivery, job)

    async def _run_job(self, delivery: Delivery, job: Job) -> None:
        """Begin an attempt, end the job early when its checks say so, else generate and wait
        for the terminal event; acknowledge only once that event is in the log."""
        rid = job.request_id
        written = await self._begin(delivery, rid, job.metadata)
        if written is None:
            return
        started = time.monotonic()
        early = await self._precheck(delivery, job) or await self._start(delivery, job)
        if early is not None:
            await self._end_early(delivery, rid, written, early)
            return
        if await self._written(rid, written):
            await self._remember(rid)
            await retry_until_done(lambda: self.queue.ack(delivery.entry_id), "ack")
            log.info("job_finished", seconds=round(time.monotonic() - started, 3))

    @contextlib.asynccontextmanager
    async def _one_beginning(self, request_id: str) -> AsyncIterator[None]:
        """Hold the request's turn to begin an attempt (see ``_beginning``)."""
        lock, users = self._beginning.setdefault(request_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._beginning[request_id]

    async def _begin(
        self, delivery: Delivery, rid: str, metadata: Mapping[str, Any] | None
    ) -> asyncio.Future[None] | None:
        """Fence the request for this delivery's attempt and open its events; None when it is
        not ours to run (already finished: acknowledged; a newer attempt runs elsewhere)."""
        async with self._one_beginning(rid):
            return await self._begin_turn(delivery, rid, metadata)

    async def _begin_turn(
        self, delivery: Delivery, rid: str, metadata: Mapping[str, Any] | None
    ) -> asyncio.Future[None] | None:
        attempt = delivery.times_delivered
        run = new_run(self.worker_id, delivery.entry_id)
        last_seq = await self._begin_attempt(rid, attempt, run)
        if last_seq == DUPLICATE:
            self._park(delivery, rid)
            return None
        self.parked.pop(delivery.entry_id, None)
        if last_seq == REMEMBERED:  # finished long ago (its log expired), queued again
            await self._tell_remembered(rid)
        if last_seq in (FINISHED, REMEMBERED):  # a redelivery (or re-submission) of a finished job
            await self._remember(rid)  # again: its worker may have died before it could
            await retry_until_done(lambda: self.queue.ack(delivery.entry_id), "ack")
            self._count("already_done")
            log.info("job_already_done")
            return None
        if last_seq == STALE_ATTEMPT:  # a newer attempt runs elsewhere: that worker owns it now
            self._count("stale_delivery")
            log.warning("job_stale_delivery", attempt=attempt)
            return None
        return self._open(rid, attempt, run, last_seq, metadata, delivery)

    async def _precheck(self, delivery: Delivery, job: Job) -> EarlyEnd | None:
        """The checks a job passes before the engine sees it; how it ends when one fails."""
        if delivery.times_delivered > self.max_deliveries:
            message = f"delivered {delivery.times_delivered} times (limit {self.max_deliveries})"
            return EarlyEnd(
                "dead_lettered",
                error=("dead_lettered", message),
                dead=("dead_lettered", message),
            )
        if job.model is not None and job.model != self.model:
            right = self.keys.model_stream(job.model).stream
            return EarlyEnd.invalid(
                "invalid_field",
                f"job names model {job.model!r} but was queued on the stream of model "
                f"{self.model!r} ({self.queue.stream.stream}): queue it on {right} or "
                f"{self.keys.jobs}",
            )
        rid = job.request_id
        (marker,) = await retry_until_done(
            lambda: get_each(self.redis, [self.keys.abort(rid)]), "abort check"
        )
        if marker_stops(marker, self.model):
            return EarlyEnd("aborted_before_start", finish_reason="abort")
        if job.is_expired(time.time()):
            return EarlyEnd("expired", finish_reason="expired")
        return None

    async def _start(self, delivery: Delivery, job: Job) -> EarlyEnd | None:
        """Hand the job to the engine; how it ends instead when the engine refuses it."""
        rid = job.request_id
        if (job.input is not None) != self.engine.makes_embeddings:
            kind = "an embedding model" if self.engine.makes_embeddings else "a text model"
            wanted = "embedding jobs (input)" if self.engine.makes_embeddings else "prompts"
            return EarlyEnd.invalid(
                "invalid_field", f"model {self.model!r} is {kind}: it takes {wanted} only"
            )
        media: LoadedMedia | None = None
        if job.has_media():
            loaded = await self._load_media(job)
            if isinstance(loaded, EarlyEnd):
                return loaded
            media = loaded
        try:
            if job.input is not None:
                self.in_flight[rid] = delivery.entry_id
                log.info("job_started", attempt=delivery.times_delivered, prompt_kind="input")
                await self.engine.add_embedding_request(
                    [list(item) if isinstance(item, tuple) else item for item in job.input],
                    request_id=rid,
                    dimensions=job.dimensions,
                    collect=False,
                )
                return None
            prompt = job_prompt(job, self.engine.tokenizer)
            if job.count_only:
                if job.has_media():
                    # Their tokens are the vision processor's to make: a count without them
                    # would be short.
                    raise ValueError("job.count_only cannot count images or videos")
                count = prompt_length(prompt.prompt, self.engine.tokenizer)
                return EarlyEnd("counted", finish_reason="length", prompt_tokens=count)
            params = SamplingParams(
                **job.sampling_kwargs(),
                response_format=prompt.response_format,
                speculative=job_speculative(job, self.default_speculative),
            )
            if prompt.parser is not None:
                self.publisher.split_output(rid, prompt.parser)
            self.in_flight[rid] = delivery.entry_id
            log.info("job_started", attempt=delivery.times_delivered, prompt_kind=_prompt_kind(job))
            await self.engine.add_request(
                prompt.prompt,
                params,
                request_id=rid,
                prefix_boundary=prompt.prefix_boundary,
                stream_interval=job.stream_interval or self.default_stream_interval,
                collect=False,
                images=media.images or None if media is not None else None,
                videos=media.videos or None if media is not None else None,
            )
        except (ValueError, TypeError) as exc:
            # Checks that need the model (a prompt's token count, the chat template): the
            # decoder's kind of verdict, stated the same way.
            self.in_flight.pop(rid, None)
            return EarlyEnd.invalid("invalid_field", str(exc))
        except QueueFullError:
            self.in_flight.pop(rid, None)
            return REQUEUED
        return None

    async def _load_media(self, job: Job) -> LoadedMedia | EarlyEnd:
        """The job's images and videos decoded (off the loop, in the media pool), or how the
        job ends: its model takes none of that kind, or a file is refused."""
        taken = engine_media(self.engine)
        wanted = [kind for kind, items in (("image", job.images), ("video", job.videos)) if items]
        missing = [kind for kind in wanted if kind not in taken]
        if missing or self.media is None:
            kinds = " or ".join(f"{kind}s" for kind in missing or wanted)
            return EarlyEnd.invalid("invalid_field", f"model {self.model!r} does not take {kinds}")
        try:
            return await self.media.load(job)
        except MediaError as exc:
            log.info("job_media_refused", code=exc.code, error=exc.message)
            return EarlyEnd.invalid(exc.code, f"job.{exc.message}")

    async def _written(self, rid: str, written: asyncio.Future[None]) -> bool:
        """Wait for the running request's terminal event to be in the log: True. False when
        the attempt ended without it: lost to another attempt, or abandoned at shutdown. The
        outcome is counted before the request leaves ``in_flight``, so that a stats reply
        never shows a job neither running nor counted."""
        try:
            await written
            self._count("completed")
        except AttemptLost as lost:
            # Another worker runs (or will run) it: stop here, publish nothing, keep pending.
            self._count_lost(lost)
            await self.engine.abort_request(rid)
            return False
        except asyncio.CancelledError:
            if not self.draining:
                raise
            # Abandoned at shutdown: not acknowledged, another worker re-runs it.
            self._count("abandoned")
            log.info("job_abandoned")
            return False
        finally:
            self.in_flight.pop(rid, None)
            self.aborting.pop(rid, None)
        return True

    def running(self, request_id: str) -> bool:
        return request_id in self.in_flight

    async def abort(self, request_id: str) -> bool:
        """Abort a job running here; its stream ends with ``done(abort)``."""
        if request_id not in self.in_flight:
            return False
        first = self.aborting.get(request_id)
        if first is None:
            first = asyncio.ensure_future(self.engine.abort_request(request_id))
            self.aborting[request_id] = first
        stopped = await asyncio.shield(first)
        if not stopped and self.aborting.get(request_id) is first:
            # It ended before the abort reached the engine (or was not in it yet): forget the
            # answer, so that a later run of the request can be aborted.
            del self.aborting[request_id]
        return stopped

    async def end_waiting(self, request_id: str) -> str:
        """End with ``done(abort)`` a request that waits: no worker has begun it (its job is in
        the stream, or in some worker's backlog), or the worker that began it is dead (no
        heartbeat: the job waits for its lease to run out). "queued": ended here; its job
        entry, when a worker takes it, finds the request finished and is acknowledged without
        running. "finished" when it had already ended; "elsewhere" when a live worker has
        begun it (that worker stops it, by the abort command or the marker)."""
        state = await self._end_as(request_id, 1, if_free=True)
        if state != "elsewhere":
            return state
        fence = parse_fence(
            await retry_until_done(lambda: self.redis.get(self.keys.attempt(request_id)), "read")
        )
        if fence is None or fence.worker_id in (None, self.worker_id):
            return state
        owner = fence.worker_id
        if await retry_until_done(lambda: self.redis.exists(self.keys.worker(owner)), "read"):
            return state
        # Its worker died mid-run: take the request from that run only (a newer attempt,
        # opening with its reset), never from one that began since.
        return await self._end_as(request_id, fence.attempt + 1, if_fence=fence.raw)

    async def _end_as(
        self,
        request_id: str,
        attempt: int,
        *,
        if_free: bool = False,
        if_fence: bytes | None = None,
    ) -> str:
        async with self._one_beginning(request_id):
            return await self._end_as_turn(request_id, attempt, if_free, if_fence)

    async def _end_as_turn(
        self, request_id: str, attempt: int, if_free: bool, if_fence: bytes | None
    ) -> str:
        run = new_run(self.worker_id)
        last_seq = await self._begin_attempt(
            request_id, attempt, run, if_free=if_free, if_fence=if_fence
        )
        if last_seq in (FINISHED, REMEMBERED):
            return "finished"
        if last_seq == STALE_ATTEMPT:
            return "elsewhere"
        written = self._open(request_id, attempt, run, last_seq, None)
        self.publisher.done(request_id, "abort")
        try:
            await written
        except AttemptLost:
            return "elsewhere"  # a worker began it meanwhile, and its fence refused our event
        await self._remember(request_id)
        return "queued"

    def _park(self, delivery: Delivery, rid: str) -> None:
        """Another entry of this request runs it: keep this one aside, slot-free, until that
        run ends; no event, no error."""
        if delivery.entry_id in self.parked:
            return  # retried while the owner still runs: parked again
        if len(self.parked) >= MAX_PARKED:
            log.warning("job_duplicate_not_parked", parked=len(self.parked))
            return  # left pending without a lease: a reclaim brings it back later
        self.parked[delivery.entry_id] = (rid, delivery)
        self._count("duplicate")
        log.info("job_duplicate_parked")

    async def unpark(self) -> list[Delivery]:
        """The parked duplicates whose owner's run is over (the fence has its TTL: the request
        ended; or it is gone, or now names this entry): to be run again, which acknowledges a
        finished request's entry (or runs it, when its owner's attempt was given up). They stay
        parked until that run has begun. One round trip for all."""
        parked = list(self.parked.items())
        if not parked:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, (rid, _) in parked:
                pipe.get(self.keys.attempt(rid))
                pipe.pttl(self.keys.attempt(rid))
            replies = await pipe.execute()
        ready = []
        for index, (entry_id, (_, delivery)) in enumerate(parked):
            fence, ttl = parse_fence(replies[2 * index]), replies[2 * index + 1]
            owned_elsewhere = fence is not None and fence.entry_id not in (None, entry_id)
            if not (owned_elsewhere and ttl == -1):
                ready.append(delivery)
        return ready

    def lose_entries(self, entry_ids: list[str]) -> None:
        """Our leases on these entries are gone (another worker claimed them): their running
        attempts are over (``AttemptLost``)."""
        lost = set(entry_ids)
        for entry_id in lost:
            self.parked.pop(entry_id, None)
        for request_id, entry_id in list(self.in_flight.items()):
            if entry_id in lost:
                self.publisher.abandon(request_id, lost=Outcome.FENCED)

    async def abandon_all(self) -> None:
        """Shutdown after the drain timeout: stop what runs, publish no terminal, keep pending."""
        self.draining = True
        for rid in list(self.in_flight):
            self.publisher.abandon(rid)
            await self.engine.abort_request(rid)

    async def _begin_attempt(
        self,
        request_id: str,
        attempt: int,
        run: str,
        *,
        if_free: bool = False,
        if_fence: bytes | None = None,
    ) -> int:
        """Fence the request for this run (one round trip, atomic with the "already
        finished?" check); the log's last seq, or ``STALE_ATTEMPT`` / ``FINISHED``."""
        return await retry_until_done(
            lambda: begin_attempt(
                self.redis,
                self.keys,
                request_id,
                attempt,
                self.publisher.log_ttl,
                run,
                if_free=if_free,
                if_fence=if_fence,
            ),
            "begin attempt",
        )

    def _open(
        self,
        request_id: str,
        attempt: int,
        run: str,
        last_seq: int,
        metadata: Mapping[str, Any] | None,
        delivery: Delivery | None = None,
    ) -> asyncio.Future[None]:
        """Start publishing a begun attempt after the log's ``last_seq``; every attempt after
        the first opens with a reset. Usage timings count from the job's arrival (its
        ``delivery``'s entry id) when there is one."""
        arrival = stream_id_time(delivery.arrival_id) if delivery is not None else None
        written = self.publisher.open(
            request_id, attempt, run, last_seq + 1, metadata, arrival=arrival, model=self.model
        )
        if attempt > 1:
            self.publisher.reset(request_id)
        return written

    async def _reject(self, delivery: Delivery, rid: str | None, code: str, message: str) -> None:
        """An undecodable job: dead-letter it, and tell its request when we know which one."""
        log.warning("job_rejected", code=code, error=message, request_id=rid)
        end = EarlyEnd.invalid(code, message)
        written = None
        if rid is not None and rid not in self.in_flight:
            attempt, run = delivery.times_delivered, new_run(self.worker_id, delivery.entry_id)
            last_seq = await self._begin_attempt(rid, attempt, run)
            if last_seq >= 0:  # else finished, or begun elsewhere: dead-lettered all the same
                written = self._open(rid, attempt, run, last_seq, None, delivery)
                self._publish_end(rid, end)
        await self._settle(delivery, written, end, rid)

    async def _end_early(
        self, delivery: Delivery, rid: str, written: asyncio.Future[None], end: EarlyEnd
    ) -> None:
        """Publish the early end's terminal event, then settle its entry."""
        if end.requeue:
            self.publisher.abandon(rid)  # left pending: retried after the lease
            self._count(end.outcome)
            return
        self._publish_end(rid, end)
        await self._settle(delivery, written, end, rid)

    def _publish_end(self, rid: str, end: EarlyEnd) -> None:
        if end.error is not None:
            self.publisher.error(rid, *end.error)
        else:
            self.publisher.done(rid, end.finish_reason, prompt_tokens=end.prompt_tokens)

    async def _settle(
        self,
        delivery: Delivery,
        written: asyncio.Future[None] | None,
        end: EarlyEnd,
        rid: str | None,
    ) -> None:
        """Acknowledge (or dead-letter) once the terminal event is written."""
        if written is not None:
            try:
                await written
            except AttemptLost as lost:  # another attempt owns the request: not ours to settle
                self._count_lost(lost)
                return
            if rid is not None:
                await self._remember(rid)
        if end.dead is not None:
            code, message = end.dead
            moved = await retry_until_done(
                lambda: self.queue.dead_letter(delivery, code, message, rid), "dead-letter"
            )
            if not moved:  # another worker took the entry over meanwhile: theirs now
                log.warning("dead_letter_not_ours", code=code)
        else:
            await retry_until_done(lambda: self.queue.ack(delivery.entry_id), "ack")
        self._count(end.outcome)
        log.info("job_finished_early", outcome=end.outcome)

    async def _remember(self, rid: str) -> None:
        """Mark the request finished for the idempotency window (its terminal event is in the
        log): a job queued again under its id, even after the log expired, does not run."""
        await retry_until_done(
            lambda: self.redis.set(self.keys.finished(rid), b"1", ex=self.idempotency_seconds),
            "remember a finished request",
        )

    async def _tell_remembered(self, rid: str) -> None:
        """The request finished within the idempotency window but its log is gone: end the
        re-submission's stream (its producer's queued marker) at once, as a producer ends a
        request it did not queue (attempt 0), instead of leaving its subscribers waiting."""
        message = (
            f"request {rid!r} finished earlier (request ids are remembered for "
            f"{self.idempotency_seconds} s) and its log has expired: not run again"
        )
        event = ErrorEvent(
            request_id=rid, seq=1, attempt=0, code="already_finished", message=message
        )
        await retry_until_done(
            lambda: publish_events(
                self.redis, self.keys, [event], ttl_seconds=self.publisher.log_ttl
            ),
            "end a re-submitted request",
        )
        log.info("job_already_done_long_ago")

    def _count_lost(self, lost: AttemptLost) -> None:
        outcome = "log_gap" if lost.outcome is Outcome.LOG_GAP else "lost_lease"
        self._count(outcome)
        log.warning("job_attempt_lost", outcome=outcome)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def stats(self) -> JobStats:
        return JobStats(
            in_flight=sorted(self.in_flight), outcomes=dict(self.outcomes), parked=len(self.parked)
        )


def _prompt_kind(job: Job) -> str:
    if job.prompt is not None:
        return "prompt"
    return "prompt_token_ids" if job.prompt_token_ids is not None else "messages"


def job_speculative(job: Job, default: SpeculativeParams | None) -> SpeculativeParams | None:
    """The job's own choice (the decoder checked its shape), else the worker's default; a
    job that names a method without a draft length gets the default's (or 4)."""
    asked = job.speculative
    if asked is None:
        return default
    if asked["method"] == "off":
        return None
    count = asked.get("num_draft_tokens")
    if count is None:
        count = (default or SpeculativeParams()).num_draft_tokens
    return SpeculativeParams(method=asked["method"], num_draft_tokens=count)


def speculative_params(setting: tuple[str, int] | None) -> SpeculativeParams | None:
    """The engine's form of a parsed ``speculative`` setting."""
    if setting is None:
        return None
    method, count = setting
    return SpeculativeParams(method=method, num_draft_tokens=count)  # type: ignore[arg-type]
