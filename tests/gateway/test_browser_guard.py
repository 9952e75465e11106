"""Keyless mode is safe from the browser: a Host allowlist (DNS rebinding), JSON bodies only
(no simple cross-origin form posts), security headers on every answer and a CSP on the status
page, no server banner, and dead letters' messages marked as the tenant's text."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

from mlx_redis_gateway.status_page import render_page
from tests.gateway.test_http_limits import connect, read_answer
from tests.gateway.test_status_page import HOSTILE, _hostile_status
from tests.support.gateway import GatewayFactory, GatewayProcess

CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})


def answer(
    gateway: GatewayProcess,
    path: str = "/health",
    *,
    host: str | None = None,
    method: str = "GET",
    content_type: str | None = None,
    body: str = "",
) -> tuple[int, dict[str, str], bytes]:
    head = f"{method} {path} HTTP/1.1\r\nHost: {host or f'127.0.0.1:{gateway.port}'}\r\n"
    if content_type is not None:
        head += f"Content-Type: {content_type}\r\n"
    data = body.encode()
    head += f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    with connect(gateway) as sock:
        sock.sendall(head.encode() + data)
        return read_answer(sock)


def test_without_keys_only_loopback_hosts_are_answered(lone_gateways: GatewayFactory) -> None:
    gateway = lone_gateways.start()
    port = gateway.port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
        assert answer(gateway, host=host)[0] == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "0.0.0.0"):
        status, headers, body = answer(gateway, host=host)
        assert status == 400, host
        assert json.loads(body)["error"]["code"] == "invalid_host"
        assert headers["x-frame-options"] == "DENY"
    # A rebinding page cannot read the status page either.
    assert answer(gateway, "/status.json", host="evil.example")[0] == 400


def test_allowed_host_adds_names_and_a_star_allows_any(lone_gateways: GatewayFactory) -> None:
    named = lone_gateways.start("--allowed-host", "api.example.com")
    assert answer(named, host="api.example.com:443")[0] == 200
    assert answer(named, host="localhost")[0] == 200
    assert answer(named, host="evil.example")[0] == 400
    anyone = lone_gateways.start("--allowed-host", "*")
    assert answer(anyone, host="evil.example")[0] == 200


def test_with_keys_any_host_is_answered_unless_names_are_given(
    lone_gateways: GatewayFactory,
    tmp_path: Path,
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text("")
    assert answer(lone_gateways.start("--api-keys", str(keys)), host="api.example.com")[0] == 200
    named = lone_gateways.start("--api-keys", str(keys), "--allowed-host", "api.example.com")
    assert answer(named, host="other.example")[0] == 400


def test_a_body_not_sent_as_json_is_a_415(lone_gateways: GatewayFactory) -> None:
    gateway = lone_gateways.start()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        status, _, body = answer(
            gateway,
            "/v1/chat/completions",
            method="POST",
            content_type=content_type,
            body=CHAT,
        )
        assert status == 415, content_type
        assert json.loads(body)["error"]["code"] == "unsupported_media_type"
    # JSON with a charset passes the check (no worker serves tiny here: a 404 after it).
    status, _, body = answer(
        gateway,
        "/v1/chat/completions",
        method="POST",
        content_type="application/json; charset=utf-8",
        body=CHAT,
    )
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_every_answer_has_security_headers_and_no_server_banner(
    lone_gateways: GatewayFactory,
) -> None:
    gateway = lone_gateways.start()
    for path in ("/health", "/v1/models", "/", "/status/fragment", "/nowhere"):
        _, headers, _ = answer(gateway, path)
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["x-frame-options"] == "DENY", path
        assert "server" not in headers, path
    status, headers, page = answer(gateway, "/")
    assert status == 200
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    # The policy allows exactly the page's one script, by its hash.
    scripts = re.findall(rb"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1
    digest = base64.b64encode(hashlib.sha256(scripts[0]).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy
    assert "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]


def test_a_dead_letters_message_is_marked_as_the_tenants_text() -> None:
    page = render_page(_hostile_status())
    cell = re.search(r'<td class="message tenant-text" title="([^"]+)">([^<]*)</td>', page)
    assert cell is not None and "producer" in cell.group(1)
    assert HOSTILE not in page and "&lt;script&gt;" in cell.group(2)
    assert "message (tenant text)" in page
