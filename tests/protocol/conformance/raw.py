"""Producer, subscriber and operator of protocol/README.md in raw redis-py + msgpack.

Nothing here imports ``mlx_redis_protocol``: every key name, message map and merge step is spelled
out the way the spec tells a producer in another language to do it, so the tests that use it check
the worker against the document, not against the Python client that shares its code.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import msgpack
import redis

from tests.support.processes import MODEL
from tests.support.waiting import wait_until

VERSION = 1
LOG_TTL = 600  # what a producer gives the queued marker's log (rule 1)
ABORT_TTL = 3600  # `SET <prefix>:abort:{id} 1 EX 3600` (rule 5)
TERMINAL_TYPES = ("done", "error")


def pack(value: Any) -> bytes:
    """msgpack bytes as any msgpack library writes them (str as str, bytes as bin)."""
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def unpack(data: bytes) -> Any:
    """A message the worker wrote: one msgpack value, str keys, no extension types."""

    def refuse(code: int, payload: bytes) -> Any:
        raise AssertionError(f"the worker wrote msgpack extension type {code}")

    return msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=refuse)


def new_id(what: str) -> str:
    """A request id or reply token of this test's own (the id alphabet: A-Z a-z 0-9 . _ : -)."""
    return f"{what}-{uuid.uuid4().hex[:10]}"


def entry_ms(entry_id: str | bytes) -> int:
    """The millisecond timestamp of a stream entry id (`<ms>-<n>`), on Redis' clock."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.split("-")[0])


@dataclasses.dataclass(frozen=True)
class Names:
    """Every key and channel of the spec's "Keys" table under one prefix; ``model``: the
    model the worker serves, whose stream its jobs run from (see "Models")."""

    prefix: str
    model: str = MODEL

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def group(self) -> str:
        return self.prefix

    @property
    def dead(self) -> str:
        return f"{self.prefix}:dead:{{{self.prefix}:jobs}}"

    @property
    def model_jobs(self) -> str:
        return f"{self.prefix}:jobs:{{{self.model}}}"

    @property
    def model_dead(self) -> str:
        return f"{self.prefix}:dead:{{{self.model}}}"

    def out(self, request_id: str) -> str:
        return f"{self.prefix}:out:{{{request_id}}}"

    def log(self, request_id: str) -> str:
        return f"{self.prefix}:log:{{{request_id}}}"

    def abort(self, request_id: str) -> str:
        return f"{self.prefix}:abort:{{{request_id}}}"

    def attempt(self, request_id: str) -> str:
        return f"{self.prefix}:attempt:{{{request_id}}}"

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    def control_for(self, worker_id: str) -> str:
        return f"{self.prefix}:control:{{{worker_id}}}"

    def reply(self, token: str) -> str:
        return f"{self.prefix}:reply:{{{token}}}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{{{worker_id}}}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers:{{{self.prefix}:jobs}}"


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One entry of a replay log: fields `seq`, `e` and, on the terminal event, `end`."""

    entry_id: str
    fields: dict[str, bytes]

    @property
    def raw(self) -> bytes:
        return self.fields["e"]

    @property
    def event(self) -> dict[str, Any]:
        event: dict[str, Any] = unpack(self.raw)
        return event

    @property
    def seq(self) -> int:
        return int(self.fields["seq"])

    @property
    def end(self) -> bool:
        return self.fields.get("end") == b"1"

    @property
    def ms(self) -> int:
        return entry_ms(self.entry_id)


@dataclasses.dataclass(frozen=True)
class Reply:
    """A control reply as it came out of the reply list, and decoded."""

    raw: bytes
    fields: dict[str, Any]


