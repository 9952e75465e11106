"""The job stream seen through the consumer group: read, reclaim, keep leases, ack, dead-letter.

At-least-once: an entry stays pending until ``ack`` (after its terminal event is written). A
worker that dies leaves its entries pending; once idle past the lease, another worker takes them
with XAUTOCLAIM. Live jobs never look idle because ``extend_leases`` re-claims them (JUSTID:
the delivery count is not bumped). The delivery count decides when a job is dead-lettered.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import structlog
from redis.exceptions import ResponseError

from mlx_redis_protocol.connection import RedisClient, as_text
from mlx_redis_protocol.constants import FORWARDED_FROM_FIELD, JOB_FIELD
from mlx_redis_protocol.group import remove_idle_consumer
from mlx_redis_protocol.keys import JobStream
from mlx_redis_protocol.lua import run_script
from mlx_redis_protocol.redis_retry import REDIS_FAILURES

log = structlog.get_logger(__name__)

# KEYS[1] job stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. Re-claiming only
# what is still ours, atomically: a plain XCLAIM would take back a job that another worker
# reclaimed while we were stalled, and both would run it. Returns the ids we lost.
EXTEND_LEASES = """
local lost = {}
for i = 3, #ARGV do
  local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #mine == 1 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# KEYS[1] job stream, KEYS[2] dead-letter stream (one slot: see
# protocol/mlx_redis_protocol/keys.py); ARGV[1] group, ARGV[2] consumer, ARGV[3] entry id, ARGV[4]
# the dead-letter stream's MAXLEN, ARGV[5..] the dead letter's fields and values. One step, so no
# entry is ever in neither stream: the append comes first, and when Redis refuses it (out of memory)
# the script stops there with the entry still pending. It moves the entry only while it is pending
# for this consumer, so a repeated call (its reply lost) writes nothing twice, and an entry another
# worker took over stays theirs. The append trims the oldest dead letters past MAXLEN
# (approximately: whole stream nodes, cheap), so a flood of bad jobs cannot fill Redis. 1: moved, 0:
# not ours (any more).
DEAD_LETTER = """
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2])
if #mine == 0 then
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(ARGV, 5))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
return 1
"""


# KEYS[1] job stream; ARGV[1] group, ARGV[2] consumer, ARGV[3] lease (min idle ms), ARGV[4]
# count, ARGV[5] a consumer whose entries are not orphans (the fair queue's: they wait for a
# pick, idle by design). XAUTOCLAIM cannot leave one consumer out; this visits each other
# consumer's idle entries instead (bounded: consumers x count) and claims them as it would.
RECLAIM_EXCEPT = """
local out = {}
local budget = tonumber(ARGV[4])
for _, row in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for i = 1, #row, 2 do info[row[i]] = row[i + 1] end
  if budget > 0 and info['name'] ~= ARGV[5] and tonumber(info['pending']) > 0 then
    local idle = redis.call(
      'XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], '-', '+', budget, info['name'])
    for _, pending in ipairs(idle) do
      local claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], pending[1])
      for _, entry in ipairs(claimed) do
        table.insert(out, entry)
        budget = budget - 1
      end
    end
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One job stream entry handed to this worker."""

    entry_id: str
    job_bytes: bytes | None
    times_delivered: int
    # The id the job first had in the default stream, for a job forwarded from there: the
    # job's arrival, from which its usage timings count, is that entry's time.
    forwarded_from: str | None = None

    @property
    def arrival_id(self) -> str:
        return self.forwarded_from or self.entry_id


DEFAULT_DEAD_LETTER_MAXLEN = 10_000
MAX_SETTLED_KEPT = 4096


