"""What a gateway is told at start: where Redis is, the keys, and its limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlx_redis_gateway.http_limits import DEFAULT_HTTP_LIMITS, HttpLimits
from mlx_redis_gateway.quotas import LEASE_SECONDS
from mlx_redis_gateway.request_counts import DEFAULT_COUNTS, RequestCounts
from mlx_redis_gateway.response_store import DEFAULT_STORE_LIMITS, StoreLimits
from mlx_redis_protocol.constants import DEFAULT_LOG_TTL_SECONDS, DEFAULT_PREFIX, DEFAULT_REDIS_URL
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.media_fetch import FetchPolicy


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    redis_url: str = DEFAULT_REDIS_URL
    redis_topology: str = "auto"
    prefix: str = DEFAULT_PREFIX
    api_keys: Path | None = None  # None: no authentication
    # A client that disconnects from a request it did not mark resumable aborts its job.
    abort_on_disconnect: bool = True
    # Requests are resumable unless they say otherwise (their disconnect never aborts).
    resumable_by_default: bool = False
    # Longest wait for a request's next event before the gateway gives up on it.
    event_timeout: float = 600.0
    log_ttl: int = DEFAULT_LOG_TTL_SECONDS
    status_page: bool = True
    # How long a request's concurrency slot outlives a gateway that stopped refreshing it.
    quota_lease_seconds: float = LEASE_SECONDS
    limits: Limits = DEFAULT_LIMITS
    http: HttpLimits = DEFAULT_HTTP_LIMITS
    counts: RequestCounts = DEFAULT_COUNTS
    # Host names answered besides the loopback ones ("*": any); checked without API keys,
    # or with them when any is named.
    allowed_hosts: tuple[str, ...] = ()
    # Hosts whose image URLs the gateway fetches (``*.example.com``: its subdomains); none:
    # images come as data: URLs only. Only public addresses, unless a network is listed.
    media_fetch_hosts: tuple[str, ...] = ()
    media_fetch_networks: tuple[str, ...] = ()
    media_fetch_timeout: float = 10.0
    # The Responses API's stored responses (``store: true``): how long, how big.
    store: StoreLimits = DEFAULT_STORE_LIMITS

    @property
    def fetch_policy(self) -> FetchPolicy:
        return FetchPolicy.of(
            self.media_fetch_hosts, self.media_fetch_timeout, self.media_fetch_networks
        )

    def checked_hosts(self) -> tuple[str, ...] | None:
        """The Host allowlist to enforce; None: any Host."""
        if self.api_keys is not None and not self.allowed_hosts:
            return None
        return self.allowed_hosts

    def __post_init__(self) -> None:
        self.fetch_policy  # noqa: B018  # a network that is not one
        if self.quota_lease_seconds < 1:
            raise ValueError(
                f"--quota-lease-seconds must be at least 1, got {self.quota_lease_seconds}"
            )
