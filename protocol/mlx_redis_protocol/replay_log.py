"""The replay log on the Redis side: atomic publish+append, and reads of what was appended.

Every event is appended to the request's log and published on its channel by one Lua script,
so a subscriber that saw an event live can always find it (and all before it) in the log.
Clients given to these helpers must use ``decode_responses=False``: events are binary.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import SlotNotCoveredError
from redis.typing import EncodableT

from mlx_redis_protocol.codec_events import encode_event
from mlx_redis_protocol.connection import RedisClient
from mlx_redis_protocol.constants import DEFAULT_LOG_TTL_SECONDS, LOG_EVENT_FIELD, LOG_SEQ_FIELD
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script, run_script_on_nodes
from mlx_redis_protocol.messages import Event

# The newest event a worker wrote to a log: its seq and whether it ends the request; seq -1
# for an empty (or expired) log, 0 when it holds only producers' queued markers. Markers (seq
# 0) may follow the worker's events: a producer that re-submits a request writes a new one,
# and that must neither hide the request's end (it would run twice) nor reset the numbering.
# Shared by both scripts below (Lua scripts cannot call each other).
NEWEST_EVENT: Final = """
local function newest_event(log)
  local before = '+'
  local seq = -1
  while true do
    local entry = redis.call('XREVRANGE', log, before, '-', 'COUNT', 1)[1]
    if not entry then
      return seq, false
    end
    seq = 0
    local fields, ended, found = entry[2], false, 0
    for f = 1, #fields, 2 do
      if fields[f] == 'seq' then
        found = tonumber(fields[f + 1]) or 0
      elseif fields[f] == 'end' then
        ended = true
      end
    end
    if found > 0 or ended then
      return found, ended
    end
    before = '(' .. entry[1]
  end
end
"""

# ARGV[1] the log TTL in seconds; ARGV[2] PUBLISH, or SPUBLISH on a Redis Cluster (sharded
# pub/sub: a message goes to the shard of its channel, not to every node). Then per event i
# (from 1): KEYS[3i-2] its channel, KEYS[3i-1] its log, KEYS[3i] its attempt key; ARGV[2i+1]
# the encoded event, ARGV[2i+2] "seq attempt terminal run" (terminal is 1 for done/error, else
# 0; run is the token the attempt was begun with, "-" for the producer's queued marker).
# Returns per event: 1 it is in the log, 0 refused (fenced: the request's attempt key does not
# name this attempt and run), 2 refused (the log lacks events this attempt wrote before).
#
# Channels are passed as keys only so Redis Cluster routes the call by their hash tag; on a
# Cluster one call carries only keys of one slot (PUBLISH_EVENTS_ON_NODE: of one node). `seq`
# is a field of its own so XREVRANGE COUNT 1 finds the newest without decoding; a terminal
# entry also gets `end`, for BEGIN_ATTEMPT. Append before publish: whoever hears an event can
# find it logged.
#
# Idempotent by seq: an event whose seq the log already holds is not written or published
# again, so a call whose reply was lost (a timeout, a failover) can simply be sent again.
# The fence: only the run that began the attempt (BEGIN_ATTEMPT) writes for it, so a stale
# worker's events are refused instead of interleaving two runs; so are those of a run whose
# begin Redis lost (a failover), which could otherwise share an attempt number with a new
# delivery of the job. The gap check: events after a hole would leave subscribers waiting
# forever for the missing seq (a failover to a replica that had not received the newest
# entries); the worker restarts the attempt instead. A log that is gone altogether (expired)
# is written afresh. The attempt key lives until the request's terminal event, then gets the
# log's TTL.
PUBLISH_EVENTS: Final = (
    NEWEST_EVENT
    + """
local ttl, publish = ARGV[1], ARGV[2]
if publish ~= 'PUBLISH' and publish ~= 'SPUBLISH' then
  return redis.error_reply('ERR ARGV[2] must be PUBLISH or SPUBLISH')
