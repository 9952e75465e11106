"""HTTP limits before anything is parsed: oversized or too many headers (431), oversized bodies
(413, never read whole), deep JSON (400), connections that send nothing (408, closed), bodies
that do not arrive whole in time (408, closed), a cap on open connections (503) and on
requests per keep-alive connection; each refusal in OpenAI's error shape, and the gateway
answering ``/health`` throughout. No worker is needed: every refusal happens before a job
exists (a hand-written heartbeat stands in where a model must look served)."""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any

import pytest
import redis

from mlx_redis_protocol.keys import Keys
from tests.protocol.test_client_models import heartbeat
from tests.support.fleet import write_heartbeat_sync
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.waiting import wait_until

MAX_BODY = 256 * 1024
MAX_HEAD = 8 * 1024
MAX_HEADERS = 40
BODY_TIMEOUT = 2.0
CHAT_HEAD = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.fixture
def gateway(lone_gateways: GatewayFactory) -> GatewayProcess:
    return lone_gateways.start(
        "--max-body-bytes",
        str(MAX_BODY),
        "--max-header-bytes",
        str(MAX_HEAD),
        "--max-headers",
        str(MAX_HEADERS),
        "--header-timeout",
        "1",
        "--body-timeout",
        str(BODY_TIMEOUT),
        "--max-requests-per-connection",
        "3",
    )


def connect(gateway: GatewayProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.port), timeout=60)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP answer with a content-length: status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed inside the body"
        body += chunk
    return status, headers, body[:length]


