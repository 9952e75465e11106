"""Running one delivered job: validate, check, start, wait for its terminal event, acknowledge.

Order matters for at-least-once: the entry is acknowledged only after its terminal event is in
the request's log, and a job is skipped (but acknowledged) when its log already ends in a
terminal event, so a redelivery never runs a finished job twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from itertools import takewhile
from typing import Any

import structlog
from structlog.contextvars import bound_contextvars

from protocol.codec import decode_job
from protocol.connection import RedisClient
from protocol.errors import ProtocolError
from protocol.identifiers import stream_id_time
from protocol.keys import Keys
from protocol.limits import Limits
from protocol.messages import SYSTEM_PREFIX, Job
from protocol.scripts import (
    FINISHED,
    STALE_ATTEMPT,
    Outcome,
    begin_attempt,
    new_run,
    parse_fence,
)
from worker.daemon.backoff import retry_until_done
from worker.daemon.job_queue import Delivery, JobQueue
from worker.daemon.publisher import EventPublisher
from worker.engine import EngineCore, QueueFullError, SamplingParams
from worker.engine.prompt import encode_prompt, shared_prefix_length

log = structlog.get_logger(__name__)


class JobRunner:
    def __init__(
        self,
        engine: EngineCore,
        redis: RedisClient,
        keys: Keys,
        queue: JobQueue,
        publisher: EventPublisher,
        limits: Limits,
        max_deliveries: int,
        default_stream_interval: int,
        *,
        worker_id: str,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.publisher = publisher
        self.limits = limits
        self.max_deliveries = max_deliveries
        self.default_stream_interval = default_stream_interval
        self.in_flight: dict[str, str] = {}  # request_id -> entry id
        self.outcomes: dict[str, int] = {}
        self.draining = False
        # request id -> outcome counted when its task sees the loss (see ``lose``)
        self._lost: dict[str, str] = {}
        self._background: set[asyncio.Task[bool]] = set()

    async def run(self, delivery: Delivery) -> None:
        try:
            job = decode_job(delivery.job_bytes, self.limits)
        except ProtocolError as exc:
            await self._reject(delivery, exc.request_id, exc.code, exc.message)
            return
        with bound_contextvars(request_id=job.request_id, entry_id=delivery.entry_id):
            await self._run_job(delivery, job)

    async def _run_job(self, delivery: Delivery, job: Job) -> None:
        rid = job.request_id
        if rid in self.in_flight:  # the same request twice at once: let the first one finish
            log.warning("job_duplicate_in_flight")
            return
        attempt = delivery.times_delivered
        run = new_run(self.worker_id)
        last_seq = await self._begin_attempt(rid, attempt, run)
        if last_seq == FINISHED:  # its log already ends: a redelivery of a finished job
            await retry_until_done(lambda: self.queue.ack(delivery.entry_id), "ack")
            self._count("already_done")
            log.info("job_already_done")
            return
        if last_seq == STALE_ATTEMPT:  # a newer attempt runs elsewhere: that worker owns it now
            self._count("stale_delivery")
            log.warning("job_stale_delivery", attempt=attempt)
            return
        written = self._open(rid, attempt, run, last_seq, job.metadata, delivery)
        if delivery.times_delivered > self.max_deliveries:
            message = f"delivered {delivery.times_delivered} times (limit {self.max_deliveries})"
            self.publisher.error(rid, "dead_lettered", message)
            await self._finish(
                delivery, written, "dead_lettered", dead=("dead_lettered", message), rid=rid
            )
            return
        if await retry_until_done(lambda: self.redis.exists(self.keys.abort(rid)), "abort check"):
            self.publisher.done(rid, "abort")
            await self._finish(delivery, written, "aborted_before_start")
            return
        if job.is_expired(time.time()):
            self.publisher.done(rid, "expired")
            await self._finish(delivery, written, "expired")
            return
        try:
            prompt, prefix_boundary = self._prompt(job)
            params = SamplingParams(**job.sampling_kwargs())
            self.in_flight[rid] = delivery.entry_id
            started = time.monotonic()
            log.info("job_started", attempt=attempt, prompt_kind=_prompt_kind(job))
            await self.engine.add_request(
                prompt,
                params,
                request_id=rid,
                prefix_boundary=prefix_boundary,
                stream_interval=job.stream_interval or self.default_stream_interval,
                collect=False,
            )
        except (ValueError, TypeError) as exc:
            # Checks that need the model (a prompt's token count, the chat template): the
            # decoder's kind of verdict, stated the same way.
            self.in_flight.pop(rid, None)
            self.publisher.error(rid, "invalid_job", f"invalid_field: {exc}")
            await self._finish(
                delivery, written, "invalid", dead=("invalid_field", str(exc)), rid=rid
            )
            return
        except QueueFullError:
            self.in_flight.pop(rid, None)
            self.publisher.abandon(rid)  # left pending: retried after the lease
            self._count("requeued")
            return
        try:
            await written
        except asyncio.CancelledError:
            self.in_flight.pop(rid, None)
            lost = self._lost.pop(rid, None)
            if lost is not None:  # not ours to finish: another worker runs (or will run) it
                self._count(lost)
                log.warning("job_attempt_lost", outcome=lost)
                return
            if self.draining:  # abandoned at shutdown: not acknowledged, another worker re-runs it
                self._count("abandoned")
                log.info("job_abandoned")
                return
            raise
        self.in_flight.pop(rid, None)
        await retry_until_done(lambda: self.queue.ack(delivery.entry_id), "ack")
        self._count("completed")
        log.info("job_finished", seconds=round(time.monotonic() - started, 3))

    def running(self, request_id: str) -> bool:
        return request_id in self.in_flight

    async def abort(self, request_id: str) -> bool:
        """Abort a job running here; its stream ends with ``done(abort)``."""
        if request_id not in self.in_flight:
            return False
        return await self.engine.abort_request(request_id)

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
        run = new_run(self.worker_id)
        last_seq = await self._begin_attempt(
            request_id, attempt, run, if_free=if_free, if_fence=if_fence
        )
        if last_seq == FINISHED:
            return "finished"
        if last_seq == STALE_ATTEMPT:
            return "elsewhere"
        written = self._open(request_id, attempt, run, last_seq, None)
        self.publisher.done(request_id, "abort")
        try:
            await written
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return "elsewhere"  # a worker began it meanwhile, and its fence refused our event
        return "queued"

    def lose(self, request_id: str, why: Outcome = Outcome.FENCED) -> None:
        """This attempt is over: another worker now owns the job (we stalled past the lease:
        FENCED), or Redis lost events it wrote (a failover: LOG_GAP). Stop it here, publish
        nothing more, do not acknowledge: once its lease runs out the job is reclaimed and
        runs again as a new attempt, which starts with a reset."""
        if request_id not in self.in_flight:
            return
        self._lost[request_id] = "log_gap" if why is Outcome.LOG_GAP else "lost_lease"
        self.publisher.abandon(request_id)
        task = asyncio.get_running_loop().create_task(self.engine.abort_request(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def lose_entries(self, entry_ids: list[str]) -> None:
        lost = set(entry_ids)
        for request_id, entry_id in list(self.in_flight.items()):
            if entry_id in lost:
                self.lose(request_id)

    async def abandon_all(self) -> None:
        """Shutdown after the drain timeout: stop what runs, publish no terminal, keep pending."""
        self.draining = True
        for rid in list(self.in_flight):
            self.publisher.abandon(rid)
            await self.engine.abort_request(rid)

    def _prompt(self, job: Job) -> tuple[str | list[int], int]:
        """The engine's prompt and its shared-prefix length (``prefix_boundary``)."""
        boundary = job.prefix_boundary if isinstance(job.prefix_boundary, int) else 0
        if job.prompt is not None:
            return job.prompt, boundary
        if job.prompt_token_ids is not None:
            return list(job.prompt_token_ids), boundary
        tokenizer = self.engine.tokenizer
        if not _has_chat_template(tokenizer):
            # Else transformers' own error (or, in older versions, a default template the
            # model never saw) would leave the producer guessing what to send instead.
            raise ValueError(
                "job.messages: the model has no chat template; send a `prompt` instead "
                "(mlx-worker submit --raw)"
            )
        messages = job.chat_messages() or []
        token_ids = encode_prompt(tokenizer, _render(tokenizer, messages, True))
        if job.prefix_boundary == SYSTEM_PREFIX:
            # Where the system turns end in tokens; the common prefix is exact even when the
            # template renders a lone system turn a little differently.
            system = list(takewhile(lambda m: m["role"] == "system", messages))
            system_ids = encode_prompt(tokenizer, _render(tokenizer, system, False))
            boundary = shared_prefix_length(system_ids, token_ids)
        return token_ids, boundary

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
        arrival = stream_id_time(delivery.entry_id) if delivery is not None else None
        written = self.publisher.open(
            request_id, attempt, run, last_seq + 1, metadata, arrival=arrival
        )
        if attempt > 1:
            self.publisher.reset(request_id)
        return written

    async def _reject(self, delivery: Delivery, rid: str | None, code: str, message: str) -> None:
        """An undecodable job: dead-letter it, and tell its request when we know which one."""
        log.warning("job_rejected", code=code, error=message, request_id=rid)
        written = None
        if rid is not None and rid not in self.in_flight:
            run = new_run(self.worker_id)
            last_seq = await self._begin_attempt(rid, delivery.times_delivered, run)
            if last_seq >= 0:
                written = self._open(rid, delivery.times_delivered, run, last_seq, None, delivery)
                self.publisher.error(rid, "invalid_job", f"{code}: {message}")
        await self._finish(delivery, written, "invalid", dead=(code, message), rid=rid)

    async def _finish(
        self,
        delivery: Delivery,
        written: asyncio.Future[None] | None,
        outcome: str,
        dead: tuple[str, str] | None = None,
        rid: str | None = None,
    ) -> None:
        """Acknowledge (or dead-letter, with ``dead = (code, message)``) once the terminal
        event is written."""
        if written is not None:
            await written
        if dead is not None:
            code, message = dead
            moved = await retry_until_done(
                lambda: self.queue.dead_letter(delivery, code, message, rid), "dead-letter"
            )
            if not moved:  # another worker took the entry over meanwhile: theirs now
                log.warning("dead_letter_not_ours", code=code)
        else:
            await retry_until_done(lambda: self.queue.ack(delivery.entry_id), "ack")
        self._count(outcome)
        log.info("job_finished_early", outcome=outcome)

    def _count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def stats(self) -> dict[str, Any]:
        return {"in_flight": sorted(self.in_flight), "outcomes": dict(self.outcomes)}


def _has_chat_template(tokenizer: Any) -> bool:
    """mlx-lm's TokenizerWrapper says so itself (a template in tokenizer_config.json, one that
    mlx-lm supplies, or a tokenizer with its own renderer); a bare Hugging Face tokenizer has
    one when its ``chat_template`` is set."""
    known = getattr(tokenizer, "has_chat_template", None)
    if isinstance(known, bool):
        return known
    return getattr(tokenizer, "chat_template", None) is not None


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    rendered: str = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=False
    )
    return rendered


def _prompt_kind(job: Job) -> str:
    if job.prompt is not None:
        return "prompt"
    return "prompt_token_ids" if job.prompt_token_ids is not None else "messages"
