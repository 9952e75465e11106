"""Bearer API keys from a TOML file that holds only their SHA-256 digests.

::

    [[key]]
    name = "team-a"              # 1-128 of A-Z a-z 0-9 . _ : - (names its quota in Redis)
    sha256 = "9f86d08..."        # hex digest of the secret
    requests_per_minute = 600    # optional: the rate limit (a token bucket, bursts of this many)
    tokens_per_minute = 200000   # optional: prompt and completion tokens (a bucket, see quotas)
    max_concurrent = 16          # optional: requests in flight at once
    operator = true              # optional: may see the status page (default false)

Secrets are random (``mlx-worker gateway add-key`` makes one, prints it once and appends its
digest), so one fast hash is enough: there is no password to guess. The file is read again
when it changes, so keys can be added or revoked without a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id

SECRET_PREFIX: Final = "mlxw-"
# A key's optional limits (integers >= 1), as the file and ``ApiKey`` name them.
LIMITS: Final = ("requests_per_minute", "max_concurrent", "tokens_per_minute")
# The file's modification time is looked at no more often than this.
RELOAD_CHECK_SECONDS: Final = 1.0
# A file changed more recently than this may be half written (an editor that truncates, then
# writes): it is read at a later check.
SETTLE_SECONDS: Final = 0.5


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    sha256: str
    requests_per_minute: int | None = None
    max_concurrent: int | None = None
    tokens_per_minute: int | None = None
    operator: bool = False  # may read the fleet's status (page and JSON)


class KeyFileError(ValueError):
    """The key file cannot be used (the message says where and why)."""


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def parse_keys(text: str, source: str = "key file") -> dict[str, ApiKey]:
    """The keys of a key file's text, by digest; KeyFileError naming the bad entry."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeyFileError(f"{source}: not TOML: {exc}") from exc
    entries = document.get("key", [])
    if not isinstance(entries, list):
        raise KeyFileError(f"{source}: 'key' must be an array of tables ([[key]])")
    keys: dict[str, ApiKey] = {}
    names: set[str] = set()
    for index, entry in enumerate(entries):
        key = _entry(entry, f"{source}: key #{index + 1}")
        if key.name in names:
            raise KeyFileError(f"{source}: key name {key.name!r} is used twice")
        names.add(key.name)
        keys[key.sha256] = key
    return keys


def _entry(entry: Any, where: str) -> ApiKey:
    if not isinstance(entry, dict):
        raise KeyFileError(f"{where}: must be a table")
    name, sha = entry.get("name"), entry.get("sha256")
    if not isinstance(name, str) or not is_valid_id(name):
        raise KeyFileError(f"{where}: name must be {ID_RULE}")
    if not isinstance(sha, str) or len(sha) != 64 or not _is_hex(sha):
        raise KeyFileError(f"{where} ({name}): sha256 must be 64 hex digits")
    limits = {}
    for field in LIMITS:
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise KeyFileError(f"{where} ({name}): {field} must be an integer")
        if value is not None and value < 1:
            raise KeyFileError(f"{where} ({name}): {field} must be at least 1")
        limits[field] = value
    operator = entry.get("operator", False)
    if not isinstance(operator, bool):
        raise KeyFileError(f"{where} ({name}): operator must be true or false")
    return ApiKey(name=name, sha256=sha.lower(), operator=operator, **limits)


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


class KeyFile:
    """The keys of one file, re-read when its modification time changes. A file that turns
    bad keeps the last good keys (and says so in ``problem``) rather than lock everyone out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problem: str | None = None
        self._stamp = self._stat()
        self._keys = parse_keys(path.read_text(), str(path))  # a bad file fails at start
        self._checked = time.monotonic()

    def find(self, secret: str) -> ApiKey | None:
        """The key whose digest ``secret`` has, or None."""
        self._reload_if_changed()
        wanted = digest(secret)
        # Looked up by digest, then compared in constant time (a dict lookup of an unguessable
        # digest leaks nothing useful, the compare is belt and braces).
        key = self._keys.get(wanted)
        if key is not None and hmac.compare_digest(key.sha256, wanted):
            return key
        return None

    def __len__(self) -> int:
        return len(self._keys)

    def _stat(self) -> tuple[int, int]:
        info = os.stat(self.path)
        return info.st_mtime_ns, info.st_size

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_SECONDS:
            return
        self._checked = now
        try:
            stamp = self._stat()
            if stamp == self._stamp or time.time_ns() - stamp[0] < SETTLE_SECONDS * 1e9:
                return
            self._keys = parse_keys(self.path.read_text(), str(self.path))
            self._stamp, self.problem = stamp, None
        except (OSError, KeyFileError) as exc:
            self.problem = str(exc)


def add_key(
    path: Path,
    name: str,
    *,
    requests_per_minute: int | None,
    max_concurrent: int | None,
    tokens_per_minute: int | None = None,
    operator: bool = False,
) -> str:
    """Append a new key to ``path`` (created when missing, mode 0600); returns its secret."""
    existing = parse_keys(path.read_text(), str(path)) if path.exists() else {}
    if any(key.name == name for key in existing.values()):
        raise KeyFileError(f"{path}: a key named {name!r} exists already")
    limits = {
        "requests_per_minute": requests_per_minute,
        "max_concurrent": max_concurrent,
        "tokens_per_minute": tokens_per_minute,
    }
    # The name's and the limits' rules, before anything is written: an entry that fails them
    # would leave a file no gateway starts with and no later add can read.
    _entry({"name": name, "sha256": "0" * 64, **limits}, "new key")
    secret = new_secret()
    lines = ["", "[[key]]", f'name = "{name}"', f'sha256 = "{digest(secret)}"']
    lines += [f"{field} = {value}" for field, value in limits.items() if value is not None]
    if operator:
        lines.append("operator = true")
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(descriptor, "a") as handle:
        handle.write("\n".join(lines) + "\n")
    parse_keys(path.read_text(), str(path))  # what was written must read back
    return secret
