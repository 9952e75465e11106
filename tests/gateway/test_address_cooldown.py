"""A client address refused for size again and again cools down: its next connections are a
429 held unread until the cool-down ends (or reset at accept beyond its share), while every
other address is served as before. A real gateway over real sockets: the offender connects
from 127.0.0.2 (Linux routes all of 127.0.0.0/8 to loopback), everyone else from 127.0.0.1."""

from __future__ import annotations

import contextlib
import socket
import time

import pytest

from mlx_redis_gateway.address_cooldown import MAX_ADDRESSES, AddressCooldowns
from mlx_redis_gateway.connection_table import address_group
from tests.gateway.test_http_limits import closed, health, openai_error, read_answer
from tests.support.gateway import GatewayFactory, GatewayProcess

OFFENDER = "127.0.0.2"
COOLDOWN = 3.0
OVERSIZED_BODY_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 999999999\r\n\r\n"
)


def connect_from(gateway: GatewayProcess, address: str) -> socket.socket:
    return socket.create_connection(
        ("127.0.0.1", gateway.port), timeout=60, source_address=(address, 0)
    )


def refused_for_size(gateway: GatewayProcess, address: str) -> int:
    with connect_from(gateway, address) as sock:
        sock.sendall(OVERSIZED_BODY_HEAD)
        return read_answer(sock)[0]


def closed_at_accept(gateway: GatewayProcess, address: str) -> bool:
    """Whether a new connection from ``address`` is closed without an answer. The gateway
    closes it as it accepts, so the reset may come back before ``connect`` returns (the
    kernel had completed the handshake and the close raced it), at the first read, or the
    read sees the orderly end: each counts as closed."""
    try:
        sock = connect_from(gateway, address)
    except ConnectionResetError:
        return True
    with sock:
        sock.settimeout(1.0)  # a held connection would time out here
        try:
            return sock.recv(65536) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def held_open(sock: socket.socket, seconds: float) -> bool:
    """Whether the gateway neither sends more nor closes ``sock`` within ``seconds``."""
    sock.settimeout(seconds)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    finally:
        sock.settimeout(60)
    return False


@pytest.fixture
def gateway(lone_gateways: GatewayFactory) -> GatewayProcess:
    return lone_gateways.start(
        "--cooldown-after-refusals",
        "3",
        "--cooldown-seconds",
        str(COOLDOWN),
        "--max-held-per-address",
        "2",
    )


def test_an_address_refused_for_size_three_times_is_held_off_until_its_cooldown_ends(
    gateway: GatewayProcess,
) -> None:
    assert [refused_for_size(gateway, OFFENDER) for _ in range(3)] == [413, 413, 413]
    started = time.monotonic()
    held = connect_from(gateway, OFFENDER)
    with held:
        # Answered before it sent a byte, then held: what it sends is never read.
        status, headers, body = read_answer(held)
        assert status == 429 and headers["connection"] == "close"
        assert 1 <= int(headers["retry-after"]) <= COOLDOWN
        assert openai_error(body)["code"] == "address_cooling_down"
        held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert held_open(held, 1.0)
        # Another address is served meanwhile.
        assert health(gateway) == 200
        # Reset when the cool-down ends, and the address is served again.
        assert closed(held)
    assert time.monotonic() - started >= COOLDOWN - 0.5
    with connect_from(gateway, OFFENDER) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_answer(sock)[0] == 200


def test_a_cooling_address_beyond_its_held_share_is_reset_at_accept(
    gateway: GatewayProcess,
) -> None:
    for _ in range(3):
        refused_for_size(gateway, OFFENDER)
    held = [connect_from(gateway, OFFENDER) for _ in range(2)]
    try:
        assert [read_answer(sock)[0] for sock in held] == [429, 429]
        assert closed_at_accept(gateway, OFFENDER)
        assert all(held_open(sock, 0.2) for sock in held)
    finally:
        for sock in held:
            sock.close()
    assert health(gateway) == 200