class Wire:
    """One connection to the Redis a worker serves, speaking the protocol by hand."""

    def __init__(self, redis_url: str, prefix: str) -> None:
        self.names = Names(prefix)
        # decode_responses stays off: events and replies are binary msgpack.
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=15, socket_connect_timeout=5)

    def close(self) -> None:
        self.redis.close()

    # -- producer ---------------------------------------------------------------------------

    def queued_marker(self, request_id: str) -> None:
        """Rule 1, exactly as the worked example: `XADD log * seq 0 e <bytes>`, `EXPIRE`."""
        marker = {"v": 1, "type": "queued", "request_id": request_id, "seq": 0, "attempt": 0}
        log = self.names.log(request_id)
        self.redis.xadd(log, {"seq": b"0", "e": pack(marker)})
        self.redis.expire(log, LOG_TTL)

    def add_job(self, job: bytes | dict[Any, Any]) -> str:
        """`XADD <prefix>:jobs * job <bytes>`; the entry id."""
        data = job if isinstance(job, bytes) else pack(job)
        entry_id: bytes = self.redis.xadd(self.names.jobs, {"job": data})
        return entry_id.decode()

    def submit(self, request_id: str, **fields: Any) -> str:
        """The queued marker, then the job `{v: 1, request_id, **fields}`; the entry id."""
        self.queued_marker(request_id)
        return self.add_job({"v": VERSION, "request_id": request_id, **fields})

    def set_abort_marker(self, request_id: str) -> None:
        self.redis.set(self.names.abort(request_id), b"1", ex=ABORT_TTL)

    # -- reading what the worker wrote -----------------------------------------------------

    def log(self, request_id: str, after: str | None = None) -> list[LogEntry]:
        start = "-" if after is None else f"({after}"
        rows = self.redis.xrange(self.names.log(request_id), start, "+")
        return [
            LogEntry(entry_id.decode(), {key.decode(): value for key, value in fields.items()})
            for entry_id, fields in rows
        ]

    def events(self, request_id: str) -> list[dict[str, Any]]:
        return [entry.event for entry in self.log(request_id)]

    def wait_for_end(self, request_id: str, timeout: float = 30.0) -> list[LogEntry]:
        """The log once it holds a terminal event (by its `end` field or its type)."""

        def ended() -> list[LogEntry] | None:
            entries = self.log(request_id)
            finished = any(
                e.end or (e.seq > 0 and e.event.get("type") in TERMINAL_TYPES) for e in entries
            )
            return entries if finished else None

        return wait_until(ended, timeout, f"the terminal event of {request_id}")

    def wait_for_deltas(self, request_id: str, count: int = 1, timeout: float = 30.0) -> None:
        wait_until(
            lambda: sum(e.event.get("type") == "delta" for e in self.log(request_id)) >= count,
            timeout,
            f"{count} delta(s) of {request_id}",
        )

    def dead_letters(self) -> list[tuple[str, dict[str, bytes]]]:
        """The model stream's dead letters: where a worker dead-letters the jobs it forwarded
        from the default stream, and those queued on the model's stream."""
        rows = self.redis.xrange(self.names.model_dead, "-", "+")
        return [
            (entry_id.decode(), {key.decode(): value for key, value in fields.items()})
            for entry_id, fields in rows
        ]

    def dead_letter_of(self, job_entry_id: str, timeout: float = 30.0) -> dict[str, bytes]:
        """The dead-letter entry recording job entry ``job_entry_id`` (waits for it): its
        ``entry_id``, or for a job forwarded from the default stream, its ``forwarded_from``."""

        def find() -> dict[str, bytes] | None:
            wanted = job_entry_id.encode()
            found = [
                f
                for _, f in self.dead_letters()
                if f.get("forwarded_from", f.get("entry_id")) == wanted
            ]
            assert len(found) <= 1, f"{job_entry_id} dead-lettered {len(found)} times"
            return found[0] if found else None

        return wait_until(find, timeout, f"the dead letter of job entry {job_entry_id}")

    def pending(self) -> dict[str, tuple[str, int]]:
        """The group's pending entries on both job streams (the default one and the model's):
        entry id -> (consumer, times delivered)."""
        rows = [
            row
            for stream in (self.names.jobs, self.names.model_jobs)
            for row in self.redis.xpending_range(stream, self.names.group, "-", "+", 1000)
        ]
        return {
            row["message_id"].decode(): (row["consumer"].decode(), int(row["times_delivered"]))
            for row in rows
        }

    def job_entry_gone(self, entry_id: str) -> bool:
        """Acknowledged (not pending) and deleted from its job stream; for an entry of the
        default stream, also the model-stream entry it was forwarded to. Read in the order a
        job moves (its stream, then the forwarded entry): a job forwarded between two reads
        read the other way round looked gone before its model-stream entry was read."""
        in_stream = any(
            self.redis.xrange(stream, entry_id, entry_id)
            for stream in (self.names.jobs, self.names.model_jobs)
        )
        if in_stream or entry_id in self.pending():
            return False
        return not any(
            fields.get(b"forwarded_from") == entry_id.encode()
            for _, fields in self.redis.xrange(self.names.model_jobs, "-", "+")
        )

    def keys(self, pattern: str) -> set[bytes]:
        return set(self.redis.scan_iter(match=f"{self.names.prefix}:{pattern}", count=1000))

    # -- operator ---------------------------------------------------------------------------

    def send_command(self, data: bytes, channel: str | None = None) -> int:
        """`PUBLISH <prefix>:control <bytes>`: how many subscribers heard it."""
        receivers: int = self.redis.publish(channel or self.names.control, data)
        return receivers

    def take_reply(self, reply_to: str, timeout: float = 2.0) -> Reply | None:
        """`BLPOP <reply_to> timeout`: one reply, kept as the bytes Redis holds, or None."""
        popped = self.redis.blpop([reply_to], timeout=timeout)
        if popped is None:
            return None
        _key, raw = popped
        assert isinstance(raw, bytes)
        return Reply(raw, unpack(raw))

    def command(
        self,
        kind: str,
        *,
        channel: str | None = None,
        timeout: float = 5.0,
        **fields: Any,
    ) -> Reply:
        """A valid command `{v, kind, id, reply_to, **fields}` and the one reply to it."""
        token = new_id("c")
        reply_to = self.names.reply(token)
        command = {"v": VERSION, "kind": kind, "id": token, "reply_to": reply_to, **fields}
        assert self.send_command(pack(command), channel) >= 1, "no worker listens"
        reply = self.take_reply(reply_to, timeout)
        assert reply is not None, f"no reply to {kind} within {timeout:g} s"
        assert reply.fields.get("id") == token, reply.fields
        self.redis.delete(reply_to)
        return reply


