"""Every Redis key and channel name of the protocol. Nothing else builds key strings.

Redis Cluster runs a script only if all its keys hash to one slot; a hash tag (the part in
braces) is what gets hashed. So per-request names put the request id in a tag
(``mlxw:log:{abc}``): one request's channel, log, attempt key and abort marker share a slot and
one script writes them together, while different requests spread over the cluster. The
dead-letter stream's tag is the job stream's whole name (``mlxw:dead:{mlxw:jobs}``), which puts
it in the job stream's slot, so one script moves an entry from one to the other.

Each model of the fleet has its own job stream, tagged with the model's name
(``mlxw:jobs:{qwen3-8b}``, dead letters in ``mlxw:dead:{qwen3-8b}``): the models' queues spread
over a Cluster's slots, and each stream's dead letters share its slot. ``mlxw:jobs`` stays the
default stream, for jobs that name no model (and for producers that predate models).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from mlx_redis_protocol.constants import DEFAULT_PREFIX
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id

# The key table's placeholder (protocol/README.md) for what a kind of name has in its hash tag.
_TAG_PLACEHOLDERS = {
    **dict.fromkeys(("out", "log", "attempt", "done", "abort", "gateway"), "request_id"),
    **dict.fromkeys(("worker", "claim", "activity", "control"), "worker_id"),
    **dict.fromkeys(("jobs", "dead", "forwarded", "fair"), "MODEL"),
    "reply": "token",
    **dict.fromkeys(("quota", "responses", "response"), "key_name"),
}
# What follows the tag in the table's row, where it is not the name's own rest.
_TAIL_PLACEHOLDERS = {"forwarded": ":ID", "fair": ":…", "response": ":RESPONSE_ID"}

# Characters that would break a hash tag or widen an operator's SCAN pattern.
_FORBIDDEN_PREFIX_CHARACTERS = frozenset("{}*?[]\\ \t\r\n")


@dataclass(frozen=True, slots=True)
class JobStream:
    """One job stream, the consumer group workers read it with, and its dead letters (which
    share its Cluster slot). ``model`` is None for the default stream."""

    stream: str
    group: str
    dead: str
    model: str | None = None


@dataclass(frozen=True, slots=True)
class FairKeys:
    """One model's fair-share state (see protocol/README.md, Fair share), every key tagged
    with the model's name: in its job stream's slot, so one script reads and moves them all.
    A tenant's queues are ``queue_base + "q:" + tenant`` and ``queue_base + "age:" + tenant``."""

    queue_base: str

    @property
    def backlogged(self) -> str:
        """Tenants with jobs waiting, scored by the start tag of their next job."""
        return f"{self.queue_base}backlogged"

    @property
    def idle(self) -> str:
        """Tenants with none waiting, scored by their last finish tag (while it is ahead)."""
        return f"{self.queue_base}idle"

    @property
    def state(self) -> str:
        """The model's virtual time (``vtime``)."""
        return f"{self.queue_base}state"

    @property
    def weights(self) -> str:
        """The fleet's tenant weights, copied into this slot by the workers."""
        return f"{self.queue_base}weights"

    def served(self, bucket: int) -> str:
        """Tokens served per tenant in the minute that starts at ``bucket`` (epoch seconds)."""
        return f"{self.queue_base}served:{bucket}"

    def queue(self, tenant: str) -> str:
        """A tenant's waiting jobs by priority (lower first)."""
        return f"{self.queue_base}q:{_checked(tenant, 'tenant')}"

    def ages(self, tenant: str) -> str:
        """A tenant's waiting jobs by arrival (ms)."""
        return f"{self.queue_base}age:{_checked(tenant, 'tenant')}"


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

    @property
    def workers(self) -> str:
        """The registry of workers: a sorted set, worker id -> its heartbeat's expiry (ms of
        Redis' clock), in the default job stream's slot."""
        return f"{self.prefix}:workers:{{{self.jobs}}}"

    @property
    def models(self) -> str:
        """The registry of the fleet's models: a sorted set, model name -> when a worker last
        advertised it or a producer last queued for it unchecked (ms of Redis' clock), in the
        default job stream's slot."""
        return f"{self.prefix}:models:{{{self.jobs}}}"

    @property
    def default_stream(self) -> JobStream:
        """Jobs that name no model; workers forward them to the default model's stream."""
        return JobStream(self.jobs, self.group, self.dead)

    def model_stream(self, model: str) -> JobStream:
        """The job stream of one model (hash-tagged by the model's name)."""
        model = _checked(model, "model name")
        return JobStream(
            f"{self.prefix}:jobs:{{{model}}}", self.group, f"{self.prefix}:dead:{{{model}}}", model
        )

    def forwarded(self, model: str, entry_id: str) -> str:
        """The marker that the default stream's entry ``entry_id`` was forwarded to the model's
        stream (in that stream's slot, so one script checks it and appends)."""
        return f"{self.prefix}:forwarded:{{{_checked(model, 'model name')}}}:{entry_id}"

    def fair(self, model: str) -> FairKeys:
        """The fair-share state of one model's stream (in its slot)."""
        return FairKeys(f"{self.prefix}:fair:{{{_checked(model, 'model name')}}}:")

    @property
    def tenant_weights(self) -> str:
        """The fleet's tenant weights (a hash: tenant -> weight), set by operators."""
        return f"{self.prefix}:tenant_weights"

    def out(self, request_id: str) -> str:
        """The request's live pub/sub channel."""
        return f"{self.prefix}:out:{{{_checked(request_id, 'request id')}}}"

    def log(self, request_id: str) -> str:
        """The request's replay log (a stream with a TTL)."""
        return f"{self.prefix}:log:{{{_checked(request_id, 'request id')}}}"

    def attempt(self, request_id: str) -> str:
        """The request's current attempt number: the fence against a stale worker's events."""
        return f"{self.prefix}:attempt:{{{_checked(request_id, 'request id')}}}"

    def event_keys(self, request_id: str) -> tuple[bytes, bytes, bytes]:
        """The keys every one of a request's events is published under (its channel, log and
        attempt key), encoded; made once a request (a bounded cache): a worker publishes an
        event per token, and checking the id and encoding three names for each took up to a
        quarter of its event loop's time an event (``mlx-worker bench publish``)."""
        return _event_keys(self.prefix, request_id)

    def finished(self, request_id: str) -> str:
        """The marker that a request finished: kept for the idempotency window, longer than
        its log, so a job queued again under the id does not run again."""
        return f"{self.prefix}:done:{{{_checked(request_id, 'request id')}}}"

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

    def claim(self, worker_id: str) -> str:
        """A live worker's claim on its id (expires unless renewed with the heartbeat): a
        second worker under the same id refuses to start while it exists."""
        return f"{self.prefix}:claim:{{{_checked(worker_id, 'worker id')}}}"

    def activity(self, worker_id: str) -> str:
        """A worker's activity: its running requests and recent token counts (a JSON value,
        expiring with the heartbeat)."""
        return f"{self.prefix}:activity:{{{_checked(worker_id, 'worker id')}}}"

    def gateway_request(self, request_id: str) -> str:
        """What an OpenAI-compatible gateway needs to stream a request again (its response
        shape and owner), in the request's slot; it expires with the request's log."""
        return f"{self.prefix}:gateway:{{{_checked(request_id, 'request id')}}}"

    def blob(self, blob_id: str) -> str:
        """A media file a producer stored for its jobs (a string, with a TTL): the key a job's
        ``blob`` reference names; workers only read it."""
        return f"{self.prefix}:blob:{{{_checked(blob_id, 'blob id')}}}"

    def quota(self, key_name: str) -> str:
        """One gateway API key's rate-limit bucket and in-flight requests (one hash)."""
        return f"{self.prefix}:quota:{{{_checked(key_name, 'API key name')}}}"

    def quota_tokens(self, key_name: str) -> str:
        """One gateway API key's tokens-per-minute bucket (a hash)."""
        return f"{self.prefix}:quota:{{{_checked(key_name, 'API key name')}}}:tokens"

    def quota_in_flight(self, key_name: str) -> str:
        """One gateway API key's in-flight requests, by lease expiry (a sorted set)."""
        return f"{self.prefix}:quota:{{{_checked(key_name, 'API key name')}}}:in_flight"

    def stored_responses(self, scope: str) -> str:
        """The Responses a gateway keeps for one API key (``scope``, its name), by expiry: a
        sorted set of ``SIZE/RESPONSE_ID`` members (SIZE: the record's bytes) scored by when
        each expires (ms of Redis' clock)."""
        return f"{self.prefix}:responses:{{{_checked(scope, 'API key name')}}}"

    def stored_responses_bytes(self, scope: str) -> str:
        """The total size of one API key's stored Responses (a string, a number of bytes)."""
        return f"{self.prefix}:responses:{{{_checked(scope, 'API key name')}}}:bytes"

    def stored_response_base(self, scope: str) -> str:
        """What a stored Response's key is ``+ RESPONSE_ID``, in its API key's slot (one
        script then drops an evicted record with its entry)."""
        return f"{self.prefix}:response:{{{_checked(scope, 'API key name')}}}:"

    def stored_response(self, scope: str, response_id: str) -> str:
        """One stored Response: its record (JSON: the response, its input and the items
        before it), expiring on its own."""
        return self.stored_response_base(scope) + _checked(response_id, "response id")

    def reply(self, token: str) -> str:
        """The list a control command's replies are pushed to."""
        return f"{self.prefix}:reply:{{{_checked(token, 'reply token')}}}"

    def pattern_of(self, name: str) -> str:
        """The key table's row (protocol/README.md) that ``name`` belongs to, under this
        prefix: its hash tag as the placeholder of its kind (``mlxw:attempt:{request_id}``,
        ``mlxw:forwarded:{MODEL}:ID``). A name whose tag is the default stream's (its dead
        letters, the registry) or that has none is its own row."""
        head, brace, rest = name.partition("{")
        tag, _, tail = rest.partition("}")
        kind = head.removeprefix(f"{self.prefix}:").partition(":")[0]
        placeholder = _TAG_PLACEHOLDERS.get(kind)
        if not brace or not head.startswith(f"{self.prefix}:") or placeholder is None:
            return name
        if tag == self.jobs:
            return name
        return f"{head}{{{placeholder}}}{_TAIL_PLACEHOLDERS.get(kind, tail)}"


# Requests whose event keys are kept: more than a worker (or a fleet's publisher in one
# process) streams at once, a few hundred bytes each.
EVENT_KEYS_CACHED = 4096


@functools.lru_cache(maxsize=EVENT_KEYS_CACHED)
def _event_keys(prefix: str, request_id: str) -> tuple[bytes, bytes, bytes]:
    keys = Keys(prefix)
    return (
        keys.out(request_id).encode(),
        keys.log(request_id).encode(),
        keys.attempt(request_id).encode(),
    )


def _checked(value: str, what: str) -> str:
    if not is_valid_id(value):
        raise ValueError(f"{what} must be {ID_RULE}, got {value!r}")
    return value