class JobQueue:
    def __init__(
        self,
        *,
        redis: RedisClient,
        stream: JobStream,
        consumer: str,
        lease_ms: int,
        dead_letter_maxlen: int = DEFAULT_DEAD_LETTER_MAXLEN,
    ) -> None:
        if dead_letter_maxlen < 1:
            raise ValueError(f"dead_letter_maxlen must be > 0, got {dead_letter_maxlen}")
        self.redis = redis
        self.stream = stream
        self.consumer = consumer
        self.lease_ms = lease_ms
        self.dead_letter_maxlen = dead_letter_maxlen
        self._reclaim_cursor = "0-0"
        # Entries this consumer acknowledged or dead-lettered lately (the newest
        # MAX_SETTLED_KEPT), marked before the command goes out: a lease refresh that raced
        # their end finds them gone, and they are not lost.
        self._settled: dict[str, None] = {}

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless it exists; also after Redis lost
        its data, which takes the group with it."""
        try:
            await self.redis.xgroup_create(
                self.stream.stream, self.stream.group, id="0", mkstream=True
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read_own_pending(self, count: int) -> list[Delivery]:
        """This consumer's entries from before a restart (delivered, never acknowledged)."""
        return await self._read("0", count, block_ms=None)

    async def read_new(self, count: int, block_ms: int) -> list[Delivery]:
        return await self._read(">", count, block_ms)

    async def reclaim(self, count: int) -> list[Delivery]:
        """Take over entries idle longer than the lease (their worker died), following the
        XAUTOCLAIM cursor across calls so the whole pending list is visited over time."""
        reply: Any = await self.redis.xautoclaim(
            self.stream.stream,
            self.stream.group,
            self.consumer,
            min_idle_time=self.lease_ms,
            start_id=self._reclaim_cursor,
            count=count,
        )
        cursor, entries = reply[0], reply[1]
        self._reclaim_cursor = as_text(cursor)
        return await self._with_delivery_counts(entries)

    @property
    def swept(self) -> bool:
        """Whether the reclaim cursor is back at the start: the pending list was visited."""
        return self._reclaim_cursor == "0-0"

    async def reclaim_except(self, waiting_consumer: str, count: int) -> list[Delivery]:
        """``reclaim``, leaving alone the entries of ``waiting_consumer`` (jobs waiting in the
        fair queue, which are idle by design, not orphaned)."""
        entries: Any = await run_script(
            self.redis,
            RECLAIM_EXCEPT,
            [self.stream.stream],
            [self.stream.group, self.consumer, self.lease_ms, count, waiting_consumer],
        )
        # A script returns an entry's fields as a flat list, and consumer by consumer: in the
        # stream's order, as the delivery counts are read by id range.
        as_read = [(entry_id, _pairs(fields)) for entry_id, fields in entries]
        return await self._with_delivery_counts(sorted(as_read, key=lambda e: _order(e[0])))

    async def extend_leases(self, entry_ids: list[str]) -> list[str]:
        """Refresh the lease of entries we still own; return those another worker took."""
        if not entry_ids:
            return []
        lost: Any = await run_script(
            self.redis,
            EXTEND_LEASES,
            [self.stream.stream],
            [self.stream.group, self.consumer, *entry_ids],
        )
        return [as_text(entry_id) for entry_id in lost]

    def settled(self, entry_id: str) -> bool:
        """Whether this consumer acknowledged or dead-lettered the entry lately."""
        return entry_id in self._settled

    def _settling(self, *entry_ids: str) -> None:
        for entry_id in entry_ids:
            self._settled[entry_id] = None
        while len(self._settled) > MAX_SETTLED_KEPT:
            del self._settled[next(iter(self._settled))]

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge and delete entries (any number: one round trip)."""
        self._settling(*entry_ids)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self.stream.stream, self.stream.group, *entry_ids)
            pipe.xdel(self.stream.stream, *entry_ids)
            await pipe.execute()

    async def recreate_group_if_lost(self, exc: BaseException) -> None:
        """Redis lost its data (restart without persistence, failover to an empty replica):
        the group went with it. Re-create it so the stream is served again."""
        if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
            log.warning("consumer_group_missing_recreating", stream=self.stream.stream)
            with contextlib.suppress(*REDIS_FAILURES):
                await self.ensure_group()

    async def dead_letter(
        self, delivery: Delivery, code: str, message: str, request_id: str | None
    ) -> bool:
        """Move an entry to the dead-letter stream (fields as in protocol/README.md), in one
        atomic step that is safe to repeat; False when the entry is not pending for us."""
        fields: dict[str, Any] = {
            JOB_FIELD: delivery.job_bytes if delivery.job_bytes is not None else b"",
            "code": code,
            "message": message,
            "deliveries": delivery.times_delivered,
            "entry_id": delivery.entry_id,
            "worker": self.consumer,
        }
        if request_id is not None:
            fields["request_id"] = request_id
        if delivery.forwarded_from is not None:
            fields[FORWARDED_FROM_FIELD] = delivery.forwarded_from
        pairs = [item for field in fields.items() for item in field]
        self._settling(delivery.entry_id)
        moved = await run_script(
            self.redis,
            DEAD_LETTER,
            [self.stream.stream, self.stream.dead],
            [self.stream.group, self.consumer, delivery.entry_id, self.dead_letter_maxlen, *pairs],
        )
        return bool(moved)

    async def leave_group(self) -> bool:
        """Remove this worker's consumer from the group unless it still holds pending entries
        (jobs left for a restart or for another worker to reclaim); True when it is gone. For
        a clean stop: otherwise every stopped worker's id stays in the group forever."""
        return await remove_idle_consumer(self.redis, self.stream, self.consumer)

    async def group_info(self) -> dict[str, Any]:
        """Lag and pending count of our group (for stats)."""
        groups: Any = await self.redis.xinfo_groups(self.stream.stream)
        for group in groups:
            if as_text(group.get("name", group.get(b"name", b""))) == self.stream.group:
                return {
                    as_text(k): (as_text(v) if isinstance(v, bytes) else v)
                    for k, v in group.items()
                }
        return {}

    async def _read(self, stream_id: str, count: int, block_ms: int | None) -> list[Delivery]:
        reply: Any = await self.redis.xreadgroup(
            self.stream.group,
            self.consumer,
            {self.stream.stream: stream_id},
            count=count,
            block=block_ms,
        )
        entries = reply[0][1] if reply else []
        return await self._with_delivery_counts(entries)

    async def _with_delivery_counts(self, entries: list[Any]) -> list[Delivery]:
        # History reads can return entries deleted meanwhile as (id, None): nothing to run.
        live = [(entry_id, fields) for entry_id, fields in entries if fields is not None]
        if not live:
            return []
        ids = [as_text(entry_id) for entry_id, _ in live]
        pending: Any = await self.redis.xpending_range(
            self.stream.stream,
            self.stream.group,
            min=ids[0],
            max=ids[-1],
            count=len(ids) + 64,
            consumername=self.consumer,
        )
        counts = {as_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        deliveries = []
        for entry_id, (_, fields) in zip(ids, live, strict=True):
            job = fields.get(JOB_FIELD.encode(), fields.get(JOB_FIELD))
            origin = fields.get(FORWARDED_FROM_FIELD.encode())
            deliveries.append(
                Delivery(
                    entry_id=entry_id,
                    job_bytes=job if isinstance(job, bytes) else None,
                    times_delivered=counts.get(entry_id, 1),
                    forwarded_from=as_text(origin) if isinstance(origin, bytes) else None,
                )
            )
        return deliveries


def _pairs(fields: list[Any]) -> dict[Any, Any]:
    return {fields[i]: fields[i + 1] for i in range(0, len(fields) - 1, 2)}


def _order(entry_id: bytes | str) -> tuple[int, int]:
    millis, _, sequence = as_text(entry_id).partition("-")
    return int(millis), int(sequence or 0)
