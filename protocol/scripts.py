"""The replay log on the Redis side: atomic publish+append, and reads of what was appended.

Every event is appended to the request's log and published on its channel by one Lua script,
so a subscriber that saw an event live can always find it (and all before it) in the log.
Clients given to these helpers must use ``decode_responses=False``: events are binary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from protocol.codec import encode_event
from protocol.constants import DEFAULT_LOG_TTL_SECONDS, LOG_EVENT_FIELD, LOG_SEQ_FIELD
from protocol.keys import Keys
from protocol.messages import Event

# KEYS[1] channel, KEYS[2] log, KEYS[3] attempt key; ARGV[1] encoded event, ARGV[2] seq,
# ARGV[3] log TTL seconds, ARGV[4] the event's attempt, ARGV[5] 1 for a terminal event. The
# channel is passed as a key only so Redis Cluster routes the call by its hash tag, which all
# three share. `seq` is stored as a field of its own so XREVRANGE COUNT 1 finds the last one
# without decoding; a terminal event's entry also gets an `end` field, for BEGIN_ATTEMPT. The
# fence: once a newer attempt has begun (BEGIN_ATTEMPT), a stale worker's events are refused
# (the script returns 0) instead of interleaving two attempts. Append before publish: whoever
# hears the event can find it logged.
PUBLISH_EVENT: Final = """
if tonumber(redis.call('GET', KEYS[3]) or '0') > tonumber(ARGV[4]) then
  return 0
end
local id
if ARGV[5] == '1' then
  id = redis.call('XADD', KEYS[2], '*', 'seq', ARGV[2], 'e', ARGV[1], 'end', '1')
else
  id = redis.call('XADD', KEYS[2], '*', 'seq', ARGV[2], 'e', ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
return id
"""

# KEYS[1] log, KEYS[2] attempt key; ARGV[1] attempt, ARGV[2] TTL seconds. A worker calls it
# before publishing anything for an attempt: from then on older attempts are fenced off, and
# the seq it returns (the log's last) is final, since no older attempt can append after it.
# Returns -1 when a newer attempt has already begun (this delivery is stale), and -2 when the
# log already ends with a terminal event (the job is finished: nothing may follow it). Both
# checks and the fence are one atomic step, so an older attempt's last event cannot land
# between "not finished yet" and "fenced".
BEGIN_ATTEMPT: Final = """
if tonumber(redis.call('GET', KEYS[2]) or '0') > tonumber(ARGV[1]) then
  return -1
end
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
local seq = 0
if newest then
  local fields = newest[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'end' then
      return -2
    elseif fields[i] == 'seq' then
      seq = tonumber(fields[i + 1])
    end
  end
end
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[2])
return seq
"""

STALE_ATTEMPT: Final = -1
FINISHED: Final = -2


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One raw entry of a replay log: its stream id, seq, and the encoded event."""

    stream_id: bytes
    seq: int
    data: bytes


async def publish_events(
    redis: Redis,
    keys: Keys,
    events: Iterable[Event],
    *,
    ttl_seconds: int = DEFAULT_LOG_TTL_SECONDS,
) -> None:
    """Publish and log each event, atomically per event, in order.

    Given a pipeline, the calls are only queued: the caller executes it, together with
    whatever else it batches into that round trip (redis-py then checks with SCRIPT EXISTS
    and loads the script if the server lacks it). Given a client, they run now: one event as
    a single EVALSHA, several in one pipeline.
    """
    if ttl_seconds < 1:
        raise ValueError(f"ttl_seconds must be >= 1, got {ttl_seconds}")
    events = list(events)
    if isinstance(redis, Pipeline):
        await _queue(redis, keys, events, ttl_seconds)
        return
    if len(events) == 1:
        # EVALSHA at once (loading the script only if the server lacks it): one round trip,
        # where a pipeline would send a SCRIPT EXISTS first.
        event = events[0]
        script = redis.register_script(PUBLISH_EVENT)
        await script(keys=_script_keys(keys, event), args=_script_args(event, ttl_seconds))
        return
    async with redis.pipeline(transaction=False) as pipeline:
        await _queue(pipeline, keys, events, ttl_seconds)
        await pipeline.execute()


async def _queue(pipeline: Pipeline, keys: Keys, events: list[Event], ttl: int) -> None:
    script = pipeline.register_script(PUBLISH_EVENT)
    for event in events:
        await script(keys=_script_keys(keys, event), args=_script_args(event, ttl), client=pipeline)


def publish_call(keys: Keys, event: Event, ttl: int) -> tuple[list[str], list[bytes | int]]:
    """KEYS and ARGV of one PUBLISH_EVENT call, for callers that EVAL it themselves."""
    return _script_keys(keys, event), _script_args(event, ttl)


def _script_keys(keys: Keys, event: Event) -> list[str]:
    rid = event.request_id
    return [keys.out(rid), keys.log(rid), keys.attempt(rid)]


def _script_args(event: Event, ttl: int) -> list[bytes | int]:
    return [encode_event(event), event.seq, ttl, event.attempt, int(event.terminal)]


async def begin_attempt(
    redis: Redis, keys: Keys, request_id: str, attempt: int, ttl_seconds: int
) -> int:
    """Fence off older attempts of the request and return the log's last seq to continue
    from; or ``STALE_ATTEMPT`` when a newer attempt has already begun, or ``FINISHED`` when
    the log already ends with a terminal event (then nothing was fenced)."""
    last: int = await redis.eval(
        BEGIN_ATTEMPT, 2, keys.log(request_id), keys.attempt(request_id), attempt, ttl_seconds
    )
    return last


async def last_seq(redis: Redis, keys: Keys, request_id: str) -> int:
    """The highest seq in the request's log: 0 when only queued, or when there is no log.

    A worker that picks up a redelivered job continues numbering from here.
    """
    newest = await redis.xrevrange(keys.log(request_id), "+", "-", count=1)
    if not newest:
        return 0
    return _entry(newest[0]).seq


async def read_log(
    redis: Redis, keys: Keys, request_id: str, after: bytes | None = None
) -> list[LogEntry]:
    """The log's entries in append order, all of them or only those after stream id ``after``."""
    start: bytes | str = b"(" + after if after is not None else "-"
    entries = await redis.xrange(keys.log(request_id), start, "+")
    return [_entry(entry) for entry in entries or ()]


def _entry(entry: tuple[object, object]) -> LogEntry:
    """A log entry from redis-py's reply; a malformed entry gets seq -1 and is skipped later."""
    stream_id, fields = entry
    if not isinstance(stream_id, bytes) or not isinstance(fields, dict):
        raise TypeError("replay logs must be read with a decode_responses=False client")
    seq_field = fields.get(LOG_SEQ_FIELD.encode())
    data = fields.get(LOG_EVENT_FIELD.encode())
    seq = int(seq_field) if isinstance(seq_field, bytes) and seq_field.isdigit() else -1
    return LogEntry(stream_id=stream_id, seq=seq, data=data if isinstance(data, bytes) else b"")