class RequestNotFound(Exception):
    """The request has no replay log (step 2 / step 5 of the spec's subscribing section)."""


class Subscriber:
    """The spec's "Subscribing without losing an event", steps 1-6, for one request.

    ``open`` subscribes, waits for the confirmation and reads the whole log; ``follow``
    releases events in seq order until the terminal one. Besides the released events it keeps
    what a conformance test wants to look at: the seqs heard live, the repeats dropped, and
    ``unlogged``: live events that were not (with identical bytes, and every seq before them)
    in the log at the moment they were heard, which rule 3 forbids.
    """

    def __init__(self, wire: Wire, request_id: str, poll_interval: float = 1.0) -> None:
        self.wire = wire
        self.request_id = request_id
        self.poll_interval = poll_interval
        self.released: list[dict[str, Any]] = []
        self.released_raw: dict[int, bytes] = {}
        self.heard_live: list[int] = []
        self.repeats: list[int] = []
        self.rewritten: list[int] = []
        self.unlogged: list[str] = []
        self.finished = False
        self._last = 0  # the queued marker's seq
        self._buffer: dict[int, bytes] = {}
        self._last_id: str | None = None
        self._pubsub: Any = None

    def open(self) -> Subscriber:
        pubsub = self.wire.redis.pubsub()
        pubsub.subscribe(self.wire.names.out(self.request_id))
        wait_until(
            lambda: (m := pubsub.get_message(timeout=0.2)) is not None and m["type"] == "subscribe",
            5,
            "the subscribe confirmation",
        )
        self._pubsub = pubsub
        entries = self.wire.log(self.request_id)
        if not entries:
            self.close()
            raise RequestNotFound(self.request_id)
        self._take_log(entries)
        return self

    def follow(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Every event, each once, in seq order, up to and including the terminal one."""
        assert self._pubsub is not None, "open() first"
        deadline = time.monotonic() + timeout
        quiet_since = time.monotonic()
        try:
            while not self.finished:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"{self.request_id}: no terminal event within {timeout:g} s; "
                        f"released seqs {[e['seq'] for e in self.released]}"
                    )
                message = self._pubsub.get_message(timeout=0.2)
                if message is not None and message["type"] == "message":
                    raw = message["data"]
                    self._check_logged(raw)
                    self._offer(raw, live=True)
                    if self._buffer:  # a gap: the log holds everything up to what we heard
                        self._take_log(self.wire.log(self.request_id, after=self._last_id))
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= self.poll_interval:
                    entries = self.wire.log(self.request_id, after=self._last_id)
                    if not entries and not self.wire.redis.exists(
                        self.wire.names.log(self.request_id)
                    ):
                        raise RequestNotFound(self.request_id)
                    self._take_log(entries)
                    quiet_since = time.monotonic()
        finally:
            self.close()
        return self.released

    def close(self) -> None:
        if self._pubsub is not None:
            self._pubsub.unsubscribe()
            self._pubsub.close()
            self._pubsub = None

    def _take_log(self, entries: list[LogEntry]) -> None:
        for entry in entries:
            self._offer(entry.raw, live=False)
            self._last_id = entry.entry_id

    def _offer(self, raw: bytes, live: bool) -> None:
        event = unpack(raw)
        seq = event["seq"]
        if live:
            self.heard_live.append(seq)
        if self.finished:
            self.repeats.append(seq)
        elif seq == 0 and not self.released:  # the marker, released only if nothing came before
            self._release(0, raw)
        elif seq <= self._last:
            self.repeats.append(seq)
            if seq in self.released_raw and self.released_raw[seq] != raw:
                self.rewritten.append(seq)
        else:
            self._buffer[seq] = raw
            while not self.finished and self._last + 1 in self._buffer:
                self._release(self._last + 1, self._buffer.pop(self._last + 1))

    def _release(self, seq: int, raw: bytes) -> None:
        event = unpack(raw)
        self.released.append(event)
        self.released_raw[seq] = raw
        self._last = seq
        if seq > 0 and event.get("type") in TERMINAL_TYPES:
            self.finished = True

    def _check_logged(self, raw: bytes) -> None:
        """Rule 3: an event heard live is already in the log, and so is every seq before it."""
        seq = unpack(raw)["seq"]
        logged = {entry.seq: entry.raw for entry in self.wire.log(self.request_id)}
        if logged.get(seq) != raw:
            self.unlogged.append(f"seq {seq} heard live before it was in the log")
        missing = [s for s in range(seq) if s not in logged]
        if missing:
            self.unlogged.append(f"seq {seq} heard live while seqs {missing} were not logged")
