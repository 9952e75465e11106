"""A stand-in worker for control commands: listens, answers, keeps a heartbeat."""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis

from mlx_redis_protocol.codec_control import decode_command, encode_reply
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import ControlCommand, ControlReply, ErrorInfo
from tests.support.fleet import write_heartbeat


class FakeResponder:
    """Answers ping/stats/abort/cache_* on the broadcast and its own channel."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        worker_id: str,
        *,
        heartbeat: bool = True,
        delay: float = 0.0,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_id = worker_id
        self.heartbeat = heartbeat
        self.delay = delay
        self.received: list[ControlCommand] = []
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        # Stopped by a flag, not by cancel(): on Python 3.11 a cancel can be lost inside
        # redis-py (see protocol/mlx_redis_protocol/connection.py) and the loop would run on.
        self._stop = asyncio.Event()

    async def __aenter__(self) -> FakeResponder:
        self._task = asyncio.create_task(self._serve())
        await asyncio.wait_for(self._ready.wait(), 5)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._task is not None
        self._stop.set()
        await asyncio.wait_for(self._task, 5)
        await self.redis.delete(self.keys.worker(self.worker_id))

    async def _serve(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(self.keys.control, self.keys.control_for(self.worker_id))
        for _ in range(2):  # both subscriptions confirmed before anyone sends
            await pubsub.get_message(timeout=5)
        if self.heartbeat:
            await write_heartbeat(self.redis, self.keys, self.worker_id, b"1", ttl_ms=30_000)
        self._ready.set()
        try:
            while not self._stop.is_set():
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
                if message is None:
                    continue
                command = decode_command(message["data"])
                self.received.append(command)
                await asyncio.sleep(self.delay)
                reply = encode_reply(self.answer(command))
                await self.redis.rpush(command.reply_to, reply)
                await self.redis.expire(command.reply_to, 60)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    def answer(self, command: ControlCommand) -> ControlReply:
        result: dict[str, Any] | None = None
        if command.kind == "stats":
            result = {"running": 1, "queued": 0, "worker": self.worker_id}
        elif command.kind == "cache_load" and command.name == "missing":
            return ControlReply(
                id=command.id,
                ok=False,
                worker_id=self.worker_id,
                error=ErrorInfo("not_found", f"no cache named {command.name}"),
            )
        elif command.kind not in ("ping", "abort", "cache_save", "cache_load", "cache_clear"):
            return ControlReply(
                id=command.id,
                ok=False,
                worker_id=self.worker_id,
                error=ErrorInfo("unknown_command", command.kind),
            )
        return ControlReply(id=command.id, ok=True, worker_id=self.worker_id, result=result)
