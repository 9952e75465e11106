"""Every Redis key and channel name of the protocol. Nothing else builds key strings.

Redis Cluster runs a script only if all its keys hash to one slot; a hash tag (the part in
braces) is what gets hashed. So per-request names put the request id in a tag
(``mlxw:log:{abc}``): one request's channel, log, attempt key and abort marker share a slot and
one script writes them together, while different requests spread over the cluster. The
dead-letter stream's tag is the job stream's whole name (``mlxw:dead:{mlxw:jobs}``), which puts
it in the job stream's slot, so one script moves an entry from one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.constants import DEFAULT_PREFIX
from protocol.identifiers import ID_RULE, is_valid_id

# Characters that would break a hash tag or widen the heartbeat SCAN pattern.
_FORBIDDEN_PREFIX_CHARACTERS = frozenset("{}*?[]\\ \t\r\n")


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix or _FORBIDDEN_PREFIX_CHARACTERS.intersection(self.prefix):
            raise ValueError(
                f"prefix must be non-empty without braces, glob characters or whitespace, "
                f"got {self.prefix!r}"
            )

    @property
    def jobs(self) -> str:
        """The job stream producers XADD to."""
        return f"{self.prefix}:jobs"

    @property
    def group(self) -> str:
        """The consumer group the workers read the job stream with."""
        return self.prefix

    @property
    def dead(self) -> str:
        """The dead-letter stream for jobs that can never run (in the job stream's slot)."""
        return f"{self.prefix}:dead:{{{self.jobs}}}"

    def out(self, request_id: str) -> str:
        """The request's live pub/sub channel."""
        return f"{self.prefix}:out:{{{_checked(request_id, 'request id')}}}"

    def log(self, request_id: str) -> str:
        """The request's replay log (a stream with a TTL)."""
        return f"{self.prefix}:log:{{{_checked(request_id, 'request id')}}}"

    def attempt(self, request_id: str) -> str:
        """The request's current attempt number: the fence against a stale worker's events."""
        return f"{self.prefix}:attempt:{{{_checked(request_id, 'request id')}}}"

    def abort(self, request_id: str) -> str:
        """The marker that stops a request from starting (or continuing)."""
        return f"{self.prefix}:abort:{{{_checked(request_id, 'request id')}}}"

    @property
    def control(self) -> str:
        """The channel every worker listens to."""
        return f"{self.prefix}:control"

    def control_for(self, worker_id: str) -> str:
        """The channel only one worker listens to."""
        return f"{self.prefix}:control:{{{_checked(worker_id, 'worker id')}}}"

    def worker(self, worker_id: str) -> str:
        """A worker's heartbeat key (expires when the worker stops refreshing it)."""
        return f"{self.prefix}:worker:{{{_checked(worker_id, 'worker id')}}}"

    @property
    def worker_pattern(self) -> str:
        """A SCAN MATCH pattern for every heartbeat key."""
        return f"{self.prefix}:worker:*"

    def reply(self, token: str) -> str:
        """The list a control command's replies are pushed to."""
        return f"{self.prefix}:reply:{{{_checked(token, 'reply token')}}}"


def _checked(value: str, what: str) -> str:
    if not is_valid_id(value):
        raise ValueError(f"{what} must be {ID_RULE}, got {value!r}")
    return value
