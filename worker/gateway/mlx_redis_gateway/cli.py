"""``mlx-worker gateway`` (serve the OpenAI-compatible API) and ``mlx-worker api-key add``."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

from mlx_redis_protocol.cli_client import connection_options
from mlx_redis_protocol.constants import DEFAULT_LOG_TTL_SECONDS


def add_gateway_commands(commands: Any) -> None:
    gateway = commands.add_parser(
        "gateway",
        parents=[connection_options()],
        help="serve an OpenAI-compatible API (and a status page) in front of the queue",
    )
    gateway.add_argument(
        "--listen",
        default=os.environ.get("MLXW_GATEWAY_LISTEN", "127.0.0.1:8000"),
        help="HOST:PORT to listen on (env MLXW_GATEWAY_LISTEN, default 127.0.0.1:8000)",
    )
    gateway.add_argument(
        "--api-keys",
        default=os.environ.get("MLXW_API_KEYS"),
        help="TOML file of hashed API keys (env MLXW_API_KEYS; see `mlx-worker api-key add`)",
    )
    gateway.add_argument(
        "--no-auth",
        action="store_true",
        help="serve without API keys on a non-loopback address (loopback needs no flag)",
    )
    gateway.add_argument(
        "--keep-on-disconnect",
        action="store_true",
        help="a client that disconnects leaves its job running (default: it is aborted "
        "unless the request was marked resumable)",
    )
    gateway.add_argument(
        "--resumable-by-default",
        action="store_true",
        help="treat every request as resumable (X-Resumable: false opts out)",
    )
    gateway.add_argument(
        "--event-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for a request's next event before giving up (default 600)",
    )
    gateway.add_argument(
        "--log-ttl",
        type=int,
        default=DEFAULT_LOG_TTL_SECONDS,
        help="seconds a request can be resumed after its last event (the replay log's TTL)",
    )
    gateway.add_argument(
        "--quota-lease-seconds",
        type=float,
        default=30.0,
        help="how long a request's concurrency slot outlives a gateway that died (default 30)",
    )
    gateway.add_argument("--no-status-page", action="store_true", help="serve no status page")
    _add_http_limits(gateway)
    _add_request_counts(gateway)
    gateway.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host name to answer besides localhost, 127.0.0.1 and ::1 (repeatable; '*': any). "
        "Without API keys other names get a 400 (DNS rebinding); with keys, Host is checked "
        "only when this names one",
    )
    gateway.add_argument(
        "--media-fetch-host",
        action="append",
        metavar="NAME",
        help="a host whose image URLs the gateway fetches (repeatable; *.example.com: its "
        "subdomains); default none: images come as data: URLs only",
    )
    gateway.add_argument(
        "--media-fetch-network",
        action="append",
        metavar="CIDR",
        help="a non-public network those hosts may resolve to all the same (repeatable)",
    )
    gateway.add_argument(
        "--media-fetch-timeout", type=float, default=10.0, help="seconds an image URL may take"
    )
    _add_store_limits(gateway)
    gateway.set_defaults(func=run_gateway)

    api_key = commands.add_parser("api-key", help="manage the gateway's API keys")
    actions = api_key.add_subparsers(dest="api_key_command", required=True)
    add = actions.add_parser("add", help="make a key, print its secret once, store its hash")
    add.add_argument("name", help="the key's name (its quota in Redis is named after it)")
    add.add_argument("--file", required=True, help="the key file (created mode 0600)")
    add.add_argument("--requests-per-minute", type=int, default=None)
    add.add_argument("--max-concurrent", type=int, default=None)
    add.add_argument(
        "--tokens-per-minute",
        type=int,
        default=None,
        help="prompt and completion tokens a minute (a bucket of one minute's worth)",
    )
    add.add_argument(
        "--operator", action="store_true", help="the key may read the status page and JSON"
    )
    add.set_defaults(func=run_add_key)


def run_gateway(args: argparse.Namespace) -> int:
    from mlx_redis_gateway.api_keys import KeyFileError
    from mlx_redis_gateway.app import GatewaySettings, build_app
    from mlx_redis_gateway.http_limits import HttpLimits
    from mlx_redis_gateway.permissions import check_gateway_permissions
    from mlx_redis_gateway.request_counts import RequestCounts
    from mlx_redis_gateway.response_store import StoreLimits
    from mlx_redis_gateway.server import serve
    from mlx_redis_protocol.connection import REFUSED, redact
    from mlx_redis_protocol.keys import Keys
    from mlx_redis_protocol.logs import one_line
    from mlx_redis_protocol.permissions import MissingPermission

    host, port = _listen_address(args.listen)
    if args.api_keys is None and not args.no_auth and not _is_loopback(host):
        return _fail(
            f"refusing to serve {host} without API keys: pass --api-keys FILE "
            "(or --no-auth to serve it open)"
        )
    try:
        http = HttpLimits(
            max_header_bytes=args.max_header_bytes,
            max_headers=args.max_headers,
            max_body_bytes=args.max_body_bytes,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            max_connections=args.max_connections,
            max_connections_per_address=args.max_connections_per_address,
            anonymous_keep_alive=args.anonymous_keep_alive,
            max_requests_per_connection=args.max_requests_per_connection,
            cooldown_after_refusals=args.cooldown_after_refusals,
            cooldown_seconds=args.cooldown_seconds,
            max_held_per_address=args.max_held_per_address,
        )
        settings = GatewaySettings(
            redis_url=args.redis_url,
            redis_topology=args.redis_topology,
            prefix=args.prefix,
            api_keys=Path(args.api_keys) if args.api_keys else None,
            abort_on_disconnect=not args.keep_on_disconnect,
            resumable_by_default=args.resumable_by_default,
            event_timeout=args.event_timeout,
            log_ttl=args.log_ttl,
            status_page=not args.no_status_page,
            quota_lease_seconds=args.quota_lease_seconds,
            http=http,
            counts=RequestCounts(
                max_messages=args.max_messages,
                max_parts=args.max_content_parts,
                max_tools=args.max_tools,
                max_input_items=args.max_input_items,
            ),
            allowed_hosts=tuple(args.allowed_host or ()),
            media_fetch_hosts=tuple(args.media_fetch_host or ()),
            media_fetch_networks=tuple(args.media_fetch_network or ()),
            media_fetch_timeout=args.media_fetch_timeout,
            store=StoreLimits(
                ttl_seconds=args.store_ttl,
                max_response_bytes=args.store_max_response_bytes,
                max_key_bytes=args.store_max_key_bytes,
            ),
        )
    except ValueError as exc:
        return _fail(str(exc))
    try:
        app = build_app(settings)
    except (OSError, KeyFileError) as exc:
        return _fail(f"cannot use the API keys: {exc}")
    check = check_gateway_permissions(
        settings.redis_url,
        settings.redis_topology,
        Keys(settings.prefix),
        status_page=settings.status_page,
        limits=settings.api_keys is not None,
    )
    try:
        asyncio.run(check)
    except REFUSED as exc:
        return _fail(f"Redis refused us at {redact(settings.redis_url)}: {one_line(exc)}")
    except MissingPermission as exc:
        return _fail(str(exc))
    serve(app, host, port, settings.http)
    return 0


def _add_store_limits(gateway: argparse.ArgumentParser) -> None:
    from mlx_redis_gateway.response_store import DEFAULT_STORE_LIMITS as default

    gateway.add_argument(
        "--store-ttl",
        type=int,
        default=default.ttl_seconds,
        help="seconds the Responses API keeps a stored response (store: true) for "
        f"previous_response_id and GET /v1/responses/{{id}} (default {default.ttl_seconds}, "
        "30 days; 0: keep none)",
    )
    gateway.add_argument(
        "--store-max-response-bytes",
        type=int,
        default=default.max_response_bytes,
        help="the most one stored response may take, its conversation included (default "
        f"{default.max_response_bytes}); a conversation over it is a 400 with store: true",
    )
    gateway.add_argument(
        "--store-max-key-bytes",
        type=int,
        default=default.max_key_bytes,
        help="the most one API key's stored responses may take together (default "
        f"{default.max_key_bytes}); past it the key's oldest are dropped",
    )


def _add_http_limits(gateway: argparse.ArgumentParser) -> None:
    from mlx_redis_gateway.http_limits import DEFAULT_HTTP_LIMITS as limits

    gateway.add_argument(
        "--max-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help=f"a larger request body is a 413 (default {limits.max_body_bytes})",
    )
    gateway.add_argument(
        "--max-header-bytes",
        type=int,
        default=limits.max_header_bytes,
        help="a larger request line and headers are a 431, the connection closed "
        f"(default {limits.max_header_bytes})",
    )
    gateway.add_argument(
        "--max-headers",
        type=int,
        default=limits.max_headers,
        help=f"a request with more header lines is a 431 (default {limits.max_headers})",
    )
    gateway.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout,
        help="seconds a connection may take to send a request's headers, idle ones included "
        f"(408, closed; default {limits.header_timeout:g})",
    )
    gateway.add_argument(
        "--body-timeout",
        type=float,
        default=limits.body_timeout,
        help="seconds from a request's headers to the last byte of its body "
        f"(408, closed; default {limits.body_timeout:g})",
    )
    gateway.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="connections open at once; one more is a 503 and closed (default: the file "
        "descriptor limit less 512, at most 10000)",
    )
    gateway.add_argument(
        "--max-connections-per-address",
        type=int,
        default=limits.max_connections_per_address,
        help="connections one client address (an IPv6 /64) holds at once; one more is reset "
        "at accept (0: no bound, behind a reverse proxy; "
        f"default {limits.max_connections_per_address})",
    )
    gateway.add_argument(
        "--anonymous-keep-alive",
        type=float,
        default=limits.anonymous_keep_alive,
        help="seconds an idle keep-alive connection is kept when its last request had no "
        f"valid API key (with one: 75; default {limits.anonymous_keep_alive:g})",
    )
    gateway.add_argument(
        "--max-requests-per-connection",
        type=int,
        default=limits.max_requests_per_connection,
        help="requests a keep-alive connection serves before it is closed "
        f"(default {limits.max_requests_per_connection})",
    )
    gateway.add_argument(
        "--cooldown-after-refusals",
        type=int,
        default=limits.cooldown_after_refusals,
        help="a client address refused this many times for size (431, 413) within "
        "--cooldown-seconds cools down: its connections are a 429, held unread, then reset "
        f"(0: never; behind a reverse proxy, which has one address; default "
        f"{limits.cooldown_after_refusals})",
    )
    gateway.add_argument(
        "--cooldown-seconds",
        type=float,
        default=limits.cooldown_seconds,
        help=f"how long an address cools down (default {limits.cooldown_seconds:g})",
    )
    gateway.add_argument(
        "--max-held-per-address",
        type=int,
        default=limits.max_held_per_address,
        help="connections of a cooling address held open at once; more are reset at accept "
        f"(default {limits.max_held_per_address})",
    )


def _add_request_counts(gateway: argparse.ArgumentParser) -> None:
    from mlx_redis_gateway.request_counts import DEFAULT_COUNTS as counts

    for flag, default, what in (
        ("--max-messages", counts.max_messages, "messages of a request"),
        (
            "--max-content-parts",
            counts.max_parts,
            "content parts (blocks) of one message, input item or tool result",
        ),
        ("--max-tools", counts.max_tools, "tools of a request"),
        ("--max-input-items", counts.max_input_items, "items of a Responses input"),
    ):
        gateway.add_argument(
            flag,
            type=int,
            default=default,
            help=f"most {what}; more is a 400 before the request is read further "
            f"(default {default})",
        )


def run_add_key(args: argparse.Namespace) -> int:
    from mlx_redis_gateway.api_keys import KeyFileError, add_key

    try:
        secret = add_key(
            Path(args.file),
            args.name,
            requests_per_minute=args.requests_per_minute,
            max_concurrent=args.max_concurrent,
            tokens_per_minute=args.tokens_per_minute,
            operator=args.operator,
        )
    except (OSError, KeyFileError) as exc:
        return _fail(str(exc))
    print(secret)
    print(
        f"key {args.name!r} added to {args.file}; the secret above is not stored", file=sys.stderr
    )
    return 0


def _listen_address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _fail(message: str) -> int:
    print(f"mlx-worker: {message}", file=sys.stderr, flush=True)
    return 2