def closed(sock: socket.socket) -> bool:
    """Whether the peer closed (reads to EOF, however long that takes)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def openai_error(body: bytes) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return dict(error)


def health(gateway: GatewayProcess) -> int:
    with connect(gateway) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return read_answer(sock)[0]


def send_head_in_pieces(sock: socket.socket, head: bytes) -> None:
    """Send as much of ``head`` as the server takes; it may close the connection early."""
    try:
        for start in range(0, len(head), 65536):
            sock.sendall(head[start : start + 65536])
    except (BrokenPipeError, ConnectionResetError):
        pass


def test_an_oversized_header_is_a_431_and_the_gateway_keeps_serving(
    gateway: GatewayProcess,
) -> None:
    with connect(gateway) as sock:
        send_head_in_pieces(
            sock, f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {'a' * 4_000_000}".encode()
        )
        status, headers, body = read_answer(sock)
        assert status == 431 and headers["connection"] == "close"
        assert openai_error(body)["code"] == "headers_too_large"
        assert closed(sock)
    assert health(gateway) == 200


@pytest.mark.parametrize("split", ["one write", "head's end across two writes"])
def test_a_head_inside_the_limit_with_a_large_body_behind_it_is_no_oversized_head(
    gateway: GatewayProcess, split: str
) -> None:
    """The guard refuses a read that carries a head past the limit before parsing it, unless
    the head ends inside the limit (in that read, or straddling the read before)."""
    message = {"role": "user", "content": "y" * 100_000}
    body = json.dumps({"model": "nobody-serves-it", "messages": [message]}).encode()
    start = f"{CHAT_HEAD}Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    padding = MAX_HEAD - 10 - len(start) - len("X-Pad: \r\n\r\n")
    head = f"{start}X-Pad: {'p' * padding}\r\n\r\n".encode()
    assert len(head) == MAX_HEAD - 10
    with connect(gateway) as sock:
        if split == "one write":
            sock.sendall(head + body)
        else:
            sock.sendall(head[:-1])
            time.sleep(0.3)  # read apart: the head's last byte comes with the body
            sock.sendall(head[-1:] + body)
        status, _, answer = read_answer(sock)
    assert status == 404 and openai_error(answer)["code"] == "model_not_found", answer


@pytest.mark.parametrize(("count", "expected"), [(MAX_HEADERS, 200), (MAX_HEADERS + 1, 431)])
def test_the_header_count_is_bounded_by_its_flag(
    gateway: GatewayProcess, count: int, expected: int
) -> None:
    many = "".join(f"X-H{i}: 1\r\n" for i in range(count - 1))  # and Host
    with connect(gateway) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{many}\r\n".encode())
        status, _, body = read_answer(sock)
        assert status == expected
        if expected == 431:
            assert openai_error(body)["code"] == "too_many_headers"
            assert str(MAX_HEADERS) in openai_error(body)["message"]


def test_a_declared_oversized_body_is_a_413_before_a_byte_of_it_is_sent(
    gateway: GatewayProcess,
) -> None:
    with connect(gateway) as sock:
        sock.sendall(
            f"{CHAT_HEAD}Content-Type: application/json\r\n"
            f"Content-Length: {500 * 1024 * 1024}\r\n\r\n".encode()
        )
        status, headers, body = read_answer(sock)
        assert status == 413 and headers["connection"] == "close"
        error = openai_error(body)
        assert error["code"] == "body_too_large" and error["type"] == "invalid_request_error"
        assert str(MAX_BODY) in error["message"]


def test_a_chunked_body_that_grows_past_the_limit_is_a_413(gateway: GatewayProcess) -> None:
    piece = b"x" * 16384
    with connect(gateway) as sock:
        sock.sendall(
            f"{CHAT_HEAD}Content-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        try:
            for _ in range(2 * MAX_BODY // len(piece)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        except (BrokenPipeError, ConnectionResetError):
            pass
        status, headers, body = read_answer(sock)
        assert status == 413 and headers["connection"] == "close"
        assert openai_error(body)["code"] == "body_too_large"


@pytest.mark.parametrize("depth", [129, 100_000])
def test_deep_json_is_a_400_not_a_500(gateway: GatewayProcess, depth: int) -> None:
    body = b'{"model": "tiny", "x": ' + b"[" * depth + b"]" * depth + b"}"
    with connect(gateway) as sock:
        sock.sendall(
            f"{CHAT_HEAD}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        status, _, answer = read_answer(sock)
        assert status == 400
        assert openai_error(answer)["code"] == "json_too_deep"


def test_a_connection_that_sends_nothing_is_a_408_and_closed(gateway: GatewayProcess) -> None:
    with connect(gateway) as idle, connect(gateway) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the end
        for sock in (idle, slow):
            status, headers, body = read_answer(sock)
            assert status == 408 and headers["connection"] == "close"
            assert openai_error(body)["code"] == "request_timeout"
            assert closed(sock)
    assert health(gateway) == 200


def assert_body_timed_out(sock: socket.socket, started: float) -> None:
    status, headers, body = read_answer(sock)
    assert status == 408 and headers["connection"] == "close"
    error = openai_error(body)
    assert error["code"] == "request_timeout" and f"{BODY_TIMEOUT:g} s" in error["message"]
    assert BODY_TIMEOUT - 0.5 < time.monotonic() - started < BODY_TIMEOUT + 10
    assert closed(sock)


def test_a_body_that_stops_short_of_its_length_is_a_408_and_closed(
    gateway: GatewayProcess,
) -> None:
    with connect(gateway) as sock:
        started = time.monotonic()
        sock.sendall(
            f"{CHAT_HEAD}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"model": "tiny"'
        )
        assert_body_timed_out(sock, started)
    assert health(gateway) == 200


def test_a_body_dripped_in_small_chunks_is_a_408_at_its_deadline(gateway: GatewayProcess) -> None:
    """The deadline is over the whole body: a chunk every 0.2 s never lets a gap between
    reads reach it, and the client is still cut off."""
    with connect(gateway) as sock:
        started = time.monotonic()
        sock.sendall(
            f"{CHAT_HEAD}Content-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        while not select.select([sock], [], [], 0.2)[0]:  # until the gateway answers
            assert time.monotonic() - started < BODY_TIMEOUT + 10, "no answer to the drip"
            sock.sendall(b"1\r\n \r\n")
        assert_body_timed_out(sock, started)
    assert health(gateway) == 200


def test_the_body_deadline_ends_with_the_body_not_with_the_answer(
    lone_gateways: GatewayFactory,
) -> None:
    """A stream whose request body came in time runs past the body deadline: it ends with
    its own event timeout (no worker takes the job), not cut at the body's."""
    gateway = lone_gateways.start("--body-timeout", "1", "--event-timeout", "4")
    keys = Keys(lone_gateways.prefix)
    with redis.Redis.from_url(lone_gateways.redis_url) as plain:
        write_heartbeat_sync(plain, keys, "stand-in", heartbeat("stand-in", "tiny").encode())
    body = json.dumps(
        {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    with connect(gateway) as sock:
        started = time.monotonic()
        sock.sendall(
            f"{CHAT_HEAD}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert time.monotonic() - started > 3.5
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert b'"code": "timeout"' in answer or b'"code":"timeout"' in answer


def test_a_keep_alive_connection_serves_a_bounded_number_of_requests(
    gateway: GatewayProcess,
) -> None:
    with connect(gateway) as sock:
        answers = []
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answers.append(read_answer(sock))
        assert [status for status, _, _ in answers] == [200, 200, 200]
        assert [headers.get("connection") for _, headers, _ in answers] == [None, None, "close"]
        assert closed(sock)


def test_clients_that_leave_mid_upload_cost_a_log_line_not_a_traceback_each(
    gateway: GatewayProcess,
) -> None:
    for _ in range(5):
        with connect(gateway) as sock:
            sock.sendall(
                f"{CHAT_HEAD}Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                '{"model": "tiny"'.encode()
            )
    # Each left before its body was whole: the route's read saw it leave.
    wait_until(
        lambda: "client_left_mid_upload" in gateway.log_path.read_text(),
        30,
        lambda: f"the departures logged:\n{gateway.log_tail()}",
    )
    assert health(gateway) == 200
    log = gateway.log_path.read_text()
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert log.count("client_left_mid_upload") <= 5
