"""Control commands from the sender's side: publish, then collect replies from a list.

A command goes out on pub/sub (to every worker, or one) naming a fresh ``reply_to`` list;
workers RPUSH their replies there (the one that makes the list sets its EXPIRE) and the
sender waits on the list, so a reply pushed before the sender starts waiting is not lost and
nothing polls. Each wait takes every reply queued by then in one round trip (BLMPOP with a
count), so a broadcast to a thousand workers costs the sender a few reads, not one per reply.
"""

from __future__ import annotations

import time
import uuid
import weakref
from collections.abc import Iterable
from typing import Any, Final

from redis.exceptions import NoPermissionError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mlx_redis_protocol.catalogue import count_live, live_heartbeats
from mlx_redis_protocol.codec_control import decode_reply, encode_command
from mlx_redis_protocol.connection import RedisClient, publish, raise_if_cancelled
from mlx_redis_protocol.errors import ControlTimeout, ProtocolError
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import ControlCommand, ControlReply
from mlx_redis_protocol.registry import read_registry

# BLPOP treats a timeout of 0 as "forever", so the last wait is never rounded down to 0.
MIN_BLPOP_TIMEOUT: Final = 0.01
_BLOCK_MARGIN: Final = 0.25
# Clients whose server or user refused BLMPOP: their later commands go straight to BLPOP (no
# refused round trip, no ACL log entry, per command).
_REFUSE_BLMPOP: Final[weakref.WeakSet[RedisClient]] = weakref.WeakSet()
# What a redis-py connection uses when no socket_timeout was given (redis-py >= 6).
_REDIS_PY_SOCKET_TIMEOUT: Final = 5.0


# The abort marker's value (rule 5): ANY_MODEL stops the request whatever its model; a model's
# name stops it only in that model's workers (an abort that names a model), whose others ignore
# it as they ignore the command.
ANY_MODEL: Final = b"1"


class ControlReplies(list[ControlReply]):
    """The replies to one control command, one per worker, in the order they came, and how
    many the sender waited for (``expected``): fewer replies than that means the timeout came
    first, and the workers missing did not answer in time."""

    def __init__(self, replies: Iterable[ControlReply] = (), *, expected: int = 0) -> None:
        super().__init__(replies)
        self.expected = expected

    @property
    def complete(self) -> bool:
        """Whether every worker waited for answered."""
        return len(self) >= self.expected


def abort_marker(model: str | None) -> bytes:
    """The value of ``mlxw:abort:{id}`` for an abort naming ``model`` (None: any model)."""
    return ANY_MODEL if model is None else model.encode()


def marker_stops(value: bytes | None, model: str) -> bool:
    """Whether an abort marker of this value (None: no marker) stops a job of ``model``. Any
    value that is not a model's name, the empty one included, stops every model's job."""
    if value is None:
        return False
    named = value.decode("utf-8", "replace")
    return value == ANY_MODEL or named == model or not is_valid_id(named)


async def send_command(
    redis: RedisClient,
    keys: Keys,
    kind: str,
    *,
    timeout: float,
    limits: Limits,
    worker_id: str | None = None,
    request_id: str | None = None,
    name: str | None = None,
    model: str | None = None,
    require_reply: bool = True,
) -> ControlReplies:
    """Send one command and return the replies, with how many were waited for.

    Waits for one reply when ``worker_id`` names a worker; for a broadcast, for as many
    replies as there are live heartbeats (or pub/sub receivers when no worker heartbeats),
    or until ``timeout``: never longer, however many workers are slow, and then the replies
    that came (``len(replies) < replies.expected``). With ``model``, only workers serving
    that model act and answer: a broadcast waits for as many replies as live heartbeats
    advertise the model, and for none when no heartbeat does. Raises ControlTimeout if no
    reply came and ``require_reply``.
    """
    if model is not None and not is_valid_id(model):
        raise ProtocolError("invalid_field", f"command.model must be {ID_RULE}, got {model!r}")
    token = uuid.uuid4().hex
    command = ControlCommand(
        kind=kind,
        id=token,
        reply_to=keys.reply(token),
        request_id=request_id,
        name=name,
        model=model,
    )
    channel = keys.control if worker_id is None else keys.control_for(worker_id)
    receivers = await publish(redis, channel, encode_command(command))
    if worker_id is not None:
        heartbeats = int(await redis.exists(keys.worker(worker_id)))
        expected = 1
    elif model is not None:
        # Workers of other models ignore the command: only this model's may answer.
        heartbeats = receivers = await count_serving_workers(redis, keys, model)
        expected = heartbeats
    else:
        heartbeats = await count_live_workers(redis, keys)
        expected = heartbeats or receivers
    try:
        # Nobody subscribed and nobody alive: no reply can come, so don't wait for one.
        if receivers == 0 and heartbeats == 0:
            replies = ControlReplies(expected=0)
        else:
            replies = await _collect(redis, command, expected, timeout, limits)
    finally:
        await redis.delete(command.reply_to)
    if not replies and require_reply:
        target = f"worker {worker_id!r}" if worker_id is not None else "any worker"
        if model is not None:
            target += f" serving model {model!r}"
        if worker_id is None and heartbeats == 0 and model is not None:
            raise ControlTimeout(f"no reply to {kind!r}: no live worker serves model {model!r}")
        raise ControlTimeout(f"no reply to {kind!r} from {target} within {timeout:g} s")
    return replies


