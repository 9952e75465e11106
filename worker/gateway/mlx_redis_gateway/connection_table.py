"""The gateway's open connections by client address, so that no set of clients can hold all
of them.

Two rules, checked as a connection is accepted (``http_limits.guarded_protocol`` applies them):

- An address holds at most ``per_address`` connections at once (IPv6 counted per /64, the
  block one host is given, so a client cannot spread its sockets over its own addresses); one
  more is reset at accept.
- Near the gateway's cap (its last ``reserve`` connections), each newcomer makes room: the
  oldest connection that is not answering a request (idle between keep-alive requests, or
  still sending a head), of the address with the most connections open, is closed. So
  thousands of idle or half-open sockets from hundreds of addresses are replaced by whoever
  comes next, and a request with a key, or a ``/health`` probe, finds a slot where before it
  found a 503. Connections whose last request had a valid key are passed over while one
  without is found. Connections answering a request are never closed for room: only when none is
  left to close is the newcomer refused (503).

The table holds only open connections, so it is bounded by the connection cap.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Final, Generic, TypeVar

Connection = TypeVar("Connection")

# Addresses looked at per search for a connection to close: a search costs a bounded time
# however many addresses are open.
MAX_ADDRESSES_SEARCHED: Final = 64


def address_group(host: str) -> str:
    """The key an address's connections are counted under: an IPv4 address itself (IPv4
    mapped into IPv6 included), an IPv6 address's /64, any other name as it is."""
    try:
        address = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class ConnectionTable(Generic[Connection]):
    """Open connections per address group, oldest first, and groups by their size."""

    def __init__(self, per_address: int) -> None:
        """``per_address``: most connections of one group (0: no bound)."""
        self.per_address = per_address
        self._groups: dict[str, dict[Connection, None]] = {}
        # Groups by how many connections they hold, to find the largest without a scan.
        self._by_size: dict[int, dict[str, None]] = {}
        self._largest = 0

    def add(self, group: str, connection: Connection) -> bool:
        """Count ``connection`` under ``group``; False (nothing counted) when the group holds
        its share already."""
        members = self._groups.get(group)
        size = len(members) if members is not None else 0
        if self.per_address and size >= self.per_address:
            return False
        if members is None:
            members = self._groups[group] = {}
        members[connection] = None
        self._resize(group, size, size + 1)
        return True

    def remove(self, group: str, connection: Connection) -> None:
        members = self._groups.get(group)
        if members is None or connection not in members:
            return
        del members[connection]
        size = len(members)
        if not size:
            del self._groups[group]
        self._resize(group, size + 1, size)

    def _resize(self, group: str, old: int, new: int) -> None:
        if old:
            sized = self._by_size[old]
            del sized[group]
            if not sized:
                del self._by_size[old]
        if new:
            self._by_size.setdefault(new, {})[group] = None
        self._largest = max(self._largest, new)
        while self._largest and self._largest not in self._by_size:
            self._largest -= 1

    def victim(self, closable: Callable[[Connection], bool]) -> Connection | None:
        """The connection to close for room: the oldest ``closable`` one of the largest
        group that has one; None when the search finds none."""
        searched = 0
        for size in range(self._largest, 0, -1):
            for group in self._by_size.get(size, {}):
                for connection in self._groups[group]:
                    if closable(connection):
                        return connection
                searched += 1
                if searched >= MAX_ADDRESSES_SEARCHED:
                    return None
        return None
