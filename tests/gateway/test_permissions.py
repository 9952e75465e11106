"""The gateway under the minimum ACL of docs/redis.md: it does all its work and Redis denies it
nothing; a grant it lacks stops it at start, with one line naming it."""

from __future__ import annotations

import contextlib
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from mlx_redis_protocol.keys import Keys
from mlx_redis_worker.local_redis import free_port
from tests.gateway.conftest import Fleet
from tests.gateway.test_auth import add_key, key_name
from tests.support.acl import (
    PASSWORD,
    MakeUser,
    denials,
    documented_minimum_acl,
    refusal_line,
)
from tests.support.gateway import GatewayProcess
from tests.support.processes import mlx_worker
from tests.support.waiting import wait_until


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[GatewayProcess]]:
    gateways: list[GatewayProcess] = []
    try:
        yield gateways
    finally:
        for gateway in gateways:
            with contextlib.suppress(Exception):
                gateway.stop()
            print(f"----- gateway {gateway.url} -----\n{gateway.log_tail(60)}")


def test_the_documented_acl_serves_everything_the_gateway_does(
    fleet: Fleet,
    acl_user: MakeUser,
    admin: redis.Redis,
    tmp_path: Path,
    started: list[GatewayProcess],
) -> None:
    """Models, streamed and whole completions, a disconnect's abort, resumption, the limits
    of a key and the status page, as a user with exactly the README's lines: ACL LOG stays
    empty."""
    user, url = acl_user(documented_minimum_acl(fleet.prefix, gateway=True))
    keys = tmp_path / "keys.toml"
    name = key_name("acl")
    secret = add_key(keys, name, "--requests-per-minute", "100", "--max-concurrent", "4")
    operator = add_key(keys, key_name("acl-operator"), "--operator")
    gateway = GatewayProcess(
        tmp_path, redis_url=url, prefix=fleet.prefix, flags=("--api-keys", str(keys))
    )
    started.append(gateway)
    gateway.start()
    # Its probes at start left nothing behind.
    assert not list(admin.scan_iter(f"{fleet.prefix}:*permission-probe*"))
    api = openai.OpenAI(base_url=gateway.base_url, api_key=secret, max_retries=0)

    assert [model.id for model in api.models.list()] == ["tiny"]
    chunks = list(
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    request_id = chunks[0].id
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = api.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    assert whole.choices[0].text
    with api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a long one"}],
        max_tokens=2000,
        stream=True,
    ) as dropped:
        next(iter(dropped))  # admitted and running; closing it aborts the job

    def get(path: str, key: str) -> bytes:
        request = urllib.request.Request(
            gateway.url + path, headers={"Authorization": f"Bearer {key}"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            body: bytes = answer.read()
            return body

    answer = json.loads(get(f"/v1/requests/{request_id}", secret))
    assert answer["choices"][0]["message"]["content"] == streamed
    assert b"data: [DONE]" in get(f"/v1/requests/{request_id}/stream", secret)
    status = json.loads(get("/status.json", operator))
    assert [w["worker_id"] for w in status["workers"]] == [fleet.worker.worker_id]
    assert b"<html" in get("/", operator)
    stored_responses_round_trip(api)
    # The aborted job's quota lease is given back: every slot is free again.
    wait_until(lambda: _in_flight(admin, fleet.prefix, name) == 0, 10, "the lease to be freed")
    assert denials(admin, user) == []

    # A grant taken away under the running gateway: a typed 503, its slot given back, and
    # served again once the grant is back.
    admin.execute_command("ACL", "SETUSER", user, "-xadd")
    with pytest.raises(openai.InternalServerError) as caught:
        api.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert caught.value.status_code == 503 and caught.value.code == "redis_refused"
    assert _in_flight(admin, fleet.prefix, name) == 0
    admin.execute_command("ACL", "SETUSER", user, "+xadd")
    assert api.completions.create(model="tiny", prompt="hello", max_tokens=4).choices[0].text


def _in_flight(admin: redis.Redis, prefix: str, name: str) -> int:
    return int(admin.zcard(Keys(prefix).quota_in_flight(name)))


def gateway_refused(url: str, prefix: str, *flags: str) -> str:
    """The one line ``mlx-worker gateway`` printed when it refused to start."""
    completed = mlx_worker(
        "gateway",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--redis-url",
        url,
        "--prefix",
        prefix,
        *flags,
        timeout=60,
    )
    return refusal_line(completed)


@pytest.mark.parametrize(
    ("rule", "command", "needed_to"),
    [
        ("-zrange", "ZRANGE", "find the models live workers serve"),
        ("-xadd", "XADD", "queue jobs"),
        ("-subscribe", "SUBSCRIBE", "follow a request's events"),
        ("-blpop", "BLPOP", "hear the workers' answers to an abort"),
        ("-xinfo|groups", "XINFO GROUPS", "show the fleet's status"),
        # Called only inside the quota scripts.
        ("-zadd", "ZADD", "enforce the API keys' limits"),
        ("-hset", "HSET", "enforce the API keys' limits"),
        ("-evalsha", "EVALSHA", "run the gateway's Lua scripts"),
        ("-expire", "EXPIRE", "give replay logs their TTL"),
    ],
)
def test_a_missing_command_stops_the_gateway_at_start_naming_it(
    fleet: Fleet,
    acl_user: MakeUser,
    admin: redis.Redis,
    tmp_path: Path,
    rule: str,
    command: str,
    needed_to: str,
) -> None:
    user, url = acl_user([*documented_minimum_acl(fleet.prefix, gateway=True), rule])
    keys = tmp_path / "keys.toml"
    add_key(keys, key_name("refused"))
    line = gateway_refused(url, fleet.prefix, "--api-keys", str(keys))
    assert line == (
        f"mlx-worker: Redis user {user!r} may not run {command} (needed to {needed_to}); "
        "grant it (see docs/redis.md: minimum ACL)"
    )
    assert len(denials(admin, user)) == 1


def test_a_gateway_without_keys_or_status_page_needs_no_more_than_it_uses(
    fleet: Fleet,
    acl_user: MakeUser,
    admin: redis.Redis,
    tmp_path: Path,
    started: list[GatewayProcess],
) -> None:
    """Without API keys it sends no quota command, without the status page no XINFO: a user
    with the worker's minimum line alone, less XINFO GROUPS, runs it."""
    user, url = acl_user([*documented_minimum_acl(fleet.prefix), "-xinfo|groups"])
    gateway = GatewayProcess(
        tmp_path, redis_url=url, prefix=fleet.prefix, flags=("--no-status-page",)
    )
    started.append(gateway)
    gateway.start()
    api = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
    answer = api.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    stored_responses_round_trip(api)
    assert denials(admin, user) == []


def stored_responses_round_trip(api: openai.OpenAI) -> None:
    """Store a response, continue from it, read, list and delete it (the store's scripts
    and reads: within the worker's own commands)."""
    fields: Any = {"model": "tiny", "max_output_tokens": 4, "temperature": 0}
    first = api.responses.create(input="hello", **fields)
    api.responses.create(previous_response_id=first.id, input="again", **fields)
    assert api.responses.retrieve(first.id).id == first.id
    assert len(api.responses.input_items.list(first.id).data) == 1
    api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(first.id)


def test_keys_outside_the_grant_and_a_wrong_password_are_one_line_each(
    fleet: Fleet, acl_user: MakeUser
) -> None:
    user, url = acl_user(["on", f">{PASSWORD}", "~elsewhere:*", f"&{fleet.prefix}:*", "+@all"])
    line = gateway_refused(url, fleet.prefix)
    assert line.startswith(f"mlx-worker: Redis user {user!r} has no permission for the key "), line
    assert line.endswith(f"grant ~{fleet.prefix}:* (see docs/redis.md: minimum ACL)"), line
    wrong = url.replace(PASSWORD, "wrong-password")
    line = gateway_refused(wrong, fleet.prefix)
    assert line.startswith(f"mlx-worker: Redis refused us at redis://{user}:***@"), line
    assert line.endswith("invalid username-password pair or user is disabled."), line
