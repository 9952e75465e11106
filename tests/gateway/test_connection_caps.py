"""No set of clients holds all of the gateway's connections: an address beyond its share is
reset at accept, idle sockets near the cap are closed to make room for whoever comes next
(a request with a key, a ``/health`` probe), and an idle keep-alive connection without a key
is not kept for 75 s. A real gateway over real sockets from 127.0.0.x (Linux routes all of
127.0.0.0/8 to loopback); every assert counts sockets and answers, none measures time."""

from __future__ import annotations

import json
import select
import socket
from pathlib import Path

import pytest

from mlx_redis_gateway.connection_table import ConnectionTable, address_group
from tests.gateway.test_address_cooldown import closed_at_accept, connect_from
from tests.gateway.test_auth import add_key, key_name
from tests.gateway.test_http_limits import closed, read_answer
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.waiting import wait_until

CAP = 24
PER_ADDRESS = 6
ROOM_FROM = CAP - CAP // 2  # the last 16 slots, at most half the cap, are the room kept
ATTACKERS = [f"127.0.0.{host}" for host in range(2, 10)]
VICTIM = "127.0.0.1"
OTHER = "127.0.0.10"


def answer_from(gateway: GatewayProcess, address: str, path: str, secret: str = "") -> int:
    """A GET's status, on a connection of its own from ``address``."""
    key = f"Authorization: Bearer {secret}\r\n" if secret else ""
    with connect_from(gateway, address) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{key}Connection: close\r\n\r\n".encode()
        )
        return read_answer(sock)[0]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the gateway closed ``sock`` (it sends nothing else to an idle one)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_an_address_past_its_share_is_reset_at_accept_and_others_are_served(
    lone_gateways: GatewayFactory,
) -> None:
    gateway = lone_gateways.start(
        "--max-connections-per-address", str(PER_ADDRESS), "--header-timeout", "600"
    )
    held = [connect_from(gateway, ATTACKERS[0]) for _ in range(PER_ADDRESS)]
    try:
        assert closed_at_accept(gateway, ATTACKERS[0])
        assert not any(closed_by_peer(sock) for sock in held)
        assert answer_from(gateway, ATTACKERS[1], "/health") == 200
        assert answer_from(gateway, VICTIM, "/v1/models") == 200
    finally:
        for sock in held:
            sock.close()
    # Its share is back once its sockets close.
    wait_until(
        lambda: answer_from(gateway, ATTACKERS[0], "/health") == 200,
        30,
        "the address to be served again",
    )


def test_idle_sockets_from_many_addresses_make_room_for_requests_at_the_cap(
    lone_gateways: GatewayFactory, tmp_path: Path
) -> None:
    """Eight addresses open six idle sockets each (48, twice the cap): none of their
    connections is refused with a 503, at most the room threshold stays open, and requests
    from another address, with a key or to /health, are all answered. A client whose idle
    keep-alive connections carried a key, as many as any attacker's, keeps them all."""
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("victim"))
    gateway = lone_gateways.start(
        *("--api-keys", str(keys), "--max-connections", str(CAP)),
        *("--max-connections-per-address", str(PER_ADDRESS), "--header-timeout", "600"),
    )
    keyed = [connect_from(gateway, VICTIM) for _ in range(PER_ADDRESS)]
    models = (
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {secret}\r\n\r\n"
    ).encode()
    for sock in keyed:
        sock.sendall(models)
        assert read_answer(sock)[0] == 200
    idle = [connect_from(gateway, address) for address in ATTACKERS for _ in range(PER_ADDRESS)]
    try:
        statuses = [answer_from(gateway, OTHER, "/health") for _ in range(5)]
        statuses += [answer_from(gateway, OTHER, "/v1/models", secret) for _ in range(5)]
        assert statuses == [200] * 10
        assert not any(closed_by_peer(sock) for sock in keyed)
        for sock in keyed:
            sock.sendall(models)
        assert [read_answer(sock)[0] for sock in keyed] == [200] * len(keyed)
        # Each newcomer past the threshold closed an idle socket: the rest are closed
        # without a word (no 503 answer), and at most the threshold's worth stay open.
        wait_until(
            lambda: sum(closed_by_peer(sock) for sock in idle) >= len(idle) - ROOM_FROM,
            30,
            "the idle sockets closed for room",
        )
        open_ones = [sock for sock in idle if not closed_by_peer(sock)]
        assert len(open_ones) <= ROOM_FROM
    finally:
        for sock in idle + keyed:
            sock.close()


def test_a_slot_is_refused_only_when_every_connection_is_answering(
    lone_gateways: GatewayFactory,
) -> None:
    """Connections whose request head is whole are never closed for room: with all of them
    busy (a body that never comes), the next connection is a 503."""
    cap = 8
    gateway = lone_gateways.start(
        *("--max-connections", str(cap), "--header-timeout", "600", "--body-timeout", "600")
    )
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n"
        b"Expect: 100-continue\r\n\r\n"
    )
    busy = []
    try:
        for index in range(cap):
            sock = connect_from(gateway, f"127.0.1.{index + 1}")
            busy.append(sock)
            sock.sendall(head)
            # The route asked for the body: this request is being answered.
            assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(b"{")
        assert not any(closed_by_peer(sock) for sock in busy)
        with connect_from(gateway, VICTIM) as sock:
            status, headers, body = read_answer(sock)
            assert status == 503 and headers["connection"] == "close"
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            assert closed(sock)
    finally:
        for sock in busy:
            sock.close()
    wait_until(lambda: answer_from(gateway, VICTIM, "/health") == 200, 30, "a slot again")


def test_an_idle_connection_without_a_key_is_not_kept_like_one_with_a_key(
    lone_gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    secret = add_key(keys, key_name("kept"))
    gateway = lone_gateways.start("--api-keys", str(keys), "--anonymous-keep-alive", "1")
    keyed = connect_from(gateway, VICTIM)
    anonymous = connect_from(gateway, VICTIM)
    with keyed, anonymous:
        keyed.sendall(
            f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {secret}\r\n\r\n".encode()
        )
        anonymous.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(keyed)[0] == 200 and read_answer(anonymous)[0] == 200
        # The anonymous one is closed after its short keep-alive; the keyed one, answered
        # first, is still open then (it has 75 s).
        assert closed(anonymous)
        assert not closed_by_peer(keyed)
        keyed.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_answer(keyed)[0] == 200


@pytest.mark.parametrize(
    ("address", "group"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("not-an-address", "not-an-address"),
    ],
)
def test_ipv6_addresses_are_counted_per_64(address: str, group: str) -> None:
    assert address_group(address) == group


def test_the_table_picks_the_oldest_closable_of_the_largest_address() -> None:
    table: ConnectionTable[str] = ConnectionTable(per_address=3)
    for connection in ("a1", "a2", "a3"):
        assert table.add("a", connection)
    assert not table.add("a", "a4")
    assert table.add("b", "b1") and table.add("b", "b2")
    assert table.victim(lambda c: True) == "a1"
    assert table.victim(lambda c: c != "a1") == "a2"
    assert table.victim(lambda c: c.startswith("b")) == "b1"
    for connection in ("a1", "a2"):
        table.remove("a", connection)
    assert table.victim(lambda c: True) == "b1"  # b holds two now, a one
    assert table.add("a", "a5") and table.add("a", "a6")
    assert table.victim(lambda c: True) == "a3"
    assert table.victim(lambda c: False) is None
