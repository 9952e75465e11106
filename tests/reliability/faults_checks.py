"""The checks every fault scenario shares: the job entries it queues, and the verification
of what became of each (replay log, subscriber stream, dead letters, greedy text, worker
logs). Decides once, for all scenarios, what counts as lost, duplicated or leaked."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack  # type: ignore[import-untyped]
import redis
from redis.sentinel import Sentinel

from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.connection import SENTINEL_SCHEME, parse_sentinel_url
from mlx_redis_protocol.constants import LOG_EVENT_FIELD
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent, Event, Job, ResetEvent
from tests.reliability.streams import (
    Followed,
    LogCheck,
    check_followed,
    check_log,
    dead_letters,
    read_log_entries,
    stray_dead_letters,
    wait_settled,
)
from tests.support.processes import WorkerProcess

# -- job entries ------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """One entry to queue: a valid greedy job (``prompt`` set) or an invalid one (the
    decoder's verdict in ``expect_code``; ``rid`` is None when the worker cannot read it)."""

    rid: str | None
    data: bytes
    prompt: str | None = None
    expect_code: str | None = None
    canary: str | None = None  # a string inside the entry's bytes that no log may show

    @property
    def valid(self) -> bool:
        return self.prompt is not None


def valid_specs(rids: Sequence[str], prompts: Sequence[str], max_tokens: int) -> list[JobSpec]:
    """Greedy jobs, prompts taken round-robin."""
    specs = []
    for index, rid in enumerate(rids):
        prompt = prompts[index % len(prompts)]
        job = Job(request_id=rid, prompt=prompt, max_tokens=max_tokens, temperature=0.0)
        specs.append(JobSpec(rid, encode_job(job), prompt=prompt))
    return specs


INVALID_KINDS = ("max_tokens", "garbage", "version", "no_prompt")


def invalid_specs(tag: str, count: int) -> list[JobSpec]:
    """Entries the decoder refuses, each carrying a canary: max_tokens over the limit, bytes
    that are not msgpack, an unknown version, a job without a prompt."""
    specs = []
    for index in range(count):
        kind = INVALID_KINDS[index % len(INVALID_KINDS)]
        rid = f"{tag}-bad-{index:03d}"
        canary = f"canary{index:03d}x{tag.replace('-', '')}"
        fields: dict[str, Any] = {"v": 1, "request_id": rid, "prompt": canary}
        if kind == "max_tokens":
            fields["max_tokens"] = 32769
        elif kind == "version":
            fields["v"] = 2
        elif kind == "no_prompt":
            fields = {"v": 1, "request_id": rid, "max_tokens": 4, "metadata": {"note": canary}}
        data = b"\xc1" + canary.encode() if kind == "garbage" else msgpack.packb(fields)
        try:
            decode_job(data)
        except ProtocolError as exc:
            readable = exc.request_id == rid
            specs.append(JobSpec(rid if readable else None, data, None, exc.code, canary))
            continue
        raise AssertionError(f"the invalid entry {data!r} decodes")
    return specs


# -- reading Redis -------------------------------------------------------------------------------


def admin_redis(url: str) -> Any:
    """A plain synchronous redis-py client for any of the three URL kinds (the checks read
    Redis independently of the project's own connection code)."""
    if url.startswith(f"{SENTINEL_SCHEME}://"):
        address = parse_sentinel_url(url)
        sentinel = Sentinel(list(address.sentinels), socket_timeout=5)  # type: ignore[no-untyped-call]
        return sentinel.master_for(address.service, socket_timeout=10)
    plain = redis.Redis.from_url(url, socket_timeout=10)
    if plain.info("cluster").get("cluster_enabled"):
        plain.close()
        return redis.RedisCluster.from_url(url.rsplit("/", 1)[0], socket_timeout=10)
    return plain


# -- the verification ---------------------------------------------------------------------------


@dataclass
class Tally:
    jobs: int = 0
    invalid: int = 0
    done: int = 0
    lost: int = 0
    duplicate_endings: int = 0
    repeated_seqs: int = 0
    bad_logs: int = 0
    bad_subscribers: int = 0
    dead_letters: int = 0
    invalid_dead_ok: int = 0
    redelivered: int = 0
    mismatches: int = 0
    settled: bool = False
    # The longest silence before a reset: from the last event the lost attempt left in the
    # log to the new attempt's reset (log entry ids are Redis's clock, in ms).
    longest_restart: float = 0.0
    leaks: int = 0
    redis_failing: int = 0
    redis_recovered: int = 0
    problems: list[str] = field(default_factory=list)
    logs: dict[str, LogCheck] = field(default_factory=dict)

    def rows(self) -> list[tuple[str, Any]]:
        return [
            ("jobs (valid, greedy)", self.jobs),
            ("invalid entries mixed in", self.invalid),
            ("done", self.done),
            ("lost", self.lost),
            ("duplicate endings (logs with > 1 terminal event)", self.duplicate_endings),
            ("repeated seqs", self.repeated_seqs),
            ("logs failing check_log", self.bad_logs),
            ("subscriber streams failing check_followed", self.bad_subscribers),
            ("dead letters", self.dead_letters),
            ("invalid entries dead-lettered once with the decoder's code", self.invalid_dead_ok),
            ("redelivered jobs (a reset in the log)", self.redelivered),
            (
                "longest wait for a new attempt (last logged event to reset, s)",
                self.longest_restart,
            ),
            ("greedy texts different from the reference", self.mismatches),
            (
                "job streams (default, model) empty, nothing pending",
                "yes" if self.settled else "NO",
            ),
            ("worker log lines naming a prompt or job bytes", self.leaks),
            (
                "redis_failing / redis_recovered log lines",
                f"{self.redis_failing} / {self.redis_recovered}",
            ),
        ]


def verify(
    admin: Any,
    keys: Keys,
    specs: Sequence[JobSpec],
    followed: Mapping[str, Followed],
    references: Mapping[str, str],
    workers: Sequence[WorkerProcess],
) -> Tally:
    """Every invariant of the event rules, for every entry queued."""
    tally = Tally(jobs=sum(s.valid for s in specs), invalid=sum(not s.valid for s in specs))
    tally.settled = wait_settled(admin, keys)
    if not tally.settled:
        tally.problems.append("the job streams are not empty or entries are still pending")
    tally.problems += stray_dead_letters(admin, keys)
    dead = dead_letters(admin, keys)
    tally.dead_letters = len(dead)
    for spec in specs:
        problems = _verify_one(admin, keys, spec, followed, references, dead, tally)
        tally.problems += [f"{spec.rid or spec.canary}: {p}" for p in problems]
    _check_worker_logs(specs, workers, tally)
    return tally


def _verify_one(
    admin: Any,
    keys: Keys,
    spec: JobSpec,
    followed: Mapping[str, Followed],
    references: Mapping[str, str],
    dead: list[dict[str, bytes]],
    tally: Tally,
) -> list[str]:
    mine = [row for row in dead if row.get("job") == spec.data]
    if spec.rid is None:  # unreadable: the dead-letter stream is its only trace
        if len(mine) == 1 and mine[0]["code"].decode() == spec.expect_code:
            tally.invalid_dead_ok += 1
            return []
        tally.lost += not mine
        return [f"{len(mine)} dead letters, codes {[r.get('code') for r in mine]}"]
    problems = []
    entries = read_log_entries(admin, keys, spec.rid)
    log = check_log(spec.rid, entries)
    tally.longest_restart = max(tally.longest_restart, _restart_gap(entries))
    tally.logs[spec.rid] = log
    tally.bad_logs += bool(log.problems)
    tally.duplicate_endings += log.terminals > 1
    tally.repeated_seqs += log.repeated_seqs
    tally.redelivered += log.resets > 0
    problems += log.problems
    seen = followed.get(spec.rid)
    subscriber = ["never followed"] if seen is None else check_followed(seen, log)
    tally.bad_subscribers += bool(subscriber)
    problems += subscriber
    if subscriber and seen is not None:
        problems.append(_divergence(seen.events, log.events))
    terminal = log.terminal
    if not spec.valid:
        ok = isinstance(terminal, ErrorEvent) and terminal.code == "invalid_job"
        ok = ok and len(mine) == 1 and mine[0]["code"].decode() == spec.expect_code
        tally.invalid_dead_ok += ok
        tally.lost += terminal is None
        return [*problems, *([] if ok else [f"ended {terminal}, {len(mine)} dead letters"])]
    if isinstance(terminal, DoneEvent):
        tally.done += 1
        want = references[spec.prompt or ""]
        if terminal.output_text != want or log.final_text != want:
            tally.mismatches += 1
            problems.append(f"text {terminal.output_text!r} != greedy {want!r}")
    elif isinstance(terminal, ErrorEvent) and terminal.code == "dead_lettered" and mine:
        problems.append(f"valid job dead-lettered: {terminal.message}")
    else:
        tally.lost += 1
        problems.append(f"lost: ended with {terminal}")
    return problems


def _check_worker_logs(
    specs: Sequence[JobSpec], workers: Sequence[WorkerProcess], tally: Tally
) -> None:
    """Burst logging counts, and no line carrying a prompt or an entry's bytes."""
    needles = {s.prompt for s in specs if s.prompt} | {s.canary for s in specs if s.canary}
    for process in workers:
        for line in process.log_text().splitlines():
            if any(needle in line for needle in needles):
                tally.leaks += 1
                tally.problems.append(
                    f"worker {process.worker_id} logged job content: {line[:200]}"
                )
        for event in process.log_events():
            tally.redis_failing += event.get("event") == "redis_failing"
            tally.redis_recovered += event.get("event") == "redis_recovered"


def _divergence(seen: Sequence[Event], logged: Sequence[Event]) -> str:
    """Where a subscriber's events first differ from the log's, as (seq, attempt, type)."""

    def brief(events: Sequence[Event]) -> list[tuple[int, int, str]]:
        return [(e.seq, e.attempt, type(e).__name__.removesuffix("Event")) for e in events]

    mine, theirs = brief(seen), brief(logged)
    first = next(
        (i for i, pair in enumerate(zip(mine, theirs, strict=False)) if pair[0] != pair[1]),
        min(len(mine), len(theirs)),
    )
    start = max(0, first - 2)
    return (
        f"from event {first}: subscriber {mine[start : first + 4]} "
        f"log {theirs[start : first + 4]} (lengths {len(mine)} / {len(theirs)})"
    )


def _restart_gap(entries: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> float:
    """Seconds between a reset entry and the entry before it (the longest, 0 without)."""
    longest = 0.0
    for (before, _), (entry_id, fields) in itertools.pairwise(entries):
        with contextlib.suppress(ProtocolError):
            if not isinstance(decode_event(fields.get(LOG_EVENT_FIELD.encode())), ResetEvent):
                continue
            gap = int(entry_id.split(b"-")[0]) - int(before.split(b"-")[0])
            longest = max(longest, gap / 1000)
    return longest
