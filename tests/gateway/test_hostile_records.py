"""Anything a producer can write is read defensively: heartbeats, activity records, dead
letters and keys of the wrong type under the fleet's names, of any content (NaN, huge
numbers, lone surrogates, bytes that are not UTF-8, a worker id that is no id, wrong types),
never make the status page, ``/status.json``, ``/health``, ``/v1/models`` or a completion
fail. Hypothesis writes them into the real Redis beside the module's real worker; the
gateway's app is driven in this process (ASGI), so each example sees its own records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, given, settings

import mlx_redis_gateway.routes.status as status_routes
from mlx_redis_gateway.app import Gateway, GatewaySettings, build_app
from mlx_redis_protocol.keys import Keys
from tests.gateway.conftest import Fleet
from tests.support.fleet import write_heartbeat_sync

FUZZ_WORKER = "fz-1"

texts = st.text(
    st.one_of(st.characters(), st.characters(categories=["Cs"])),  # Cs: lone surrogates
    max_size=8,
)
numbers = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**53 + 1, 1e308, -1e308]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
worker_ids = st.one_of(st.just(FUZZ_WORKER), texts, values)
heartbeats = st.fixed_dictionaries(
    {"worker_id": worker_ids},
    optional={
        "pid": values,
        "started_at": values,
        "in_flight": values,
        "default_model": values,
        "version": values,
        "models": st.one_of(
            values,
            st.dictionaries(
                st.one_of(texts, st.just("tiny")),
                st.fixed_dictionaries(
                    {},
                    optional={"max_concurrency": values, "free_slots": values, "in_flight": values},
                ),
                max_size=3,
            ),
        ),
    },
)
activities = st.fixed_dictionaries(
    {"worker_id": st.just(FUZZ_WORKER)},
    optional={
        "bucket_seconds": st.one_of(st.integers(1, 10), values),
        "at": values,
        "buckets": st.lists(st.lists(numbers, min_size=2, max_size=2), max_size=3),
        "requests": st.lists(
            st.fixed_dictionaries(
                {"request_id": st.one_of(st.just("chatcmpl-" + "a" * 32), texts)},
                optional={
                    "model": values,
                    "attempt": values,
                    "tokens": values,
                    "started_at": values,
                },
            ),
            max_size=3,
        ),
    },
)


def document(value: Any) -> st.SearchStrategy[bytes]:
    """``value`` as JSON (NaN and surrogates as Python writes them), or raw bytes."""
    return st.one_of(st.just(json.dumps(value).encode()), st.binary(max_size=16))


dead_fields = st.dictionaries(
    st.one_of(st.sampled_from([b"code", b"message", b"deliveries", b"request_id"]), st.binary()),
    st.one_of(st.binary(max_size=12), st.sampled_from([b"\xff\xfe", "²".encode(), b"12"])),
    min_size=1,
    max_size=4,
)


@st.composite
def records(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "heartbeat": draw(heartbeats.flatmap(document)),
        "activity": draw(activities.flatmap(document)),
        "dead": draw(st.lists(dead_fields, max_size=3)),
        "dead_id": draw(st.sampled_from(["*", "18446744073709551614-1", "1-1"])),
        "stray_heartbeat_stream": draw(st.booleans()),
        "stray_activity_stream": draw(st.booleans()),
        "dead_key_a_string": draw(st.booleans()),
    }


class Driver:
    """The gateway's ASGI app, started once, called in this process."""

    def __init__(self, fleet: Fleet) -> None:
        self.loop = asyncio.new_event_loop()
        self.app = build_app(GatewaySettings(redis_url=fleet.redis_url, prefix=fleet.prefix))
        gateway: Gateway = self.app.state.gateway
        self._lifespan = gateway.lifespan(self.app)
        self.loop.run_until_complete(self._lifespan.__aenter__())

    def close(self) -> None:
        self.loop.run_until_complete(self._lifespan.__aexit__(None, None, None))
        self.loop.close()

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        return self.loop.run_until_complete(asyncio.wait_for(self._call(method, path, body), 60))

    async def _call(self, method: str, path: str, body: Any) -> tuple[int, bytes]:
        raw = json.dumps(body).encode() if body is not None else b""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"host", b"127.0.0.1"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(raw)).encode()),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await self.app(scope, receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return status, body


@pytest.fixture(scope="module")
def driver(fleet: Fleet) -> Iterator[Driver]:
    patch = pytest.MonkeyPatch()
    patch.setattr(status_routes, "STATUS_CACHE_SECONDS", 0.0)  # each example read afresh
    driver = Driver(fleet)
    try:
        yield driver
    finally:
        driver.close()
        patch.undo()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(planted=records())
def test_no_record_a_producer_writes_makes_a_route_fail(
    planted: dict[str, Any], fleet: Fleet, admin: redis.Redis, driver: Driver
) -> None:
    keys = Keys(fleet.prefix)
    dead_streams = [keys.default_stream.dead, keys.model_stream("tiny").dead]
    written = [
        keys.worker(FUZZ_WORKER),
        keys.activity(FUZZ_WORKER),
        f"{fleet.prefix}:worker:stray",
        *dead_streams,
    ]
    try:
        write_heartbeat_sync(admin, keys, FUZZ_WORKER, planted["heartbeat"])
        admin.set(keys.activity(FUZZ_WORKER), planted["activity"], ex=60)
        if planted["stray_heartbeat_stream"]:
            admin.xadd(f"{fleet.prefix}:worker:stray", {"x": "1"})
        if planted["stray_activity_stream"]:
            admin.delete(keys.activity(FUZZ_WORKER))
            admin.xadd(keys.activity(FUZZ_WORKER), {"x": "1"})
        for fields in planted["dead"]:
            for stream in dead_streams:
                entry_id = "*" if admin.exists(stream) else planted["dead_id"]
                admin.xadd(stream, fields, id=entry_id)
        if planted["dead_key_a_string"]:
            admin.delete(dead_streams[0])
            admin.set(dead_streams[0], b"\xff")

        for path in ("/", "/status/fragment", "/health", "/v1/models"):
            status, body = driver.call("GET", path)
            assert status == 200, (path, body[:500])
        status, body = driver.call("GET", "/status.json")
        assert status == 200, body[:500]
        assert json.loads(body)["workers"]  # the real worker is shown, whatever else is
        status, body = driver.call(
            "POST",
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        )
        assert status == 200, body[:500]
    finally:
        admin.delete(*written)
        admin.zrem(keys.workers, FUZZ_WORKER)
