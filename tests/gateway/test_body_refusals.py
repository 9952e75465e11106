"""A body larger than any job could be is refused from its ``content-length`` before a byte of
it is read (the default limit follows the job's: twice its 1 MiB, for JSON's escapes, and
64 KiB of framing), and a refusal of a keyed request counts as one of the key's requests and
toward its address's cool-down, so a key cannot send oversized bodies faster than it may send
requests. A real gateway with keys; a hand-written heartbeat stands in for a worker."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from mlx_redis_gateway.http_limits import DEFAULT_HTTP_LIMITS
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from tests.gateway.test_address_cooldown import OFFENDER, connect_from
from tests.gateway.test_auth import add_key, key_name
from tests.gateway.test_http_limits import read_answer
from tests.protocol.test_client_models import heartbeat
from tests.support.fleet import write_heartbeat_sync
from tests.support.gateway import GatewayFactory, GatewayProcess

BODY_LIMIT = 2 * DEFAULT_LIMITS.max_message_bytes + 64 * 1024


def send_head(
    gateway: GatewayProcess, length: int, secret: str, body: bytes = b""
) -> tuple[int, dict[str, str], dict[str, object]]:
    """A chat request's head declaring ``length`` bytes, with ``body`` (none: nothing of the
    body is sent, so only a refusal from the head can answer it)."""
    with connect_from(gateway, OFFENDER) as sock:
        sock.sendall(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {secret}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n".encode()
            + body
        )
        status, headers, answer = read_answer(sock)
        return status, headers, json.loads(answer)


def keyed_gateway(
    lone_gateways: GatewayFactory, tmp_path: Path, name: str
) -> tuple[GatewayProcess, str]:
    """A gateway with one key of 2 requests a minute, and a stand-in worker of ``tiny`` (a
    heartbeat: nothing runs the jobs); the gateway and the key's secret."""
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name(name), "--requests-per-minute", "2")
    gateway = lone_gateways.start("--api-keys", str(keys), "--event-timeout", "5")
    with redis.Redis.from_url(lone_gateways.redis_url) as plain:
        write_heartbeat_sync(
            plain, Keys(lone_gateways.prefix), "stand-in", heartbeat("stand-in", "tiny").encode()
        )
    return gateway, secret


def test_the_default_body_limit_follows_the_job_limit() -> None:
    assert DEFAULT_HTTP_LIMITS.max_body_bytes == BODY_LIMIT


def test_oversized_bodies_of_a_key_are_refused_unread_and_count_as_its_requests(
    lone_gateways: GatewayFactory, tmp_path: Path
) -> None:
    gateway, secret = keyed_gateway(lone_gateways, tmp_path, "uploader")
    # 3 MiB: under the old fixed 4 MiB limit, over what a job can hold. Nothing of it is
    # sent: the answer comes from the head alone.
    refusals = [send_head(gateway, 3 * 1024 * 1024, secret) for _ in range(2)]
    for status, headers, answer in refusals:
        assert status == 413 and headers["connection"] == "close"
        error = answer["error"]
        assert isinstance(error, dict) and error["code"] == "body_too_large"
        assert str(BODY_LIMIT) in error["message"]
    # The two refusals took the key's two requests of this minute.
    chat = json.dumps(
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    status, headers, answer = send_head(gateway, len(chat), secret, chat)
    assert status == 429, answer
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == "rate_limit_exceeded"
    # A key out of requests is still told the size is the reason; the third size refusal
    # within the cool-down's window cools the address down.
    assert send_head(gateway, 3 * 1024 * 1024, secret)[0] == 413
    with connect_from(gateway, OFFENDER) as sock:
        status, _, body = read_answer(sock)
        assert status == 429 and json.loads(body)["error"]["code"] == "address_cooling_down"


def test_an_oversized_body_with_no_key_or_a_wrong_one_is_refused_from_its_head(
    lone_gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    add_key(keys, key_name("bystander"))
    gateway = lone_gateways.start("--api-keys", str(keys), "--cooldown-after-refusals", "0")
    for wrong in ("", "mlxw-not-a-key"):
        status, _, answer = send_head(gateway, 3 * 1024 * 1024, wrong)
        assert status == 413, answer


def test_invalid_requests_of_a_key_count_as_its_requests_and_a_refused_key_goes_unread(
    lone_gateways: GatewayFactory, tmp_path: Path
) -> None:
    """A request refused as invalid (400: here a picture for a model that takes none, the
    image flood's request) or for a model no worker serves (404) takes one of its key's
    requests, like an oversized body; and a key this gateway knows is out of requests gets its
    429 from the head, its body unread (before: each such body was read and parsed, 1 MB of
    JSON at a time, as fast as the key could send them)."""
    gateway, secret = keyed_gateway(lone_gateways, tmp_path, "pictures")

    def chat(model: str, content: object) -> bytes:
        message = {"role": "user", "content": content}
        return json.dumps({"model": model, "max_tokens": 1, "messages": [message]}).encode()

    picture = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    for body, status_wanted, code in (
        (chat("tiny", picture), 400, "invalid_job"),
        (chat("nobody-serves-this", "hi"), 404, "model_not_found"),
    ):
        status, _, answer = send_head(gateway, len(body), secret, body)
        assert status == status_wanted, answer
        error = answer["error"]
        assert isinstance(error, dict) and error["code"] == code
    # The two refusals took the key's two requests of this minute: a valid request is a 429.
    valid = chat("tiny", "hi")
    status, _, answer = send_head(gateway, len(valid), secret, valid)
    assert status == 429, answer
    # Now the gateway knows: the head alone is answered (nothing of the body is sent).
    status, headers, answer = send_head(gateway, len(valid), secret)
    assert status == 429, answer
    error = answer["error"]
    assert isinstance(error, dict) and error["code"] == "rate_limit_exceeded"
    assert "prompt counts" not in str(error["message"])
    assert float(headers["retry-after"]) > 0
