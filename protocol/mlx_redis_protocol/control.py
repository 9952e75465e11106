"""Control commands from the sender's side: publish, then collect replies from a list.

A command goes out on pub/sub (to every worker, or one) naming a fresh ``reply_to`` list;
workers RPUSH their replies there (with an EXPIRE) and the sender waits with BLPOP, so a
reply pushed before the sender starts waiting is not lost and nothing polls.
"""

from __future__ import annotations

import time
import uuid
from typing import Final

from redis.exceptions import NoPermissionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from mlx_redis_protocol.catalogue import live_heartbeats, live_worker_ids
from mlx_redis_protocol.codec_control import decode_reply, encode_command
from mlx_redis_protocol.connection import RedisClient, publish, raise_if_cancelled
from mlx_redis_protocol.errors import ControlTimeout, ProtocolError
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.messages import ControlCommand, ControlReply

# BLPOP treats a timeout of 0 as "forever", so the last wait is never rounded down to 0.
MIN_BLPOP_TIMEOUT: Final = 0.01
_BLOCK_MARGIN: Final = 0.25
# What a redis-py connection uses when no socket_timeout was given (redis-py >= 6).
_REDIS_PY_SOCKET_TIMEOUT: Final = 5.0


# The abort marker's value (rule 5): ANY_MODEL stops the request whatever its model; a model's
# name stops it only in that model's workers (an abort that names a model), whose others ignore
# it as they ignore the command.
ANY_MODEL: Final = b"1"


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
) -> list[ControlReply]:
    """Send one command and return the replies.

    Waits for one reply when ``worker_id`` names a worker; for a broadcast, for as many
    replies as there are live heartbeats (or pub/sub receivers when no worker heartbeats),
    or until ``timeout``. With ``model``, only workers serving that model act and answer: a
    broadcast waits for as many replies as live heartbeats advertise the model, and for
    none when no heartbeat does. Raises ControlTimeout if no reply came and
    ``require_reply``.
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
            replies = []
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
    """How many registered workers have an unexpired heartbeat."""
    return len(await live_worker_ids(redis, keys))


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
) -> list[ControlReply]:
    replies: dict[str, ControlReply] = {}
    deadline = time.monotonic() + timeout
    block_limit = longest_block(redis)
    # Whether LPOP with a count may take what else is queued after each BLPOP: a broadcast
    # to a thousand workers then costs a few round trips, not one per reply. An ACL without
    # +lpop (granted before it was needed) falls back to one BLPOP per reply.
    batched = True
    while len(replies) < expected and (remaining := deadline - time.monotonic()) > 0:
        raise_if_cancelled()
        block = max(min(remaining, block_limit), MIN_BLPOP_TIMEOUT)
        try:
            popped = await redis.blpop([command.reply_to], timeout=block)
        except RedisTimeoutError:
            # The reply came later than the socket timeout allows (a loaded machine): wait on
            # until the command's own deadline. Not sent again behind our back: a BLPOP whose
            # reply was lost may have popped a reply, and that one only is gone.
            continue
        if popped is None:
            continue
        raw = [popped[1]]
        wanted = expected - len(replies) - 1
        if batched and wanted > 0:
            try:
                more = await redis.lpop(command.reply_to, wanted)
            except NoPermissionError:
                batched = False
            else:
                raw += more if isinstance(more, list) else []
        for value in raw:
            reply = decode_reply(value, limits)
            # The list name is unique to this command, but a confused worker could still
            # answer another id; such a reply is not an answer to this command. One reply per
            # worker: a second one (a reply pushed twice) must not stand in for a worker
            # still to answer.
            if reply.id == command.id:
                replies.setdefault(reply.worker_id, reply)
    return list(replies.values())