end
local newest = {}
local results = {}
for i = 1, #KEYS / 3 do
  local channel, log, attempt_key = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local event = ARGV[2 * i + 1]
  local seq, attempt, terminal, run = string.match(ARGV[2 * i + 2], '^(%d+) (%d+) ([01]) (%S+)$')
  seq = tonumber(seq)
  if attempt ~= '0' and redis.call('GET', attempt_key) ~= attempt .. ' ' .. run then
    results[i] = 0
  else
    local last = newest[log]
    if last == nil then
      last = newest_event(log)
    end
    if seq <= last then
      results[i] = 1
    elseif last >= 0 and seq > last + 1 then
      results[i] = 2
    else
      if terminal == '1' then
        redis.call('XADD', log, '*', 'seq', seq, 'e', event, 'end', '1')
      else
        redis.call('XADD', log, '*', 'seq', seq, 'e', event)
      end
      redis.call(publish, channel, event)
      redis.call('EXPIRE', log, ttl)
      if terminal == '1' then
        redis.call('EXPIRE', attempt_key, ttl)
      end
      last = seq
      results[i] = 1
    end
    newest[log] = last
  end
end
return results
"""
)

# PUBLISH_EVENTS for one Cluster node: every event of a step whose request lives on that
# node, whatever its slot, in one call (one call per slot would be a script call per request
# and step, as many as there are deltas). Redis runs a call with declared keys only when they
# share a slot, so this one declares none: ARGV[1] is the number N of key names, ARGV[2..N+1]
# are PUBLISH_EVENTS' KEYS and the rest its ARGV, which local KEYS and ARGV hand to the same
# script. The flag lets it reach keys of several slots, all of which must be the node's own:
# one a node no longer serves (its slot moved) fails the call at that key, and the caller
# reads the slot map again and sends it again (idempotent by seq, as PUBLISH_EVENTS is).
PUBLISH_EVENTS_ON_NODE: Final = (
    """#!lua flags=allow-cross-slot-keys
local names = tonumber(ARGV[1])
local keys, args = {}, {}
for i = 1, names do
  keys[i] = ARGV[i + 1]
end
for i = names + 2, #ARGV do
  args[#args + 1] = ARGV[i]
end
local KEYS, ARGV = keys, args
"""
    + PUBLISH_EVENTS
)

# KEYS[1] log, KEYS[2] attempt key, KEYS[3] (optional) the finished marker; ARGV[1] attempt, ARGV[2]
# TTL seconds, ARGV[3] the run's token (unique per run of an attempt; "WORKER/ENTRY/TOKEN" names the
# job stream entry that the run serves). A worker calls it before publishing anything for an
# attempt: from then on only this run writes the request's events, and the seq it returns (the log's
# last) is final, since no other run can append after it. Returns -2 when the log's newest event is
# terminal (the job is finished: nothing may follow it, whatever queued markers a re-submission
# appended); -4 when the log does not end but the finished marker exists (the request finished, its
# log expired since, and a producer queued it again: it must not run again); -3 when the fence names
# another job entry of the same request (a producer queued it twice, or a forward was repeated):
# that entry's run owns the request, whatever the attempt numbers say, since delivery counts of two
# entries are unrelated, and taking over would splice two runs into one attempt; -1 when a newer
# attempt has already begun (this delivery is stale), or with ARGV[4] = "IFFREE" when any attempt
# has begun: a worker ending a request that still waits (an abort) must not take it from the worker
# that started it; or, with ARGV[4] = "IFFENCE", when the fence is not exactly ARGV[5]: the abort of
# a job whose worker died takes over from that run only, never from one that began meanwhile. The
# checks and the fence are one atomic step, so an older attempt's last event cannot land between
# "not finished yet" and "fenced". Safe to repeat with the same token: it sets the same fence and
# returns the same seq. The fence has no TTL while the request runs (a long prefill publishes
# nothing for a while); the terminal event gives it the log's. It renews the log's TTL, so a log
# that waited almost its TTL in the queue does not expire between here and the first event.
BEGIN_ATTEMPT: Final = (
    NEWEST_EVENT
    + """
local seq, ended = newest_event(KEYS[1])
if ended then
  return -2
end
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then
  return -4
end
local fence = redis.call('GET', KEYS[2])
local entry = string.match(ARGV[3], '^[^/]*/([^/]+)/')
if fence and entry then
  local owner = string.match(fence, '^%d+ [^/]*/([^/]+)/')
  if owner and owner ~= entry then
    return -3
  end
end
if ARGV[4] == 'IFFENCE' then
  if fence ~= ARGV[5] then
    return -1
  end
elseif fence and (ARGV[4] == 'IFFREE'
    or tonumber(string.match(fence, '^%d+') or '0') > tonumber(ARGV[1])) then
  return -1
end
redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. ARGV[3])
if seq >= 0 then
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return math.max(seq, 0)
"""
)

STALE_ATTEMPT: Final = -1
FINISHED: Final = -2
DUPLICATE: Final = -3
REMEMBERED: Final = -4
# The run of the producer's queued marker (attempt 0), which no attempt fences.
NO_RUN: Final = "-"


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One raw entry of a replay log: its stream id, seq, and the encoded event."""

    stream_id: bytes
    seq: int
    data: bytes


