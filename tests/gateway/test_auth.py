"""API keys and their limits: keys made with the real CLI, checked by real gateway processes in
front of the module's worker, limits counted in the real Redis (and shared by gateways)."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import json
import signal
import stat
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_redis_protocol.sync_client import SyncClient
from mlx_redis_worker.local_redis import free_port
from tests.gateway.conftest import Fleet
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.processes import mlx_worker
from tests.support.sse import RawRequest
from tests.support.waiting import wait_until

MESSAGES: list[Any] = [{"role": "user", "content": "hi"}]
# A stream that runs far longer than any test holds it (the tiny model: ~100 tokens/s).
LONG = 2000


def add_key(path: Path, name: str, *flags: str) -> str:
    """``mlx-worker api-key add NAME --file PATH FLAGS``; the secret it printed."""
    result = mlx_worker("api-key", "add", name, "--file", str(path), *flags)
    assert result.returncode == 0, result.stderr
    secret = result.stdout.strip()
    assert secret.startswith("mlxw-") and "\n" not in secret, result.stdout
    return secret


def key_name(base: str) -> str:
    """A key name of this test's own: quotas are kept per name, under the module's prefix."""
    return f"{base}-{uuid.uuid4().hex[:8]}"


def client(gateway: GatewayProcess, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=secret, max_retries=0)


def ask(
    openai_client: openai.OpenAI, headers: Mapping[str, str | openai.Omit] | None = None
) -> ChatCompletion:
    """A one-token chat completion (what a limit counts, cheaply)."""
    return openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, temperature=0, extra_headers=headers
    )


def open_stream(
    openai_client: openai.OpenAI, streams: contextlib.ExitStack, max_tokens: int = LONG
) -> Iterator[ChatCompletionChunk]:
    """A streaming request, admitted (its first chunk read); closed (so aborted) at the end of
    ``streams``."""
    stream = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=max_tokens, temperature=0, stream=True
    )
    streams.callback(stream.close)
    first = next(stream)
    assert first.choices[0].delta.role == "assistant"
    return stream


def refused(
    call: Callable[[], object], error: type[openai.APIStatusError]
) -> openai.APIStatusError:
    with pytest.raises(error) as caught:
        call()
    return caught.value


def test_api_key_add_prints_the_secret_once_and_stores_only_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    secret = add_key(path, "team-a", "--requests-per-minute", "5", "--max-concurrent", "2")
    other = add_key(path, "team-b")
    text = path.read_text()
    assert secret != other
    for each in (secret, other):
        assert each not in text and each.removeprefix("mlxw-") not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = tomllib.loads(text)["key"]
    assert keys == [
        {
            "name": "team-a",
            "sha256": hashlib.sha256(secret.encode()).hexdigest(),
            "requests_per_minute": 5,
            "max_concurrent": 2,
        },
        {"name": "team-b", "sha256": hashlib.sha256(other.encode()).hexdigest()},
    ]
    again = mlx_worker("api-key", "add", "team-a", "--file", str(path))
    assert again.returncode == 2 and "exists already" in again.stderr
    assert again.stdout == "" and path.read_text() == text


def test_api_key_add_refuses_a_bad_limit_without_touching_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    add_key(path, "team-a")
    text = path.read_text()
    for flags in (
        ["--requests-per-minute", "0"],
        ["--max-concurrent", "-1"],
        ["--tokens-per-minute", "0"],
    ):
        bad = mlx_worker("api-key", "add", "team-b", "--file", str(path), *flags)
        assert bad.returncode == 2 and "must be at least 1" in bad.stderr, bad.stderr
        assert bad.stdout == "" and path.read_text() == text
    add_key(path, "team-b", "--max-concurrent", "1")  # the file is still usable


def test_only_a_valid_bearer_key_gets_past_the_gateway(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("reader"))
    gateway = gateways.start("--api-keys", str(keys))

    wrong = refused(lambda: ask(client(gateway, "mlxw-" + "x" * 43)), openai.AuthenticationError)
    assert wrong.status_code == 401
    assert wrong.code == "invalid_api_key" and wrong.type == "invalid_request_error"
    no_header: dict[str, str | openai.Omit] = {"Authorization": openai.Omit()}
    missing = refused(lambda: ask(client(gateway, secret), no_header), openai.AuthenticationError)
    assert missing.status_code == 401 and missing.type == "invalid_request_error"
    assert "Authorization: Bearer" in missing.message
    for header in (f"Basic {secret}", secret, "Bearer", f"Token {secret}", f"Bearer {secret}x"):
        malformed = refused(
            functools.partial(ask, client(gateway, secret), {"Authorization": header}),
            openai.AuthenticationError,
        )
        assert malformed.status_code == 401, header
        assert isinstance(malformed.body, dict), header
        assert set(malformed.body) == {"message", "type", "param", "code"}, header

    completion = ask(client(gateway, secret))
    assert completion.choices[0].finish_reason == "length"
    refused(lambda: client(gateway, "mlxw-wrong").models.list(), openai.AuthenticationError)
    assert [model.id for model in client(gateway, secret).models.list()] == ["tiny"]
    for path in (f"/v1/requests/{completion.id}", f"/v1/requests/{completion.id}/stream"):
        with RawRequest(gateway.url, "GET", path) as request:
            assert request.response().status == 401, path
    with RawRequest(gateway.url, "GET", "/health") as health:
        assert health.response().status == 200
        assert health.json()["models"] == ["tiny"]


def test_keys_added_or_removed_while_the_gateway_runs_count_within_two_seconds(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    first = add_key(keys, key_name("first"))
    gateway = gateways.start("--api-keys", str(keys))
    before = keys.read_text()
    refused(lambda: client(gateway, "mlxw-not-yet").models.list(), openai.AuthenticationError)

    added = add_key(keys, key_name("added"))
    newcomer = client(gateway, added)
    started = time.monotonic()
    wait_until(lambda: _authenticates(newcomer), 2.5, "the added key to be accepted")
    assert time.monotonic() - started < 2.5
    assert ask(newcomer).choices[0].finish_reason == "length"

    keys.write_text(before)  # the added key revoked by hand
    started = time.monotonic()
    wait_until(lambda: not _authenticates(newcomer), 2.5, "the removed key to be refused")
    assert time.monotonic() - started < 2.5
    refused(lambda: ask(newcomer), openai.AuthenticationError)
    assert ask(client(gateway, first)).choices[0].finish_reason == "length"


def _authenticates(openai_client: openai.OpenAI) -> bool:
    try:
        openai_client.models.list()
    except openai.AuthenticationError:
        return False
    return True


def test_a_key_over_its_requests_per_minute_gets_429_with_retry_after(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    limited = add_key(keys, key_name("limited"), "--requests-per-minute", "3")
    other = add_key(keys, key_name("other"), "--requests-per-minute", "3")
    gateway = gateways.start("--api-keys", str(keys))

    for _ in range(3):
        assert ask(client(gateway, limited)).choices[0].finish_reason == "length"
    error = refused(lambda: ask(client(gateway, limited)), openai.RateLimitError)
    assert error.status_code == 429 and error.code == "rate_limit_exceeded"
    # 3 a minute: the next token comes ~20 s after the burst.
    assert 1 <= int(error.response.headers["retry-after"]) <= 20
    stream = refused(
        lambda: client(gateway, limited).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=1, stream=True
        ),
        openai.RateLimitError,
    )
    assert stream.code == "rate_limit_exceeded"
    assert ask(client(gateway, other)).choices[0].finish_reason == "length"


def test_a_key_at_its_max_concurrent_gets_429_until_a_stream_finishes(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("capped"), "--max-concurrent", "2")
    gateway = gateways.start("--api-keys", str(keys))
    capped = client(gateway, secret)

    with contextlib.ExitStack() as streams:
        open_stream(capped, streams)
        short = open_stream(capped, streams, max_tokens=50)
        error = refused(lambda: ask(capped), openai.RateLimitError)
        assert error.status_code == 429 and error.code == "concurrency_limit_exceeded"
        assert "2 of at most 2" in error.message
        assert int(error.response.headers["retry-after"]) >= 1

        rest = list(short)
        assert rest[-1].choices[0].finish_reason == "length"
        # The lease goes back as the stream ends (just after its last chunk).
        admitted = wait_until(lambda: _admitted(capped), 2.0, "a request to be admitted")
        assert admitted.choices[0].finish_reason == "length"


def _admitted(openai_client: openai.OpenAI) -> ChatCompletion | None:
    try:
        return ask(openai_client)
    except openai.RateLimitError as error:
        assert error.code == "concurrency_limit_exceeded"
        return None


def test_two_gateways_count_one_keys_rate_and_streams_together(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    rated = add_key(keys, key_name("rated"), "--requests-per-minute", "3")
    capped = add_key(keys, key_name("capped"), "--max-concurrent", "2")
    first = gateways.start("--api-keys", str(keys))
    second = gateways.start("--api-keys", str(keys))

    ask(client(first, rated))
    ask(client(first, rated))
    ask(client(second, rated))
    for gateway in (first, second):
        error = refused(functools.partial(ask, client(gateway, rated)), openai.RateLimitError)
        assert error.code == "rate_limit_exceeded"

    with contextlib.ExitStack() as streams:
        open_stream(client(first, capped), streams)
        open_stream(client(first, capped), streams)
        error = refused(lambda: ask(client(second, capped)), openai.RateLimitError)
        assert error.code == "concurrency_limit_exceeded"


def test_a_quota_lease_under_a_second_is_refused_in_one_line(fleet: Fleet) -> None:
    connection = ["--redis-url", fleet.redis_url, "--prefix", fleet.prefix]
    address = f"127.0.0.1:{free_port()}"
    flags = ["--quota-lease-seconds", "0.5"]
    result = mlx_worker("gateway", "--listen", address, *connection, *flags, timeout=15)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "mlx-worker: --quota-lease-seconds must be at least 1, got 0.5\n"


def test_a_non_loopback_address_without_keys_is_refused_unless_no_auth(
    fleet: Fleet, tmp_path: Path
) -> None:
    port = free_port()
    connection = ["--redis-url", fleet.redis_url, "--prefix", fleet.prefix]
    for address in (f"0.0.0.0:{port}", f"[::]:{port}"):
        result = mlx_worker("gateway", "--listen", address, *connection, timeout=15)
        assert result.returncode == 2, result.stderr
        assert "without API keys" in result.stderr and "--no-auth" in result.stderr

    gateway = GatewayProcess(tmp_path, redis_url=fleet.redis_url, prefix=fleet.prefix)
    gateway.command += ["--listen", f"0.0.0.0:{gateway.port}", "--no-auth"]  # the last wins
    try:
        gateway.start()
        assert ask(client(gateway, "anything")).choices[0].finish_reason == "length"
    finally:
        # uvicorn re-raises the SIGTERM it shut down on; None: it had to be killed.
        assert gateway.stop() in (0, -signal.SIGTERM), gateway.log_tail()


def test_the_status_routes_need_an_operator_key_as_bearer_or_basic_password(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "keys.toml"
    tenant = add_key(path, key_name("tenant"))
    operator = add_key(path, key_name("ops"), "--operator")
    gateway = gateways.start("--api-keys", str(path))

    def get(route: str, authorization: str | None) -> tuple[int, Mapping[str, str], bytes]:
        headers = {"Authorization": authorization} if authorization else {}
        request = urllib.request.Request(gateway.url + route, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, answer.headers, answer.read()
        except urllib.error.HTTPError as refusal:
            return refusal.code, refusal.headers, refusal.read()

    def basic(password: str) -> str:
        return "Basic " + base64.b64encode(f"anyone:{password}".encode()).decode()

    for route in ("/", "/status/fragment", "/status.json"):
        status, headers, body = get(route, None)
        assert status == 401, route
        assert headers["WWW-Authenticate"].startswith("Basic "), route  # the browser asks
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        assert get(route, basic("mlxw-wrong"))[0] == 401
        status, _, body = get(route, f"Bearer {tenant}")
        assert status == 403 and json.loads(body)["error"]["code"] == "not_an_operator"
        assert get(route, basic(tenant))[0] == 403
        assert get(route, f"Bearer {operator}")[0] == 200, route
        assert get(route, basic(operator))[0] == 200, route
    status, _, body = get("/status.json", basic(operator))
    assert fleet.worker.worker_id in [w["worker_id"] for w in json.loads(body)["workers"]]


def test_a_slot_outlives_its_lease_while_held_and_frees_itself_when_its_gateway_dies(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("leased"), "--max-concurrent", "1")
    lease = ("--quota-lease-seconds", "2")
    holder, other = (gateways.start("--api-keys", str(keys), *lease) for _ in range(2))
    stream = client(holder, secret).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=600, temperature=0, stream=True
    )
    request_id = next(stream).id
    try:
        time.sleep(3)  # past the lease: the holding gateway keeps refreshing it
        error = refused(lambda: ask(client(other, secret)), openai.RateLimitError)
        assert error.code == "concurrency_limit_exceeded"
        assert holder.process is not None
        holder.process.kill()  # no release: only the lease's expiry frees the slot
        holder.process.wait(10)
        admitted = wait_until(lambda: _admitted(client(other, secret)), 5.0, "the slot back")
        assert admitted.choices[0].finish_reason == "length"
    finally:
        stream.close()
        with SyncClient(fleet.redis_url, prefix=fleet.prefix) as protocol_client:
            protocol_client.abort(request_id)  # its gateway died: nobody else stops it
