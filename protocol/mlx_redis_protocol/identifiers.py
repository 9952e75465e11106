"""What a request id, worker id or cache name may look like, and fresh request ids.

Ids end up inside Redis key names between ``{`` and ``}`` (a Cluster hash tag), so the alphabet
excludes braces, whitespace and glob characters: no id can change which slot a key hashes to
or widen a SCAN pattern. Cache names also become file names on the worker, hence no ``:``.
"""

from __future__ import annotations

import re
import uuid
from typing import Final

MAX_ID_LENGTH: Final = 128

_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_CACHE_NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")

ID_RULE: Final = "1-128 characters of A-Z a-z 0-9 . _ : -"
CACHE_NAME_RULE: Final = "1-128 characters of A-Z a-z 0-9 . _ -, not starting with '.'"


def is_valid_id(value: str) -> bool:
    """True for a usable request id or worker id."""
    return _ID_PATTERN.fullmatch(value) is not None


def is_valid_cache_name(value: str) -> bool:
    """True for a name a worker can safely turn into a file name."""
    return _CACHE_NAME_PATTERN.fullmatch(value) is not None


def new_request_id() -> str:
    """A random request id (32 hex digits)."""
    return uuid.uuid4().hex


def stream_id_time(entry_id: str) -> float | None:
    """When a stream entry was added, in epoch seconds (on Redis' clock): the millisecond part
    of its id. A job's arrival, from which its usage timings count; None for an id that is
    not ``<ms>-<seq>``."""
    millis, dash, seq = entry_id.partition("-")
    if not (millis.isdigit() and dash and seq.isdigit()):
        return None
    return int(millis) / 1000
