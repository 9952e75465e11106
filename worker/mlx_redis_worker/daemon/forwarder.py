"""The default stream's forwarder: jobs queued on ``mlxw:jobs`` move to a model's stream.

Producers that name no model (and those from before models) queue on the default stream. Every
worker reads it in the same consumer group as a model stream and moves each entry on at once:
to the stream of the model the job names (when its ``model`` is readable), else to the fleet's
default model. The job's bytes are not checked here: a job that cannot run is refused where it
would run, by the model's lane, which dead-letters it and tells its request.

Moving is an append to the target, then XACK + XDEL of the original: two slots on a Cluster, so
not one atomic step. The append is therefore made safe to repeat: one script, in the target's
slot, sets a marker named after the original entry (``mlxw:forwarded:{MODEL}:ID``, kept for the
log TTL) and appends only when the marker was not there. A call whose reply was lost, a worker
that dies between the append and the ack, or one that retried through an outage while another
took the entry over: whoever forwards the entry again finds the marker, appends nothing, and
only acknowledges it. A job is never queued twice on its model's stream by forwarding.
"""

from __future__ import annotations

import asyncio
import functools

import structlog
from redis.typing import EncodableT

from mlx_redis_protocol.codec_job import readable_model
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.constants import FORWARDED_FROM_FIELD, JOB_FIELD
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script_each
from mlx_redis_protocol.redis_retry import retry_until_done
from mlx_redis_worker.daemon.job_queue import Delivery, JobQueue

log = structlog.get_logger(__name__)

# KEYS[1] the model's stream, KEYS[2] the entry's forwarded marker (one slot); ARGV[1] the
# marker's TTL in seconds, ARGV[2..] the new entry's fields and values. 1: appended, 0: it had
# been already.
FORWARD = """
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[1]) then
  return 0
end
redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
return 1
"""

# Entries moved per read: forwarding costs no engine slot, so read in large batches.
FORWARD_BATCH = 100
OWN_PENDING_LIMIT = 100_000


class DefaultStreamForwarder:
    def __init__(
        self,
        *,
        redis: RedisClient,
        keys: Keys,
        queue: JobQueue,
        default_model: str,
        read_block_ms: int,
        marker_ttl: int,
        stop: asyncio.Event,
    ) -> None:
        """``queue``: the default stream; ``default_model``: where jobs naming no model go;
        ``marker_ttl``: how long (s) an entry's forwarded marker is kept: the log TTL, the
        longest any job may wait."""
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.default_model = default_model
        self.read_block_ms = read_block_ms
        self.marker_ttl = marker_ttl
        self._stop = stop
        self.forwarded = 0

    async def consume(self) -> None:
        # What this consumer took and had not moved on when it last stopped (a kill between
        # the append and the ack): forwarded again now rather than after the lease.
        await self.forward(
            await retry_until_done(
                functools.partial(self.queue.read_own_pending, OWN_PENDING_LIMIT),
                "read own pending of the default stream",
            )
        )
        while not self._stop.is_set():
            deliveries = await retry_until_done(
                functools.partial(self.queue.read_new, FORWARD_BATCH, self.read_block_ms),
                "read the default stream",
                on_failure=self.queue.recreate_group_if_lost,
            )
            await self.forward(deliveries)

    async def reclaim(self) -> None:
        """Forward what a dead worker took from the default stream and never moved."""
        await self.forward(await self.queue.reclaim(FORWARD_BATCH))

    async def forward(self, deliveries: list[Delivery]) -> None:
        """Append each entry to its model's stream (once, however often this runs), then
        remove it from the default stream."""
        if not deliveries:
            return
        calls: list[tuple[list[str], list[EncodableT]]] = []
        for delivery in deliveries:
            model = self.model_of(delivery)
            keys = [
                self.keys.model_stream(model).stream,
                self.keys.forwarded(model, delivery.entry_id),
            ]
            fields: list[EncodableT] = [
                JOB_FIELD,
                delivery.job_bytes or b"",
                FORWARDED_FROM_FIELD,
                delivery.arrival_id,
            ]
            calls.append((keys, [self.marker_ttl, *fields]))
        appended = await retry_until_done(
            functools.partial(run_script_each, self.redis, FORWARD, calls), "forward jobs"
        )
        entry_ids = [delivery.entry_id for delivery in deliveries]
        await retry_until_done(functools.partial(self.queue.ack, *entry_ids), "ack")
        self.forwarded += sum(appended)
        log.debug("jobs_forwarded", count=sum(appended), repeated=len(appended) - sum(appended))

    def model_of(self, delivery: Delivery) -> str:
        """The model the job names, else the default model."""
        model = readable_model(delivery.job_bytes) if delivery.job_bytes else None
        return model or self.default_model
