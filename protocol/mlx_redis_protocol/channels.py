"""One pub/sub connection for any number of channels (one per node on a Redis Cluster).

A client that follows a thousand requests needs a thousand channels, not a thousand
connections (each would hold a pool slot and a file descriptor). The hub subscribes a channel
while someone listens to it, hands each message to that channel's inboxes, and unsubscribes
when the last listener leaves. On a Cluster the channels are shard channels (``SSUBSCRIBE``):
each lives on the node that owns its hash slot, and redis-py's ClusterPubSub keeps one
connection per such node; the hub reads each of them.

When a connection drops, messages may have been missed while it was down: every inbox then
gets ``MISSED`` once the connection is back, so its listener re-reads what the channel stands
for (a replay log, say). redis-py re-subscribes on reconnect by itself.

On a Cluster, a node's lost connection also makes the hub read the slot map again: after a
failover, redis-py moves the node's shard channels to the promoted replica (its pub/sub
reconciles subscriptions with every new slot map), the dead node's reader hands over to the
readers of the nodes that hold them now, and every inbox gets ``MISSED`` (what was published
on the new master before the move went unheard).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any, Final

from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterPubSub, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from mlx_redis_protocol.connection import RedisClient, refresh_slot_map, retry_forever

# Put in an inbox after its connection came back: messages may have been lost meanwhile.
MISSED: Final = None
Inbox = asyncio.Queue[bytes | None]

SUBSCRIBE_CONFIRM_TIMEOUT: Final = 10.0
# How long one read waits before the reader looks at its bookkeeping again (a Cluster node's
# reader waits for its next message instead: see _next_message).
_READ_WAIT: Final = 1.0
_TORN_DOWN_PAUSE: Final = 0.05
# How often a gone Cluster node's reader looks whether its channels have moved to new nodes.
_HAND_OVER_PAUSE: Final = 0.1
# A reader waits out a lost connection (redis-py's PubSub reconnects on the next read, and
# subscribes its channels again) for as long as the hub is open.
_READ_RETRY: Final = retry_forever((RedisError, OSError))
_SUBSCRIBED: Final = frozenset({"subscribe", "ssubscribe"})
_MESSAGES: Final = frozenset({"message", "smessage"})


class ChannelHub:
    """Channels on demand over one pub/sub connection (per Cluster node) of ``redis``."""

    def __init__(self, redis: RedisClient) -> None:
        self._redis = redis
        self._pubsub: PubSub | ClusterPubSub | None = None
        self._inboxes: dict[bytes, set[Inbox]] = {}
        self._confirmed: dict[bytes, asyncio.Future[None]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._cleanups: set[asyncio.Task[None]] = set()
        # SUBSCRIBE and UNSUBSCRIBE go out one at a time: redis-py's PubSub opens its
        # connection on the first command, and two first commands at once would open two.
        self._commands = asyncio.Lock()
        self._closed = False

    @contextlib.asynccontextmanager
    async def listen(
        self, *channels: str, confirm_timeout: float = SUBSCRIBE_CONFIRM_TIMEOUT
    ) -> AsyncIterator[Inbox]:
        """Subscribe (and wait up to ``confirm_timeout`` for the server's confirmation, so
        nothing published from now on is missed), yield one inbox for messages of all
        ``channels``, unsubscribe at exit. A lost connection fails the wait at once."""
        inbox: Inbox = asyncio.Queue()
        names = [channel.encode() for channel in channels]
        joined: list[bytes] = []
        try:
            for name in names:
                joined.append(name)
                await self._join(name, inbox, confirm_timeout)
            yield inbox
        finally:
            for name in joined:
                await self._leave(name, inbox)

    @property
    def channels(self) -> int:
        """How many channels are subscribed now."""
        return len(self._inboxes)

    async def aclose(self) -> None:
        self._closed = True
        readers = list(self._readers.values())
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    async def _join(self, name: bytes, inbox: Inbox, confirm_timeout: float) -> None:
        listeners = self._inboxes.get(name)
        if listeners is not None:
            listeners.add(inbox)
            await asyncio.wait_for(asyncio.shield(self._confirmed[name]), confirm_timeout)
            return
        self._inboxes[name] = {inbox}
        confirmed = self._confirmed[name] = asyncio.get_running_loop().create_future()
        async with self._commands:
            pubsub = self._connection()
            try:
                if isinstance(pubsub, ClusterPubSub):
                    await pubsub.ssubscribe(name)
                else:
                    await pubsub.subscribe(name)
            except (RedisError, OSError):
                raise
            except Exception as exc:
                # redis-py: the reader tore the lost connection down while this command was
                # being written (its writer is gone). It is a lost connection like any other.
                raise RedisConnectionError(f"pub/sub connection reset: {exc!r}") from exc
            self._start_readers()
        await asyncio.wait_for(asyncio.shield(confirmed), confirm_timeout)

    async def _leave(self, name: bytes, inbox: Inbox) -> None:
        listeners = self._inboxes.get(name)
        if listeners is None:
            return
        listeners.discard(inbox)
        if listeners:
            return
        del self._inboxes[name]
        confirmed = self._confirmed.pop(name)
        if not confirmed.done():
            confirmed.cancel()
        await self._unsubscribe(name)

    async def _unsubscribe(self, name: bytes) -> None:
        if self._pubsub is None or self._closed:
            return
        # Not worth failing a listener's exit for: a subscription left behind (the connection
        # was down) is dropped when its next message or re-subscription arrives (_dispatch).
        async with self._commands:
            if name in self._inboxes:  # someone subscribed again meanwhile
                return
            # Anything at all: a lost connection, or redis-py tearing it down mid-write.
            with contextlib.suppress(Exception):
                if isinstance(self._pubsub, ClusterPubSub):
                    await self._pubsub.sunsubscribe(name)
                else:
                    await self._pubsub.unsubscribe(name)

    def _connection(self) -> PubSub | ClusterPubSub:
        if self._closed:
            raise RuntimeError("the channel hub is closed")
        if self._pubsub is None:
            self._pubsub = self._redis.pubsub()
        return self._pubsub

    def _start_readers(self) -> None:
        """One reader per connection: the single one, or one per Cluster node in use."""
        pubsub = self._pubsub
        if pubsub is None or self._closed:
            return
        names = list(pubsub.node_pubsub_mapping) if isinstance(pubsub, ClusterPubSub) else [""]
        for node_name in names:
            reader = self._readers.get(node_name)
            if reader is None or reader.done():
                self._readers[node_name] = asyncio.create_task(
                    self._read(node_name), name=f"channel-hub-reader{node_name and ':'}{node_name}"
                )

    async def _read(self, node_name: str) -> None:
        reconnected = False

        async def connection_lost(exc: Exception) -> None:
            nonlocal reconnected
            reconnected = True
            # A subscription sent on this connection may never be confirmed now: tell whoever
            # waits for one (they subscribe again), instead of letting them wait.
            self._fail_pending(exc, node_name)
            # A Cluster node gone for good: its slots' new masters come with a fresh map.
            await refresh_slot_map(self._redis)

        read = functools.partial(self._next_message, node_name)
        while not self._closed:
            try:
                message = await _READ_RETRY.call_with_retry(read, connection_lost)
            except _NodeGone:
                await self._hand_over(node_name)
                return
            if reconnected:
                reconnected = False
                self._notify_missed()
            if message is not None:
                self._dispatch(message)
            self._start_readers()  # a Cluster may have moved channels to another node

    async def _next_message(self, node_name: str) -> dict[str, Any] | None:
        pubsub = self._pubsub
        if isinstance(pubsub, ClusterPubSub):
            assert isinstance(self._redis, RedisCluster)
            node = self._redis.get_node(node_name=node_name)
            if node is None or node_name not in pubsub.node_pubsub_mapping:
                raise _NodeGone
            # Unbounded: redis-py holds a node's I/O lock for the whole of a bounded poll, and
            # SSUBSCRIBE / SUNSUBSCRIBE on that node wait for it, so a poll of a second made
            # every join and leave wait up to a second, one after another (40 followers took
            # 8 s to subscribe). An unbounded read takes no lock, as a plain PubSub's does not.
            # (redis-py types the timeout as a float; None is its documented unbounded read.)
            message: dict[str, Any] | None = await pubsub.get_sharded_message(
                target_node=node,
                timeout=None,  # type: ignore[arg-type]
            )
            node_pubsub = pubsub.node_pubsub_mapping.get(node_name)
            if message is None and (node_pubsub is None or node_pubsub.connection is None):
                # Torn down under the read (redis-py returns at once then): look at the
                # bookkeeping again after a pause, not in a spin.
                await asyncio.sleep(_TORN_DOWN_PAUSE)
            return message
        assert pubsub is not None
        message = await pubsub.get_message(timeout=_READ_WAIT)
        return message

    def _dispatch(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        channel = message.get("channel")
        if not isinstance(channel, bytes):
            return
        if kind in _MESSAGES | _SUBSCRIBED and channel not in self._inboxes:
            # Nobody listens: an unsubscribe that failed while the connection was down, and
            # redis-py subscribed it again on reconnect.
            task = asyncio.create_task(self._unsubscribe(channel))
            self._cleanups.add(task)
            task.add_done_callback(self._cleanups.discard)
        elif kind in _MESSAGES:
            for inbox in self._inboxes[channel]:
                inbox.put_nowait(message["data"])
        elif kind in _SUBSCRIBED:
            confirmed = self._confirmed.get(channel)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

    async def _hand_over(self, node_name: str) -> None:
        """A Cluster node's reader whose node holds none of our channels now: start readers
        for the nodes that do (waiting while redis-py moves them there), then tell every
        inbox that messages were missed meanwhile."""
        pubsub = self._pubsub
        assert isinstance(pubsub, ClusterPubSub)
        while not self._closed and self._inboxes:
            if node_name in pubsub.node_pubsub_mapping:
                # The node holds channels again (redis-py dropped its pub/sub while it held
                # none, and a listener joined since): a fresh reader takes it over.
                self._readers.pop(node_name, None)
                self._start_readers()
                return
            self._start_readers()
            if self._every_channel_read(node_name):
                self._notify_missed()
                return
            await asyncio.sleep(_HAND_OVER_PAUSE)

    def _every_channel_read(self, gone: str) -> bool:
        """Whether each channel listened to is subscribed on a node (not ``gone``) whose
        reader runs."""
        pubsub = self._pubsub
        assert isinstance(pubsub, ClusterPubSub)
        read: set[object] = set()
        for name, node_pubsub in list(pubsub.node_pubsub_mapping.items()):
            reader = self._readers.get(name)
            if name != gone and reader is not None and not reader.done():
                read.update(node_pubsub.shard_channels)
        return all(channel in read for channel in self._inboxes)

    def _fail_pending(self, exc: BaseException, node_name: str = "") -> None:
        """Fail the subscriptions waiting for a confirmation on the lost connection (on a
        Cluster: of the channels whose slot that node served)."""
        for channel, confirmed in self._confirmed.items():
            if not confirmed.done() and self._served_by(channel, node_name):
                confirmed.set_exception(exc)
                confirmed.exception()  # retrieved here: a listener may have left already

    def _served_by(self, channel: bytes, node_name: str) -> bool:
        if not node_name or not isinstance(self._redis, RedisCluster):
            return True
        try:
            node = self._redis.get_node_from_key(channel.decode())
        except RedisClusterException:  # a slot no node covers now
            return True
        return node is None or node.name == node_name

    def _notify_missed(self) -> None:
        for listeners in self._inboxes.values():
            for inbox in listeners:
                inbox.put_nowait(MISSED)


class _NodeGone(Exception):
    """The Cluster node's connection was dropped (its channels moved, or none are left)."""