class Outcome(IntEnum):
    """What PUBLISH_EVENTS did with one event."""

    FENCED = 0  # refused: a newer attempt owns the request
    LOGGED = 1  # in the log (appended by this call, or by an earlier one: nothing twice)
    LOG_GAP = 2  # refused: the log lost events this attempt wrote before


async def publish_events(
    redis: RedisClient,
    keys: Keys,
    events: Iterable[Event],
    *,
    ttl_seconds: int = DEFAULT_LOG_TTL_SECONDS,
    runs: Mapping[str, str] | None = None,
) -> list[Outcome]:
    """Log and publish the events, in order; returns what happened to each. ``runs`` maps
    each request id to the token its attempt was begun with (``begin_attempt``); the queued
    marker (attempt 0) needs none.

    One script call on a single server. On a Redis Cluster, one call per node holding some
    of the requests (PUBLISH_EVENTS_ON_NODE), all sent together: one round trip in parallel
    to the nodes involved. Safe to call again with the same events after an error (see the
    script); on a Cluster, an error may follow a slot that moved, the slot map read again.
    """
    if ttl_seconds < 1:
        raise ValueError(f"ttl_seconds must be >= 1, got {ttl_seconds}")
    events = list(events)
    if not events:
        return []
    if not isinstance(redis, RedisCluster):
        script_keys, script_args = publish_call(keys, events, ttl_seconds, runs, sharded=False)
        replies = await run_script(redis, PUBLISH_EVENTS, script_keys, script_args)
        return [Outcome(reply) for reply in replies]
    by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
    for index, event in enumerate(events):
        log = keys.event_keys(event.request_id)[1].decode()  # made once a request
        node = redis.get_node_from_key(log)
        if node is None:  # only asked of replicas; a slot without a master raises
            raise SlotNotCoveredError(f"no node serves {log}")
        by_node.setdefault(node.name, (node, []))[1].append(index)
    calls: list[tuple[ClusterNode, list[EncodableT]]] = []
    for node, indexes in by_node.values():
        script_keys, script_args = publish_call(
            keys, [events[i] for i in indexes], ttl_seconds, runs, sharded=True
        )
        calls.append((node, [len(script_keys), *script_keys, *script_args]))
    per_node = await run_script_on_nodes(redis, PUBLISH_EVENTS_ON_NODE, calls)
    outcomes: list[Outcome] = [Outcome.FENCED] * len(events)
    for (_, indexes), replies in zip(by_node.values(), per_node, strict=True):
        for index, reply in zip(indexes, replies, strict=True):
            outcomes[index] = Outcome(reply)
    return outcomes


def publish_call(
    keys: Keys,
    events: Iterable[Event],
    ttl: int,
    runs: Mapping[str, str] | None = None,
    *,
    sharded: bool,
) -> tuple[list[bytes], list[bytes | int | str]]:
    """KEYS and ARGV of one PUBLISH_EVENTS call (on a Cluster, PUBLISH_EVENTS_ON_NODE takes
    them as its ARGV: events of one node only), each event's as bytes: redis-py passes bytes
    through, where it checks and encodes every str."""
    runs = runs or {}
    script_keys: list[bytes] = []
    script_args: list[bytes | int | str] = [ttl, "SPUBLISH" if sharded else "PUBLISH"]
    for event in events:
        rid = event.request_id
        run = runs.get(rid, NO_RUN)
        script_keys += keys.event_keys(rid)
        script_args += (
            encode_event(event),
            f"{event.seq} {event.attempt} {int(event.terminal)} {run}".encode(),
        )
    return script_keys, script_args


def new_run(worker_id: str | None = None, entry_id: str | None = None) -> str:
    """A token for one run of an attempt (``begin_attempt``, then ``publish_events``); it
    names the worker that runs it, so others can tell a fence whose worker died, and the job
    entry it serves (``WORKER/ENTRY/TOKEN``), so a second entry of the same request is told
    from a redelivery of the first (``DUPLICATE``)."""
    token = secrets.token_hex(8)
    if not worker_id:
        return token
    return f"{worker_id}/{entry_id}/{token}" if entry_id else f"{worker_id}/{token}"


@dataclass(frozen=True, slots=True)
class Fence:
    """A request's attempt key: which attempt, which run, the worker of that run and the job
    entry it serves (None for a token that names none)."""

    raw: bytes
    attempt: int
    worker_id: str | None
    entry_id: str | None = None


