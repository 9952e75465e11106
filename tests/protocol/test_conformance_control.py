"""Conformance: control commands, replies and the heartbeat, spoken raw.

Commands are msgpack PUBLISHed on `<prefix>:control` (or `<prefix>:control:{worker_id}`);
the reply is BLPOPped, as bytes, from the command's `reply_to` list. Commands that fail
validation are answered when their `reply_to` is usable, and never written anywhere else.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from tests.protocol.conformance.harness import (
    Served,
    is_int,
    is_number,
    module_worker,
)
from tests.protocol.conformance.raw import Reply, new_id, pack

pytestmark = pytest.mark.timeout(120)

MAX_STR = 256 * 1024


served = module_worker("conformance-control", lease_seconds=3.0)


def _check_reply(reply: Reply, served: Served, ok: bool) -> dict[str, Any]:
    """The reply table: v, id, ok, worker_id; result when ok, error {code, message} when not.
    Replies are binary msgpack maps, read as bytes."""
    assert isinstance(reply.raw, bytes)
    assert reply.raw[0] in range(0x80, 0x90) or reply.raw[0] in (0xDE, 0xDF), reply.raw[:4]
    fields = reply.fields
    assert fields["v"] == 1 and is_int(fields["v"])
    assert isinstance(fields["id"], str)
    assert fields["ok"] is ok, fields
    assert fields["worker_id"] == served.worker_id
    if ok:
        assert isinstance(fields["result"], dict), fields
        assert "error" not in fields, fields
        json.dumps(fields["result"], allow_nan=False)  # JSON-like
    else:
        assert "result" not in fields, fields
        error = fields["error"]
        assert set(error) == {"code", "message"}, error
        assert isinstance(error["code"], str) and isinstance(error["message"], str), error
    return fields


def _error_code(reply: Reply, served: Served) -> str:
    code: str = _check_reply(reply, served, ok=False)["error"]["code"]
    return code


# -- the commands ---------------------------------------------------------------------------


def test_ping(served: Served) -> None:
    before = time.time()
    fields = _check_reply(served.wire.command("ping"), served, ok=True)
    result = fields["result"]
    assert set(result) == {"pong", "time"}, result
    assert result["pong"] is True
    assert is_number(result["time"]) and before - 5 < result["time"] < time.time() + 5


def test_ping_on_the_workers_own_channel(served: Served) -> None:
    wire = served.wire
    reply = wire.command("ping", channel=wire.names.control_for(served.worker_id))
    assert _check_reply(reply, served, ok=True)["result"]["pong"] is True


def test_stats_is_a_json_like_map(served: Served) -> None:
    result = _check_reply(served.wire.command("stats"), served, ok=True)["result"]
    documented = {"engine", "prefix_cache", "jobs", "publisher", "group", "memory"}
    assert documented | {"uptime_seconds", "worker_id"} <= set(result), sorted(result)
    assert result["worker_id"] == served.worker_id
    assert {"in_flight", "outcomes"} <= set(result["jobs"]), result["jobs"]


def test_unknown_kind_is_unknown_command(served: Served) -> None:
    reply = served.wire.command("reticulate_splines")
    assert _error_code(reply, served) == "unknown_command"


def test_cache_save_load_and_clear(served: Served) -> None:
    wire = served.wire
    rid = served.rid("warm")
    wire.submit(rid, prompt="a prompt worth caching", max_tokens=2, temperature=0)
    wire.wait_for_end(rid)
    name = new_id("cache").replace(":", "_")
    saved = _check_reply(wire.command("cache_save", name=name), served, ok=True)["result"]
    assert saved["saved"] is True and saved["name"] == name, saved
    assert saved["model"] == wire.names.model, saved
    assert is_int(saved["entries"]) and saved["entries"] >= 1, saved
    cleared = _check_reply(wire.command("cache_clear"), served, ok=True)["result"]
    assert set(cleared) == {"cleared"} and isinstance(cleared["cleared"], dict), cleared
    loaded = _check_reply(wire.command("cache_load", name=name), served, ok=True)["result"]
    assert loaded == {"loaded": saved["entries"], "name": name, "model": wire.names.model}


def test_cache_load_of_an_unknown_name_is_not_found(served: Served) -> None:
    reply = served.wire.command("cache_load", name="no-such-cache")
    assert _error_code(reply, served) == "not_found"


def test_internal_near_miss_cache_names_outside_the_directory(served: Served) -> None:
    """`internal` is what a worker answers when a command fails unexpectedly; no wire input
    was found that makes it fail so. The nearest, a cache name that would leave the cache
    directory, is refused as `invalid_field` before anything is touched."""
    wire = served.wire
    for name in ("../escape", "a..b", ".hidden", "x/y"):
        reply = wire.command("cache_save", name=name)
        assert _error_code(reply, served) == "invalid_field", (name, reply.fields)


# -- commands that cannot be run ------------------------------------------------------------


def _command(reply_to: str, token: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": "ping", "id": token, "reply_to": reply_to, **fields}


def _no_id(reply_to: str, token: str) -> bytes:
    return pack({"v": 1, "kind": "ping", "reply_to": reply_to})


# name -> (command bytes for (reply_to, id), the decoder's code, whether the reply echoes the id)
BAD: dict[str, tuple[Callable[[str, str], bytes], str, bool]] = {
    "v nil": (lambda to, i: pack(_command(to, i, v=None)), "missing_field", True),
    "v 2": (lambda to, i: pack(_command(to, i, v=2)), "unsupported_version", True),
    'v "1"': (lambda to, i: pack(_command(to, i, v="1")), "unsupported_version", True),
    "no v": (
        lambda to, i: pack({k: v for k, v in _command(to, i).items() if k != "v"}),
        "missing_field",
        True,
    ),
    "no id": (_no_id, "missing_field", False),
    "invalid id": (lambda to, i: pack(_command(to, f"{i} !")), "invalid_field", False),
    "no kind": (
        lambda to, i: pack({k: v for k, v in _command(to, i).items() if k != "kind"}),
        "missing_field",
        True,
    ),
    "abort without request_id": (
        lambda to, i: pack(_command(to, i, kind="abort")),
        "missing_field",
        True,
    ),
    "cache_load without name": (
        lambda to, i: pack(_command(to, i, kind="cache_load")),
        "missing_field",
        True,
    ),
    "extension type": (
        lambda to, i: pack(_command(to, i, x=msgpack.ExtType(3, b"z"))),
        "malformed",
        True,
    ),
    "trailing bytes": (lambda to, i: pack(_command(to, i)) + b"\x00", "malformed", True),
    "over 1 MiB": (
        lambda to, i: pack(_command(to, i, padding=["x" * (MAX_STR - 64)] * 5)),
        "too_large",
        True,
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_command_with_a_usable_reply_to_is_answered_not_ok(served: Served, case: str) -> None:
    build, code, echoes_id = BAD[case]
    wire = served.wire
    token = new_id("bad")
    reply_to = wire.names.reply(token)
    assert wire.send_command(build(reply_to, token)) == 1
    reply = wire.take_reply(reply_to, timeout=3)
    assert reply is not None, f"no reply to a command that is {case}"
    assert _error_code(reply, served) == code, reply.fields
    assert reply.fields["id"] == (token if echoes_id else "")


def test_commands_with_an_unusable_reply_to_get_no_reply_and_the_worker_serves_on(
    served: Served,
) -> None:
    """reply_to outside the prefix's reply lists (another prefix, a key that is no reply
    list, a token that is no id), for a valid and an invalid command: nothing is written."""
    wire = served.wire
    prefix = wire.names.prefix
    token = new_id("t")
    targets = [
        f"elsewhere:reply:{{{token}}}",
        f"{prefix}:notreply:{{{token}}}",
        f"{prefix}:reply:{token}",
        f"{prefix}:reply:{{{token} x}}",
        f"{prefix}:reply:{{{token}}}:more",
        wire.names.jobs,
    ]
    jobs_before = wire.redis.xlen(wire.names.jobs)
    for target in targets:
        wire.send_command(pack(_command(target, new_id("c"))))
        wire.send_command(pack(_command(target, new_id("c"), v=2)))
    assert wire.command("ping").fields["ok"] is True  # still serving, answered after those
    time.sleep(0.3)
    for target in targets[:-1]:
        assert not wire.redis.exists(target), target
    assert wire.redis.type(wire.names.jobs) == b"stream"
    assert wire.redis.xlen(wire.names.jobs) == jobs_before


def test_an_unreadable_command_gets_no_reply(served: Served) -> None:
    wire = served.wire
    token = new_id("garbage")
    reply_to = wire.names.reply(token)
    assert wire.send_command(b"\xc1" + reply_to.encode()) == 1
    assert wire.send_command(pack(["reply_to", reply_to])) == 1
    assert wire.take_reply(reply_to, timeout=1.0) is None
    assert wire.command("ping").fields["ok"] is True


# -- heartbeat ------------------------------------------------------------------------------


def test_heartbeat_key_holds_the_documented_json(served: Served) -> None:
    wire = served.wire
    key = wire.names.worker(served.worker_id)
    assert {key.encode()} == wire.keys("worker:*")
    beat = json.loads(wire.redis.get(key))
    assert set(beat) >= {"worker_id", "pid", "started_at", "in_flight", "model"}, beat
    assert beat["worker_id"] == served.worker_id
    assert beat["pid"] == served.worker.pid
    assert beat["model"] == "tiny"
    assert is_int(beat["in_flight"]) and beat["in_flight"] >= 0
    assert is_number(beat["started_at"]) and beat["started_at"] <= time.time()
    ttl_ms = wire.redis.pttl(key)
    assert 0 < ttl_ms <= 2000, ttl_ms  # FAST_ENV's MLXW_HEARTBEAT_TTL
    # The registry lists the worker, scored by its heartbeat's expiry on Redis' clock.
    expiry = wire.redis.zscore(wire.names.workers, served.worker_id)
    seconds, micros = wire.redis.time()
    now_ms = seconds * 1000 + micros // 1000
    assert expiry is not None and now_ms - 1000 < expiry <= now_ms + 2000, (expiry, now_ms)


# -- incompatible_cache (last: it starts a second worker on the module's prefix) -----------


def test_a_cache_saved_by_another_model_is_incompatible(served: Served) -> None:
    """Saved by the tiny llama, loaded by tiny-micro sharing the cache directory:
    `incompatible_cache`, its message naming both model fingerprints."""
    wire = served.wire
    rid = served.rid("warm")
    wire.submit(rid, prompt="something to cache", max_tokens=2, temperature=0)
    wire.wait_for_end(rid)
    name = new_id("other-model").replace(":", "_")
    saved = wire.command("cache_save", name=name)
    assert saved.fields["ok"] is True, saved.fields
    # Sharing the module worker's cache directory; the worker's own lease.
    micro = served.factory.start(
        "conformance-micro", model="tiny-micro", max_concurrency=1, lease_seconds=None
    )
    try:
        reply = wire.command(
            "cache_load", channel=wire.names.control_for(micro.worker_id), name=name
        )
        assert reply.fields["worker_id"] == micro.worker_id
        assert reply.fields["ok"] is False, reply.fields
        assert reply.fields["error"]["code"] == "incompatible_cache", reply.fields
        fingerprints = set(re.findall(r"\b[0-9a-f]{16}\b", reply.fields["error"]["message"]))
        assert len(fingerprints) >= 2, reply.fields["error"]["message"]
    finally:
        micro.kill()
