"""A worker's claim on its id: ``mlxw:claim:{worker_id}``, so two live workers never share one.

The id names the worker's consumer in every group, so two live processes under one id would
read each other's pending jobs as their own, and one's clean stop would remove the other's
consumers. The claim is a string key set with ``SET NX`` and a TTL, renewed with every
heartbeat; its value (JSON) holds a random token of this process, its host and pid. A second
worker whose id is held by a live one refuses to start (``WorkerIdHeld``: one line naming the
holder). A holder is dead, and its claim taken over at once, when it is on this host and its
pid is gone (a restart after ``kill -9``), or is this very pid (a container restarted with
the same hostname, whose worker is always pid 1); a dead holder elsewhere is waited out by
the TTL. A clean stop deletes the claim only while it is still this process's (compare and
delete): a worker never removes another's claim.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import structlog
from redis.exceptions import OutOfMemoryError

from mlx_redis_protocol.connection import RedisClient, as_text
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.lua import run_script

log = structlog.get_logger(__name__)

# `mlx-worker run`'s exit status when its id is held by a live worker (at start, or taken
# over while this one could not reach Redis): a supervisor may restart it later, when the
# holder is gone, or stop trying (systemd: RestartPreventExitStatus=3).
EXIT_ID_HELD: Final = 3

# KEYS[1] claim. ARGV: our value, TTL ms, the value we may replace ("" for none). Takes the
# claim when it is free, ours already (renewed) or still the dead holder's value we saw; else
# returns the holder's value untouched. One step: two starting workers never both win.
ACQUIRE: Final = """
local held = redis.call('GET', KEYS[1])
if (not held) or held == ARGV[1] or (ARGV[3] ~= '' and held == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {1, ARGV[1]}
end
return {0, held}
"""

# KEYS[1] claim, KEYS[2..] keys of the worker written with it (the heartbeat, the activity:
# all in the id's hash slot). ARGV: our value, TTL ms (the claim's and theirs), their values.
# Renews the claim and writes the keys only while the claim is ours or free (a renewal that
# finds it free takes it again, as ACQUIRE does); else returns the holder's value and writes
# nothing. One command for a heartbeat's writes: at a thousand idle workers, each command per
# beat costs Redis some 0.2% of a core. A full Redis (noeviction) refuses writes but not new
# TTLs: then the keys' last values are kept alive, so a live worker does not look dead while
# memory is freed. {1, whether KEYS[2] existed}, {2, the same} when only kept alive, or
# {0, holder}.
BEAT: Final = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then
  return {0, held}
end
local existed = 0
if #KEYS > 1 then
  existed = redis.call('EXISTS', KEYS[2])
end
local claimed = redis.pcall('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if type(claimed) == 'table' and claimed['err'] then
  if not string.find(claimed['err'], 'OOM', 1, true) then
    return redis.error_reply(claimed['err'])
  end
  for i = 1, #KEYS do
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  end
  return {2, existed}
end
for i = 2, #KEYS do
  redis.call('SET', KEYS[i], ARGV[i + 1], 'PX', ARGV[2])
end
return {1, existed}
"""

# KEYS[1] claim. ARGV: our value. Deletes it only while it is ours.
RELEASE: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True, slots=True)
class Renewed:
    """What a renewal did with the keys written with it: ``written`` (else only kept alive:
    Redis is full), and whether the first of them ``existed`` before (not after a start, an
    expiry during an outage, or a Redis that lost its data)."""

    written: bool
    existed: bool


class WorkerIdHeld(Exception):
    """Another live worker holds this worker id: this one must not serve under it."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a claim, as its value tells (fields of the wrong type read as unknown)."""

    token: str
    host: str
    pid: int
    started_at: float

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at))
        return f"pid {self.pid} on host {self.host!r} (started {started})"


def decode_holder(raw: bytes | str | None) -> Holder | None:
    """The holder in a claim's value; None for a value that is not one of ours."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    token, host, pid, started_at = (value.get(k) for k in ("token", "host", "pid", "started_at"))
    return Holder(
        token=token if isinstance(token, str) else "",
        host=host if isinstance(host, str) else "",
        pid=pid if isinstance(pid, int) and not isinstance(pid, bool) else 0,
        started_at=float(started_at) if isinstance(started_at, int | float) else 0.0,
    )


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (one of another user's counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerClaim:
    """This process's claim on ``worker_id``."""

    def __init__(self, *, redis: RedisClient, keys: Keys, worker_id: str, ttl_ms: int) -> None:
        self.redis = redis
        self.key = keys.claim(worker_id)
        self.worker_id = worker_id
        self.ttl_ms = ttl_ms
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.value = json.dumps(
            {
                "token": secrets.token_hex(16),
                "host": self.host,
                "pid": self.pid,
                "started_at": time.time(),
            }
        )

    async def acquire(self) -> None:
        """Take the claim (or renew it, when ours already); WorkerIdHeld when a live worker
        holds it. A holder that is dead on this host is replaced at once."""
        taken, held = await self._try(replace="")
        if taken:
            return
        holder = decode_holder(held)
        if holder is not None and self._dead_here(holder):
            taken, held = await self._try(replace=as_text(held))
            if taken:
                log.info("worker_id_taken_over", worker_id=self.worker_id, holder=holder.describe())
                return
            holder = decode_holder(held)
        raise WorkerIdHeld(self._refusal(holder))

    async def renew(self, writes: Sequence[tuple[str, str | bytes]] = ()) -> Renewed:
        """Renew the claim with the heartbeat and write ``writes`` (key, value: keys of this
        worker's id, with the claim's TTL) in the same step. WorkerIdHeld, nothing written,
        when another worker took the claim (it expired while this one could not reach Redis,
        and a new one started under the id). OutOfMemoryError when Redis is full and the
        first key did not exist to be kept alive."""
        reply = await run_script(
            self.redis,
            BEAT,
            [self.key, *(key for key, _ in writes)],
            [self.value, self.ttl_ms, *(value for _, value in writes)],
        )
        status, existed = int(reply[0]), reply[1]
        if status == 0:
            raise WorkerIdHeld(self._refusal(decode_holder(existed)))
        if status == 2 and writes and not existed:
            raise OutOfMemoryError("Redis is full (noeviction): the heartbeat was not written")
        return Renewed(written=status == 1, existed=bool(existed))

    async def release(self) -> bool:
        """Delete the claim if it is still ours; whether it was."""
        return bool(await run_script(self.redis, RELEASE, [self.key], [self.value]))

    async def _try(self, *, replace: str) -> tuple[bool, bytes | str | None]:
        reply = await run_script(
            self.redis, ACQUIRE, [self.key], [self.value, self.ttl_ms, replace]
        )
        return bool(reply[0]), reply[1]

    def _dead_here(self, holder: Holder) -> bool:
        """A holder on this host whose process is gone, or that had this very pid (a
        restarted container: the old process cannot be this one, which just made its token)."""
        return holder.host == self.host and (holder.pid == self.pid or not pid_alive(holder.pid))

    def _refusal(self, holder: Holder | None) -> str:
        who = holder.describe() if holder is not None else "an unreadable claim"
        return (
            f"worker id {self.worker_id!r} is held by a live worker: {who} "
            f"({self.key}); give this worker another --worker-id, or stop that one"
        )
