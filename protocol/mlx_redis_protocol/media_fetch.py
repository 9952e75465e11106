"""Fetching a media URL for a job, only from hosts an operator allows (stdlib only).

Nothing is fetched unless the operator lists the URL's host (``allowed_hosts``: names, or
``*.example.com`` for its subdomains). The name is resolved once, every address it resolves
to must be a public one (no private, loopback, link-local, multicast or reserved range, IPv4
or IPv6), and the connection goes to that resolved address (TLS still checks the name), so a
second resolution cannot swap in an internal one. Only a 200 answer is read, never a
redirect, at most ``max_bytes`` and within ``timeout_seconds`` in all. Blocking: callers run
it in a thread. Every refusal is a ``ProtocolError`` (``invalid_field``/``limit_exceeded``).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import urlsplit

from mlx_redis_protocol.errors import ProtocolError

_CHUNK: Final = 64 * 1024
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    """Which hosts may be fetched from, and how long a fetch may take."""

    allowed_hosts: frozenset[str] = field(default_factory=frozenset)
    timeout_seconds: float = 10.0
    # Non-public networks the operator allows all the same (an object store on 10.0.0.0/8):
    # only what is listed; every other non-public address stays refused.
    allowed_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def of(
        cls, hosts: Collection[str], timeout_seconds: float = 10.0, networks: Collection[str] = ()
    ) -> FetchPolicy:
        """From settings' strings; ValueError for a network that is not one."""
        return cls(
            frozenset(host.strip().lower() for host in hosts if host.strip()),
            timeout_seconds,
            tuple(ipaddress.ip_network(net.strip()) for net in networks if net.strip()),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_hosts)

    def allows(self, host: str) -> bool:
        host = host.lower()
        return any(
            host == allowed or (allowed.startswith("*.") and host.endswith(allowed[1:]))
            for allowed in self.allowed_hosts
        )


def fetch_media(url: str, policy: FetchPolicy, max_bytes: int, what: str = "url") -> bytes:
    """The body of ``url`` (a 200 answer of at most ``max_bytes``)."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme not in _DEFAULT_PORTS or not host:
        raise _refused(what, "must be an http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None:
        raise _refused(what, "must not carry credentials")
    if not policy.allows(host):
        raise _refused(what, f"names host {host!r}, which the operator does not allow")
    try:
        port = parts.port or _DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise _refused(what, "has an invalid port") from None
    address = checked_address(host, port, policy, what)
    deadline = time.monotonic() + policy.timeout_seconds
    connection = _PinnedConnection(parts.scheme, host, address, port, policy.timeout_seconds)
    try:
        path = parts.path or "/"
        connection.request(
            "GET",
            f"{path}?{parts.query}" if parts.query else path,
            headers={"Host": parts.netloc.rpartition("@")[2], "Accept": "image/*, video/*"},
        )
        response = connection.getresponse()
        if response.status != 200:
            detail = "redirects are not followed" if 300 <= response.status < 400 else ""
            raise _refused(what, f"answered HTTP {response.status} {detail}".rstrip())
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise ProtocolError("limit_exceeded", f"{what} is {length} bytes, over {max_bytes}")
        return _read_bounded(response, max_bytes, deadline, what)
    except (OSError, http.client.HTTPException) as exc:
        raise _refused(what, f"could not be fetched ({type(exc).__name__}: {exc})") from None
    finally:
        connection.close()


def checked_address(host: str, port: int, policy: FetchPolicy, what: str = "url") -> str:
    """The address ``host`` resolves to, when every address it resolves to is public (or in
    a network the policy allows)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise _refused(what, f"names host {host!r}, which does not resolve ({exc})") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.partition("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        public = ip.is_global and not ip.is_multicast
        public = public and (mapped is None or mapped.is_global)
        if not public and not any(ip in network for network in policy.allowed_networks):
            raise _refused(
                what, f"names host {host!r}, which resolves to {address}: not a public address"
            )
    if not addresses:
        raise _refused(what, f"names host {host!r}, which resolves to no address")
    return addresses[0]


def _read_bounded(
    response: http.client.HTTPResponse, max_bytes: int, deadline: float, what: str
) -> bytes:
    body = bytearray()
    while True:
        if time.monotonic() > deadline:
            raise _refused(what, "took longer than the fetch timeout")
        chunk = response.read(min(_CHUNK, max_bytes + 1 - len(body)))
        if not chunk:
            return bytes(body)
        body += chunk
        if len(body) > max_bytes:
            raise ProtocolError("limit_exceeded", f"{what} is over {max_bytes} bytes")


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to ``address`` (already checked) for ``host``: TLS's server
    name and certificate check use the host's name."""

    def __init__(self, scheme: str, host: str, address: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._scheme = scheme
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        if self._scheme == "https":
            context = ssl.create_default_context()
            sock = context.wrap_socket(sock, server_hostname=self.host)
        self.sock = sock


def _refused(what: str, why: str) -> ProtocolError:
    return ProtocolError("invalid_field", f"{what} {why}")
