"""Fair share of one model's slots between tenants, kept in Redis for every worker of the model.

Producers still ``XADD`` to the model's stream. A worker with fair share on never reads it
with ``XREADGROUP >`` for itself: its pick script first moves new entries into the group's
pending list under the fair consumer (``FAIR_CONSUMER``, not a worker id), filing each entry's
id in its tenant's queue, then chooses the waiting job to start by start-time fair queuing
(SFQ) and hands that entry over to the worker with ``XCLAIM``. The entry never leaves the
stream, so leases, reclaim, dead letters, attempt fences and acknowledgement stay as they are.

Why start-time fair queuing, not deficit round robin: a job's cost (the prompt tokens it
computes and the tokens it generates) is known only when it ends, and DRR needs it to decide
whether a job fits a tenant's deficit. SFQ charges an estimate at the start (``max_tokens``
and the prompt's bytes / 4) and settles the difference at the end (``FairQueue.ended``, sent
with the next pick), and its bound holds for any cost: while two tenants are backlogged,
their service divided by their weights never differs by more than one largest job each. A
tenant that was idle comes back at the current virtual time (``max(V, F)``): idling banks no
credit, so the window of service that counts is the time a tenant has jobs waiting.

The Redis layout (all keys tagged with the model's name, so on a Cluster they share the
stream's slot and one script sees them all) is spelled out in protocol/README.md; the script,
and how it survives others' writes to these keys, in ``fair_script``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import structlog
from redis.exceptions import ResponseError

from mlx_redis_protocol.codec_job import readable_request_id
from mlx_redis_protocol.connection import RedisClient, as_text
from mlx_redis_protocol.constants import DEFAULT_TENANT, FORWARDED_FROM_FIELD, JOB_FIELD
from mlx_redis_protocol.fair_share import (
    SERVED_WINDOW_SECONDS,
    TenantShare,
    served_bucket,
    tenant_shares,
)
from mlx_redis_protocol.identifiers import is_valid_id
from mlx_redis_protocol.keys import FairKeys, JobStream
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.lua import run_script
from mlx_redis_protocol.wire import top_level_strings
from mlx_redis_worker.daemon.fair_script import (
    COPY_WEIGHTS,
    DEFAULT_COST,
    MAX_WEIGHT,
    MIN_WEIGHT,
    PICK,
    SWEEP_CALLS,
    SWEEP_COUNT,
)
from mlx_redis_worker.daemon.job_queue import Delivery

log = structlog.get_logger(__name__)

# The least service a job's tenant is charged (its tag moves by at least this): a job that
# ends having computed no token (its media refused, expired, aborted before it started)
# still held a slot for its Redis round trips and event-loop time. Were it free, a tenant's
# burst of refused jobs (image bombs) would all start before another tenant's next job.
MIN_JOB_SERVICE: Final = 16
# The consumer that holds jobs waiting for a fair pick. Not a valid worker id (parentheses),
# so no worker can be it, and ``group prune`` never removes it (it holds pending entries).
FAIR_CONSUMER: Final = "(fair-queue)"
# New entries one pick call files at most: bounds the script's run time; a larger backlog is
# filed over the next calls. While every slot is busy, a worker files new entries every
# INTAKE_EVERY_MS (or read_block_ms, if shorter; more per call: nothing waits for a slot
# meanwhile), so a job queued behind a long backlog is seen by the next pick, not after
# backlog / INTAKE picks.
INTAKE: Final = 256
INTAKE_WHILE_BUSY: Final = 1024
INTAKE_EVERY_MS: Final = 1000
MAX_WEIGHTS: Final = 1000
# The fleet's weights hash is read only up to this many entries (a larger one is ignored,
# logged): a hash someone filled cannot make every reclaim interval read megabytes.
MAX_WEIGHTS_READ: Final = 4 * MAX_WEIGHTS


@dataclass(frozen=True, slots=True)
class Charge:
    """What a started job was charged to its tenant (0 for one not started by a pick: a
    reclaimed or restarted job, charged what it generates)."""

    tenant: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Picked:
    deliveries: list[Delivery]
    charges: dict[str, Charge]  # by entry id
    last_id: str  # the stream's newest entry: wait for entries after it


class FairQueue:
    """One model's fair pick, for one worker: what it charged each job running here, and the
    settlements to send with the next pick (one round trip for both)."""

    def __init__(
        self,
        *,
        redis: RedisClient,
        stream: JobStream,
        keys: FairKeys,
        consumer: str,
        tenant_weights_key: str,
        age_bound_seconds: float,
        max_job_bytes: int = DEFAULT_LIMITS.max_message_bytes,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.keys = keys
        self.consumer = consumer
        self.age_bound_ms = int(age_bound_seconds * 1000)
        self.max_job_bytes = max_job_bytes
        self.tenant_weights_key = tenant_weights_key
        self.running: dict[str, _Running] = {}  # by entry id: jobs running here
        self._entry_of: dict[str, str] = {}  # request id -> entry id, of those
        self._weights: dict[str, float] | None = None
        self._ignored: dict[str, str] = {}  # the fleet's entries ignored, as last logged
        self._settlements: list[tuple[str, int, int]] = []  # (tenant, delta, service)
        self._sweep_cursor = "-"  # where the next sweep of the pending list starts
        self._sweep_soon = False  # a pick failed: the next call sweeps
        self.refiled = 0  # entries the last call's sweep filed again

    async def pick(
        self, count: int, *, now_ms: int = 0, intake: int = INTAKE, sweep: int = 0
    ) -> Picked:
        """Up to ``count`` jobs to start now, handed to this worker (pending for it, delivery
        count unchanged), after filing up to ``intake`` new entries and sweeping ``sweep``
        entries of the pending list (see ``sweep``); ``now_ms`` 0 is Redis' clock (tests
        simulate time)."""
        if self._sweep_soon:
            sweep = max(sweep, SWEEP_COUNT)
        settlements, self._settlements = self._settlements, []
        flat = [str(item) for settlement in settlements for item in settlement]
        try:
            reply: Any = await run_script(
                self.redis,
                PICK,
                [
                    self.stream.stream,
                    self.keys.backlogged,
                    self.keys.idle,
                    self.keys.state,
                    self.keys.weights,
                    self.keys.served(served_bucket(time.time())),
                ],
                [
                    self.stream.group,
                    FAIR_CONSUMER,
                    self.consumer,
                    intake,
                    count,
                    now_ms,
                    self.age_bound_ms,
                    DEFAULT_TENANT,
                    self.max_job_bytes,
                    DEFAULT_COST,
                    self.keys.queue_base,
                    SERVED_WINDOW_SECONDS,
                    self._sweep_cursor,
                    sweep,
                    len(settlements),
                    *flat,
                ],
            )
        except BaseException as exc:
            # Not sent (or its reply lost): send them with the next pick. A lost reply that
            # ran settles twice, an error of one job's tokens in the tenant's tag.
            self._settlements = settlements + self._settlements
            # A script that stopped half way may have taken new entries without filing them:
            # the next call sweeps the pending list for them.
            self._sweep_soon = isinstance(exc, ResponseError) or self._sweep_soon
            raise
        if sweep > 0:
            self._sweep_cursor = as_text(reply[3])
            self._sweep_soon = False
        self.refiled = int(reply[4])
        for key, found in reply[2]:
            log.warning(
                "fair_share_key_repaired",
                model=self.stream.model,
                key=as_text(key),
                found=as_text(found),
            )
        deliveries, charges = [], {}
        for entry_id, fields, tenant, cost in reply[0]:
            delivery = _delivery(as_text(entry_id), fields)
            deliveries.append(delivery)
            charges[delivery.entry_id] = Charge(as_text(tenant), int(as_text(cost)))
        return Picked(deliveries, charges, as_text(reply[1]))

    async def sweep(self) -> None:
        """Settle, and visit the next ``SWEEP_COUNT`` entries of the pending list: an entry
        waiting for a pick that no tenant's queue holds (an operator deleted the key, a call
        stopped half way) is filed again. Every reclaim interval, so over time the whole list
        (the stream and its pending list are the truth, the queues an index of them); more
        calls at once, up to ``SWEEP_CALLS``, while they find entries to file."""
        for _ in range(SWEEP_CALLS):
            await self.pick(0, intake=0, sweep=SWEEP_COUNT)
            if not self.refiled or self._sweep_cursor == "-":
                return

    def started(self, delivery: Delivery, charge: Charge | None) -> None:
        """A job starts here with what its pick charged (None: not picked; reclaimed or
        restarted, charged what it generates): settled when it ends."""
        if charge is None:
            charge = Charge(readable_tenant(delivery.job_bytes), 0)
        request_id = readable_request_id(delivery.job_bytes)
        self.running[delivery.entry_id] = _Running(charge, request_id)
        if request_id is not None:
            self._entry_of[request_id] = delivery.entry_id

    def closed(self, request_id: str, tokens: int) -> None:
        """The publisher's word: the request's events end after ``tokens`` of service (the
        prompt tokens it computed, not found in the prefix cache, and those it generated; a
        request of another lane is not ours: ignored)."""
        entry_id = self._entry_of.get(request_id)
        if entry_id is not None and entry_id in self.running:
            self.running[entry_id].tokens += tokens

    def ended(self, entry_id: str) -> None:
        """The job's task ended: its tenant's tag moves by the difference between its charge
        and its tokens (at least ``MIN_JOB_SERVICE``), sent with the next pick; the served
        window counts its tokens as they were. A job nobody can follow (no readable request
        id) keeps its charge."""
        running = self.running.pop(entry_id, None)
        if running is None:
            return
        if running.request_id is not None:
            self._entry_of.pop(running.request_id, None)
            tenant, charged = running.charge.tenant, running.charge.tokens
            service = max(running.tokens, MIN_JOB_SERVICE)
            self._settlements.append((tenant, service - charged, running.tokens))

    def running_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for running in self.running.values():
            tenant = running.charge.tenant
            counts[tenant] = counts.get(tenant, 0) + 1
        return counts

    async def shares(self) -> list[dict[str, Any]]:
        """Per tenant of this model: jobs waiting (fleet-wide), running here, tokens served
        over the last ten minutes (fleet-wide); for ``stats`` and the metrics."""
        running = self.running_by_tenant()
        shares = await tenant_shares(self.redis, self.keys)
        listed = {share.tenant for share in shares}
        shares += [TenantShare(t, 0, 0) for t in sorted(running) if t not in listed]
        return [{**share.as_dict(), "running": running.get(share.tenant, 0)} for share in shares]

    async def wait_for_new(self, after_id: str, block_ms: int) -> None:
        """Return once an entry newer than ``after_id`` is in the stream, or after
        ``block_ms``: the pick found nothing, and only a new entry brings more."""
        await self.redis.xread({self.stream.stream: after_id}, count=1, block=block_ms)

    async def refresh_weights(self) -> dict[str, float]:
        """Copy the fleet's tenant weights into this model's slot (where the pick script reads
        them) when they changed, or when the copy differs from them (someone else wrote it);
        the weights in force. Each entry ignored is logged once, when it appears or changes."""
        raw, problem = await self._fleet_weights()
        weights, ignored = parse_weights(raw)
        if problem is not None:  # the hash is the operators', not ours to repair
            ignored = {"": problem}
            if self._ignored != ignored:
                log.warning("tenant_weights_unreadable", key=self.tenant_weights_key, found=problem)
        for tenant, text in ignored.items():
            if self._ignored.get(tenant) != text:
                log.warning("tenant_weight_ignored", tenant=tenant, weight=text)
        self._ignored = ignored
        pairs = [item for tenant, w in sorted(weights.items()) for item in (tenant, repr(w))]
        rewritten = await run_script(self.redis, COPY_WEIGHTS, [self.keys.weights], pairs)
        if weights != self._weights:
            log.info("tenant_weights_changed", model=self.stream.model, weights=weights)
            self._weights = weights
        elif rewritten:
            log.warning("fair_share_key_repaired", model=self.stream.model, key=self.keys.weights)
        return weights

    async def _fleet_weights(self) -> tuple[dict[Any, Any], str | None]:
        """The fleet's weights hash when it is one of a sane size; else none, and why."""
        key = self.tenant_weights_key
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.type(key)
            pipe.hlen(key)
            kind, size = await pipe.execute(raise_on_error=False)
        if as_text(kind) not in ("hash", "none"):
            return {}, f"a key of type {as_text(kind)}"
        if isinstance(size, int) and size > MAX_WEIGHTS_READ:
            return {}, f"{size} entries, more than {MAX_WEIGHTS_READ}"
        raw: dict[Any, Any] = await self.redis.hgetall(key)
        return raw, None


