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

# Events in order; for event i (from 1): KEYS[3i-2] its channel, KEYS[3i-1] its log, KEYS[3i]
# its attempt key; ARGV[2i] the encoded event, ARGV[2i+1] "seq attempt terminal" (terminal is
# 1 for done/error, else 0); ARGV[1] the log TTL in seconds. Returns one 1 (written) or 0
# (fenced) per event. Channels are passed as keys only so Redis Cluster routes the call by
# their hash tag. `seq` is stored as a field of its own so XREVRANGE COUNT 1 finds the last one
# without decoding; a terminal event's entry also gets an `end` field, for BEGIN_ATTEMPT. The
# fence: once a newer attempt has begun (BEGIN_ATTEMPT), a stale worker's events are refused
# instead of interleaving two attempts. Append before publish: whoever hears an event can find
# it logged. A worker sends all events of an engine step in one call: one command to encode,
# send and parse per step instead of one per event.
PUBLISH_EVENTS: Final = """
local ttl = ARGV[1]
local written = {}
for i = 1, #KEYS / 3 do
  local channel, log, attempt_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local event = ARGV[2 * i]
  local seq, attempt, terminal = string.match(ARGV[2 * i + 1], '^(%d+) (%d+) ([01])$')
  if tonumber(redis.call('GET', attempt_key) or '0') > tonumber(attempt) then
    written[i] = 0
  else
    if terminal == '1' then
      redis.call('XADD', log, '*', 'seq', seq, 'e', event, 'end', '1')
    else
      redis.call('XADD', log, '*', 'seq', seq, 'e', event)
    end
    redis.call('PUBLISH', channel, event)
    redis.call('EXPIRE', log, ttl)
    if redis.call('EXISTS', attempt_key) == 1 then
      redis.call('EXPIRE', attempt_key, ttl)
    end
    written[i] = 1
  end
end
return written
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
) -> list[bool]:
    """Publish and log the events, in order, in one script call; return per event whether it
    was written (False: a newer attempt fenced it off).

    Given a pipeline, the call is only queued and nothing is returned here: the caller executes
    the pipeline, together with whatever else it batches into that round trip, and finds the
    script's reply among the pipeline's results.
    """
    if ttl_seconds < 1:
        raise ValueError(f"ttl_seconds must be >= 1, got {ttl_seconds}")
    events = list(events)
    if not events:
        return []
    script_keys, script_args = publish_call(keys, events, ttl_seconds)
    if isinstance(redis, Pipeline):
        redis.eval(PUBLISH_EVENTS, len(script_keys), *script_keys, *script_args)
        return []
    written = await redis.eval(PUBLISH_EVENTS, len(script_keys), *script_keys, *script_args)
    return [bool(flag) for flag in written]


def publish_call(
    keys: Keys, events: Iterable[Event], ttl: int
) -> tuple[list[str], list[bytes | int | str]]:
    """KEYS and ARGV of one PUBLISH_EVENTS call, for callers that EVAL it themselves."""
    script_keys: list[str] = []
    script_args: list[bytes | int | str] = [ttl]
    for event in events:
        rid = event.request_id
        script_keys += (keys.out(rid), keys.log(rid), keys.attempt(rid))
        script_args += (encode_event(event), f"{event.seq} {event.attempt} {int(event.terminal)}")
    return script_keys, script_args


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