def parse_fence(raw: bytes | str | None) -> Fence | None:
    """The fence ``"ATTEMPT RUN"`` read from a request's attempt key; None when absent or
    not of that shape."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = raw.encode()
    attempt, _, run = raw.decode(errors="replace").partition(" ")
    if not attempt.isdigit() or not run:
        return None
    parts = run.split("/")
    if len(parts) == 1:
        return Fence(raw=raw, attempt=int(attempt), worker_id=None)
    entry_id = parts[1] if len(parts) == 3 else None
    return Fence(raw=raw, attempt=int(attempt), worker_id=parts[0], entry_id=entry_id)


async def begin_attempt(
    redis: RedisClient,
    keys: Keys,
    request_id: str,
    attempt: int,
    ttl_seconds: int,
    run: str,
    *,
    if_free: bool = False,
    if_fence: bytes | None = None,
) -> int:
    """Fence the request for this run of ``attempt`` (a ``new_run()`` token) and return the
    log's last seq to continue from; or ``FINISHED`` when the log's newest event is terminal,
    ``REMEMBERED`` when it is not but the request's finished marker exists (its log expired),
    ``DUPLICATE`` when the fence names another job entry of the request (``new_run``'s
    ``entry_id``), or ``STALE_ATTEMPT`` when a newer attempt has already begun (with
    ``if_free``: when any attempt has; with ``if_fence``: when the fence is not exactly that
    value). Nothing is fenced in those cases."""
    if not run or run == NO_RUN or any(c.isspace() for c in run):
        raise ValueError(f"a run token must be a word, got {run!r}")
    log_key, fence_key = keys.log(request_id), keys.attempt(request_id)
    finished_key = keys.finished(request_id)
    mode: tuple[str | bytes, ...] = ()
    if if_fence is not None:
        mode = ("IFFENCE", if_fence)
    elif if_free:
        mode = ("IFFREE",)
    last: int = await run_script(
        redis,
        BEGIN_ATTEMPT,
        [log_key, fence_key, finished_key],
        [attempt, ttl_seconds, run, *mode],
    )
    return last


async def last_seq(redis: RedisClient, keys: Keys, request_id: str) -> int:
    """The seq of the newest event a worker wrote to the request's log, skipping producers'
    queued markers as the scripts do (``NEWEST_EVENT``): what a new attempt continues from;
    0 when only queued, or when there is no log."""
    before: bytes | str = "+"
    while entries := await redis.xrevrange(keys.log(request_id), before, "-", count=16):
        logged = [_entry(entry) for entry in entries]
        for entry in logged:
            if entry.seq > 0:
                return entry.seq
        before = b"(" + logged[-1].stream_id
    return 0


async def read_log(
    redis: RedisClient, keys: Keys, request_id: str, after: bytes | None = None
) -> list[LogEntry]:
    """The log's entries in append order, all of them or only those after stream id ``after``."""
    entries = await redis.xrange(keys.log(request_id), _after(after), "+")
    return [_entry(entry) for entry in entries or ()]


async def read_log_and_ttl(
    redis: RedisClient, keys: Keys, request_id: str, after: bytes | None = None
) -> tuple[list[LogEntry], int]:
    """``read_log``, and the log's PTTL in the same round trip (ms; -1: no TTL, -2: no log):
    a log cannot expire sooner than that, so one that vanishes sooner was lost."""
    log = keys.log(request_id)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.xrange(log, _after(after), "+")
        pipe.pttl(log)
        entries, ttl_ms = await pipe.execute()
    return [_entry(entry) for entry in entries or ()], int(ttl_ms)


def _after(after: bytes | None) -> bytes | str:
    return b"(" + after if after is not None else "-"


def _entry(entry: tuple[object, object]) -> LogEntry:
    """A log entry from redis-py's reply; a malformed entry gets seq -1 and is skipped later."""
    stream_id, fields = entry
    if not isinstance(stream_id, bytes) or not isinstance(fields, dict):
        raise TypeError("replay logs must be read with a decode_responses=False client")
    seq_field = fields.get(LOG_SEQ_FIELD.encode())
    data = fields.get(LOG_EVENT_FIELD.encode())
    seq = int(seq_field) if isinstance(seq_field, bytes) and seq_field.isdigit() else -1
    return LogEntry(stream_id=stream_id, seq=seq, data=data if isinstance(data, bytes) else b"")