@dataclass(slots=True)
class _Running:
    charge: Charge
    request_id: str | None
    tokens: int = 0


def readable_tenant(job_bytes: bytes | None) -> str:
    """The job's tenant, read as the pick script reads it: the default for anything else."""
    tenant = top_level_strings(job_bytes, ("tenant",)).get("tenant")
    return tenant if tenant is not None and is_valid_id(tenant) else DEFAULT_TENANT


def parse_weights(raw: Mapping[Any, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The usable entries of the fleet's ``tenant_weights`` hash, and those ignored (tenant
    -> the value, both cut short for a log line)."""
    weights: dict[str, float] = {}
    ignored: dict[str, str] = {}
    for name, value in raw.items():
        tenant, text = as_text(name), as_text(value)
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not is_valid_id(tenant) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            ignored[tenant[:128]] = text[:32]
        elif len(weights) < MAX_WEIGHTS:
            weights[tenant] = weight
        else:
            ignored[tenant] = f"{text[:32]} (over {MAX_WEIGHTS} weights)"
    return weights, ignored


def _delivery(entry_id: str, fields: list[Any]) -> Delivery:
    pairs = {as_text(fields[i]): fields[i + 1] for i in range(0, len(fields) - 1, 2)}
    job = pairs.get(JOB_FIELD)
    origin = pairs.get(FORWARDED_FROM_FIELD)
    return Delivery(
        entry_id=entry_id,
        job_bytes=job if isinstance(job, bytes) else None,
        times_delivered=1,
        forwarded_from=as_text(origin) if isinstance(origin, bytes) else None,
    )