async def count_live_workers(redis: RedisClient, keys: Keys) -> int:
    """How many registered workers have an unexpired heartbeat (their keys' EXISTS: no
    heartbeat is read or decoded)."""
    return await count_live(redis, keys, (await read_registry(redis, keys)).workers)


async def count_serving_workers(redis: RedisClient, keys: Keys, model: str) -> int:
    """How many workers have an unexpired heartbeat that advertises ``model``."""
    return sum(beat.serves(model) for beat in await live_heartbeats(redis, keys))


def longest_block(redis: RedisClient) -> float:
    """How long one BLPOP may block: well inside the client's socket timeout (redis-py's
    default is 5 s), which would otherwise fail the read of a longer BLPOP. The margin covers
    the server's timeout granularity (100 ms at the default hz 10)."""
    configured = redis.get_connection_kwargs()
    socket_timeout = configured.get("socket_timeout", _REDIS_PY_SOCKET_TIMEOUT)
    if not socket_timeout:
        return float("inf")
    block: float = min(socket_timeout / 2, socket_timeout - _BLOCK_MARGIN)
    return max(block, MIN_BLPOP_TIMEOUT)


async def _collect(
    redis: RedisClient, command: ControlCommand, expected: int, timeout: float, limits: Limits
) -> ControlReplies:
    replies: dict[str, ControlReply] = {}
    deadline = time.monotonic() + timeout
    block_limit = longest_block(redis)
    reader = ReplyReader(redis, command.reply_to)
    while len(replies) < expected and (remaining := deadline - time.monotonic()) > 0:
        raise_if_cancelled()
        block = max(min(remaining, block_limit), MIN_BLPOP_TIMEOUT)
        try:
            raw = await reader.take(block, expected - len(replies))
        except RedisTimeoutError:
            # The reply came later than the socket timeout allows (a loaded machine): wait on
            # until the command's own deadline. Not sent again behind our back: a read whose
            # reply was lost may have popped replies, and those only are gone.
            continue
        for value in raw:
            reply = decode_reply(value, limits)
            # The list name is unique to this command, but a confused worker could still
            # answer another id; such a reply is not an answer to this command. One reply per
            # worker: a second one (a reply pushed twice) must not stand in for a worker
            # still to answer.
            if reply.id == command.id:
                replies.setdefault(reply.worker_id, reply)
    return ControlReplies(replies.values(), expected=expected)


class ReplyReader:
    """Takes the replies off one command's reply list, all those queued (up to ``wanted``)
    in one round trip that blocks while there are none: ``BLMPOP … COUNT`` (Redis >= 7.0).
    Where it is refused (an older server; an ACL without it, granted before it was used),
    ``BLPOP`` and then ``LPOP`` with a count, two round trips; without ``LPOP`` either, one
    ``BLPOP`` per reply. A client refused BLMPOP once is not asked again. ``reads`` counts
    the round trips."""

    def __init__(self, redis: RedisClient, key: str) -> None:
        self.redis = redis
        self.key = key
        self.blmpop = redis not in _REFUSE_BLMPOP
        self.lpop = True
        self.reads = 0

    async def take(self, block: float, wanted: int) -> list[Any]:
        """Up to ``wanted`` replies, waiting up to ``block`` seconds for the first; [] if
        none came."""
        if self.blmpop:
            self.reads += 1
            try:
                popped: Any = await self.redis.blmpop(
                    block, 1, self.key, direction="LEFT", count=max(wanted, 1)
                )
            except RedisError as exc:
                if not _refused(exc):
                    raise
                self.blmpop = False
                _REFUSE_BLMPOP.add(self.redis)
            else:
                return list(popped[1]) if popped else []
        self.reads += 1
        first: Any = await self.redis.blpop([self.key], timeout=block)
        if first is None:
            return []
        taken: list[Any] = [first[1]]
        if self.lpop and wanted > 1:
            self.reads += 1
            try:
                more = await self.redis.lpop(self.key, wanted - 1)
            except NoPermissionError:
                self.lpop = False
            else:
                taken += more if isinstance(more, list) else []
        return taken


def _refused(exc: RedisError) -> bool:
    """Whether a command failed because this server or user may not run it (not for what it
    was asked): an ACL without it, a server that does not know it (Redis < 7.0 answers
    "unknown command"; redis-py's Cluster client finds it missing from COMMAND's list)."""
    if isinstance(exc, NoPermissionError):
        return True
    message = str(exc).lower()
    if isinstance(exc, ResponseError):
        return "unknown command" in message
    return "doesn't exist" in message