def test_size_refusals_spread_wider_than_the_cooldown_start_none(
    lone_gateways: GatewayFactory,
) -> None:
    gateway = lone_gateways.start("--cooldown-seconds", "0.5")
    for _ in range(4):
        # Two size refusals within each 0.5 s window, three overall.
        assert refused_for_size(gateway, OFFENDER) == 413
        time.sleep(0.3)
    with connect_from(gateway, OFFENDER) as sock:
        sock.sendall(b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert read_answer(sock)[0] == 404


def test_chunked_bodies_past_the_limit_count_toward_a_cooldown(
    lone_gateways: GatewayFactory,
) -> None:
    """A chunked body says no length up front: the route's read refuses it (413) once it
    grows past the limit, and that counts like the guard's own refusals."""
    gateway = lone_gateways.start("--max-body-bytes", "4096", "--cooldown-seconds", str(COOLDOWN))
    piece = b"x" * 4096
    for _ in range(3):
        with connect_from(gateway, OFFENDER) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for _ in range(4):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            status, _, body = read_answer(sock)
            assert status == 413 and openai_error(body)["code"] == "body_too_large"
    with connect_from(gateway, OFFENDER) as sock:
        status, _, body = read_answer(sock)
        assert status == 429 and openai_error(body)["code"] == "address_cooling_down"
    assert health(gateway) == 200


def test_too_many_headers_count_toward_a_cooldown(lone_gateways: GatewayFactory) -> None:
    gateway = lone_gateways.start("--max-headers", "8", "--cooldown-seconds", str(COOLDOWN))
    extra = "".join(f"X-Filler-{i}: {i}\r\n" for i in range(12))
    for _ in range(3):
        with connect_from(gateway, OFFENDER) as sock:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
            status, _, body = read_answer(sock)
            assert status == 431 and openai_error(body)["code"] == "too_many_headers"
    with connect_from(gateway, OFFENDER) as sock:
        assert read_answer(sock)[0] == 429
    assert health(gateway) == 200


def test_cooldowns_can_be_turned_off(lone_gateways: GatewayFactory) -> None:
    gateway = lone_gateways.start("--cooldown-after-refusals", "0")
    assert [refused_for_size(gateway, OFFENDER) for _ in range(6)] == [413] * 6
    assert health(gateway) == 200


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_address_table_is_bounded_and_forgets_the_least_recent() -> None:
    clock = Clock()
    cooldowns = AddressCooldowns(refusals=2, seconds=10.0, max_held=1, clock=clock)
    cooldowns.refused("first")
    for number in range(MAX_ADDRESSES):
        cooldowns.refused(f"10.0.{number // 256}.{number % 256}")
    cooldowns.refused("first")  # its earlier refusal was forgotten: one so far
    assert cooldowns.cooling("first") == 0
    cooldowns.refused("10.0.15.255")
    assert cooldowns.cooling("10.0.15.255") == 10.0
    clock.now += 4
    assert cooldowns.cooling("10.0.15.255") == 6.0
    assert cooldowns.hold("10.0.15.255") and not cooldowns.hold("10.0.15.255")
    cooldowns.release("10.0.15.255")
    assert cooldowns.hold("10.0.15.255")


def test_a_crowd_of_addresses_refused_once_each_does_not_flush_a_cooling_one() -> None:
    clock = Clock()
    cooldowns = AddressCooldowns(refusals=2, seconds=10.0, max_held=1, clock=clock)
    cooldowns.refused("offender")
    cooldowns.refused("offender")
    assert cooldowns.cooling("offender") == 10.0
    for number in range(3 * MAX_ADDRESSES):
        cooldowns.refused(f"10.{number // 65536}.{number // 256 % 256}.{number % 256}")
    assert cooldowns.cooling("offender") == 10.0


def test_an_ipv6_client_cools_down_per_64() -> None:
    cooldowns = AddressCooldowns(refusals=2, seconds=10.0, max_held=1, clock=Clock())
    cooldowns.refused(address_group("2001:db8:1:2::1"))
    cooldowns.refused(address_group("2001:db8:1:2::99"))
    assert cooldowns.cooling(address_group("2001:db8:1:2:ffff::7")) == 10.0
    assert cooldowns.cooling(address_group("2001:db8:1:3::1")) == 0
