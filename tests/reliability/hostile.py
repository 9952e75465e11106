"""Hostile input: thousands of generated job entries, most of them bad, mixed with valid jobs.

    python -m tests.reliability.hostile --entries 10000

Garbage bytes, msgpack that is not a map, wrong types, missing fields, huge strings, deep
nesting, negative or enormous max_tokens, unknown versions, entries without a ``job`` field,
and protocol-valid jobs with absurd sampling values, plus 5 % valid greedy jobs and a
sprinkle of hostile control messages, all queued on one worker. The protocol's own decoder
is the oracle for each entry: what it refuses must be dead-lettered with its code (and get an
``error`` event when it names a readable request id); what it accepts must end with exactly
one terminal event. The worker must survive all of it with bounded memory, and the valid
jobs must come out with the greedy text of a direct engine run.
"""

from __future__ import annotations

# `worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import worker  # noqa: F401  # isort: skip

import argparse
import asyncio
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack  # type: ignore[import-untyped]
import redis

from protocol.client import Client
from protocol.codec import decode_job, encode_job
from protocol.constants import JOB_FIELD
from protocol.errors import ProtocolError
from protocol.keys import Keys
from protocol.messages import DoneEvent, ErrorEvent, Job
from tests.reliability.common import WorkerProcess, exit_now, make_prompts, reference_texts
from tests.reliability.streams import (
    check_log,
    dead_letters,
    format_table,
    percentile,
    read_log_entries,
)
from worker.local_redis import RedisServer

KIB = 1024
MIB = 1024 * KIB


@dataclass
class Entry:
    """One generated job stream entry and what the decoder says about it."""

    index: int
    kind: str
    fields: dict[str, bytes]  # the stream entry's fields (normally just ``job``)
    rid: str | None  # the request id it names, when it names one
    code: str | None = None  # the decoder's error code; None when the job decodes
    readable: bool = False  # the worker can name the request in an error event
    valid_job: Job | None = None  # a job the decoder accepts
    greedy_prompt: str | None = None  # one of the reference-checked valid jobs
    entry_id: str = ""

    @property
    def data(self) -> bytes | None:
        return self.fields.get(JOB_FIELD)


def _pack(value: Any) -> bytes:
    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


class Generator:
    """Deterministic hostile entries; ``make(i)`` gives entry ``i``."""

    # Relative weights; 1 in ~200 entries is over 1 MiB.
    WEIGHTS: tuple[tuple[str, int], ...] = (
        ("garbage", 28),
        ("not_a_map", 12),
        ("wrong_type", 40),
        ("missing", 16),
        ("huge", 8),
        ("too_large", 1),
        ("deep", 12),
        ("max_tokens", 20),
        ("version", 16),
        ("no_job_field", 6),
        ("bad_request_id", 10),
        ("absurd", 20),
        ("valid", 10),
    )

    def __init__(self, seed: int, pool: list[str], max_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.pool = pool
        self.max_tokens = max_tokens
        kinds, weights = zip(*self.WEIGHTS, strict=True)
        self.kinds: list[str] = list(kinds)
        self.weights: list[int] = list(weights)

    def make(self, index: int) -> Entry:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        rid = f"h-{index:06d}"
        fields = getattr(self, f"_{kind}")(rid)
        entry = Entry(index, kind, fields, rid)
        if kind == "valid":
            entry.greedy_prompt = self.pool[index % len(self.pool)]
        try:
            job = decode_job(entry.data)
        except ProtocolError as exc:
            entry.code = exc.code
            entry.readable = exc.request_id == rid
        else:
            entry.valid_job = job
        if entry.code is None and job.request_id != rid:
            entry.rid = None  # a generated id: nobody can follow it
        return entry

    def _job(self, **fields: Any) -> dict[str, bytes]:
        return {JOB_FIELD: _pack(fields)}

    def _garbage(self, rid: str) -> dict[str, bytes]:
        rng = self.rng
        body = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 512)))
        head = rng.choice([b"", b"\x81", b"\x8f", b"\xdf\xff\xff\xff\xff", b"\xc1", b"\xd9"])
        return {JOB_FIELD: head + body}

    def _not_a_map(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice([[1, "v", rid], 1, "job", None, True, 1.5, b"\x00" * 9, []])
        return {JOB_FIELD: _pack(value)}

    def _wrong_type(self, rid: str) -> dict[str, bytes]:
        bad = self.rng.choice(
            [
                {"prompt": 123},
                {"prompt": b"bytes"},
                {"prompt": ["a"]},
                {"prompt": ""},
                {"prompt": "x", "max_tokens": "5"},
                {"prompt": "x", "max_tokens": 5.0},
                {"prompt": "x", "max_tokens": True},
                {"prompt": "x", "temperature": "hot"},
                {"prompt": "x", "temperature": True},
                {"prompt": "x", "temperature": float("nan")},
                {"prompt": "x", "top_p": float("inf")},
                {"prompt": "x", "top_p": 1.5},
                {"prompt": "x", "min_p": -0.1},
                {"prompt": "x", "repetition_penalty": 0},
                {"prompt": "x", "top_k": -1},
                {"prompt": "x", "seed": -1},
                {"prompt": "x", "seed": -(2**63)},
                {"prompt": "x", "stop": "x"},
                {"prompt": "x", "stop": [1]},
                {"prompt": "x", "stop": [""]},
                {"prompt": "x", "stop_token_ids": [-1]},
                {"prompt": "x", "logprobs": True},
                {"prompt": "x", "logprobs": 21},
                {"prompt": "x", "stream_interval": 0},
                {"prompt": "x", "deadline": "soon"},
                {"prompt": "x", "metadata": [1]},
                {"prompt": "x", "metadata": {"x": float("nan")}},
                {"prompt": "x", "metadata": {"x": b"bin"}},
                {"prompt_token_ids": "abc"},
                {"prompt_token_ids": [1.5]},
                {"prompt_token_ids": []},
                {"prompt_token_ids": [-3]},
                {"messages": "hi"},
                {"messages": []},
                {"messages": [{"role": 1, "content": "x"}]},
                {"messages": [{"role": "", "content": "x"}]},
                {"messages": [{"role": "u" * 65, "content": "x"}]},
                {"messages": ["hi"]},
                {"prompt": "x", "prompt_token_ids": [1]},
                {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            ]
        )
        return self._job(v=1, request_id=rid, **bad)

    def _missing(self, rid: str) -> dict[str, bytes]:
        return self.rng.choice(
            [
                self._job(v=1, request_id=rid),
                self._job(request_id=rid, prompt="x"),
                {JOB_FIELD: _pack({})},
                self._job(v=1),
                self._job(v=1, request_id=rid, messages=[{"role": "user"}]),
                self._job(v=1, request_id=rid, prompt=None, max_tokens=4),
            ]
        )

    def _huge(self, rid: str) -> dict[str, bytes]:
        rng = self.rng
        choice = rng.randrange(6)
        if choice == 0:  # a string over max_str_len
            return self._job(v=1, request_id=rid, prompt="x" * (256 * KIB + 1))
        if choice == 1:  # an array over max_array_len
            return self._job(v=1, request_id=rid, prompt_token_ids=[1] * 32769)
        if choice == 2:  # metadata over 16 KiB
            return self._job(v=1, request_id=rid, prompt="x", metadata={"x": "y" * (17 * KIB)})
        if choice == 3:  # too many stop strings, or one too long
            stop = ["s"] * 17 if rng.random() < 0.5 else ["s" * 257]
            return self._job(v=1, request_id=rid, prompt="x", stop=stop)
        if choice == 4:  # a map with too many keys
            fields = {f"k{i}": i for i in range(300)}
            return self._job(v=1, request_id=rid, prompt="x", **fields)
        # A text prompt the decoder takes (200 KiB) but that is far over the engine's
        # 32768-token prompt cap once tokenized.
        text = " ".join(rng.choice(["ab", "cd", "ef", "gh", "1", "2"]) for _ in range(70_000))
        return self._job(v=1, request_id=rid, prompt=text, max_tokens=4)

    def _too_large(self, rid: str) -> dict[str, bytes]:
        return self._job(v=1, request_id=rid, prompt="x", pad="p" * (MIB + 1))

    def _deep(self, rid: str) -> dict[str, bytes]:
        choice = self.rng.randrange(4)
        if choice == 0:  # metadata deeper than 8
            return self._job(v=1, request_id=rid, prompt="x", metadata=_nested(40))
        if choice == 1:  # deeper than msgpack's own stack
            return {JOB_FIELD: b"\x91" * 200_000 + b"\x00"}
        if choice == 2:  # deep nesting inside a prompt field
            return self._job(v=1, request_id=rid, prompt=_nested(500))
        # Deep nesting in an unknown field: ignored by the protocol, so a valid job.
        return self._job(v=1, request_id=rid, prompt="deep", max_tokens=2, extra=_nested(500))

    def _max_tokens(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice([-1, 0, -(2**63), 32769, 10**6, 2**63 - 1, 2**64 - 1])
        return self._job(v=1, request_id=rid, prompt="x", max_tokens=value)

    def _version(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice([0, 2, 99, -1, "1", 1.0, True, None, 2**64 - 1, [1], {"v": 1}])
        return self._job(v=value, request_id=rid, prompt="x", max_tokens=2)

    def _no_job_field(self, rid: str) -> dict[str, bytes]:
        job = _pack({"v": 1, "request_id": rid, "prompt": "x"})
        return self.rng.choice([{"jobs": job}, {"JOB": job}, {"x": b""}])

    def _bad_request_id(self, rid: str) -> dict[str, bytes]:
        value = self.rng.choice(
            ["", "a b", "{x}", "../../etc/passwd", "x" * 129, "id\n", "é", 42, ["x"], "a*"]
        )
        return self._job(v=1, request_id=value, prompt="x", max_tokens=2)

    def _absurd(self, rid: str) -> dict[str, bytes]:
        """Jobs the protocol accepts, with sampling values nobody would send."""
        absurd = self.rng.choice(
            [
                {"temperature": 1e300},
                {"temperature": 1e-300},
                {"temperature": 1.0, "top_k": 2**62},
                {"temperature": 1.0, "top_p": 0.0},
                {"temperature": 1.0, "min_p": 1.0},
                {"repetition_penalty": 1e-300},
                {"repetition_penalty": 1e300},
                {"presence_penalty": 9e15, "frequency_penalty": -9e15},
                {"frequency_penalty": 1.7e308},
                {"temperature": 1.0, "seed": 2**64 - 1},
                {"temperature": 1.0, "logprobs": 20},
                {"stop_token_ids": [2**62, 0]},
                {"stop": ["x" * 256] * 16},
                {"stream_interval": 2**40},
                {"deadline": 0},
                {"deadline": 1e300},
                {"prompt_token_ids": [10**9]},
                {"prompt_token_ids": [2**63 - 1] * 3},
                {"messages": [{"role": "}}{%", "content": "{{ 7*7 }}"}] * 3},
                {"messages": [{"role": "system", "content": ""}]},
                {"metadata": _nested(7, leaf="x"), "temperature": 0.5},
            ]
        )
        if not any(k in absurd for k in ("prompt_token_ids", "messages")):
            absurd["prompt"] = "absurd " + rid
        return self._job(v=1, request_id=rid, max_tokens=self.rng.randint(1, 4), **absurd)

    def _valid(self, rid: str) -> dict[str, bytes]:
        prompt = self.pool[int(rid.split("-")[1]) % len(self.pool)]
        job = Job(request_id=rid, prompt=prompt, max_tokens=self.max_tokens, temperature=0.0)
        return {JOB_FIELD: encode_job(job)}


@dataclass
class HostileConfig:
    entries: int = 10_000
    seed: int = 7
    max_tokens: int = 8
    max_concurrency: int = 8
    control_messages: int = 0  # hostile control-channel messages; default entries // 50
    batch: int = 250  # entries per XADD pipeline
    directory: Path | None = None
    timeout: float = 1800.0


@dataclass
class HostileResult:
    figures: list[tuple[str, Any]]
    problems: list[str] = field(default_factory=list)
    values: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        return format_table("Hostile input", self.figures)


class _MemorySampler(threading.Thread):
    def __init__(self, process: WorkerProcess, every: float = 0.25) -> None:
        super().__init__(name="rss", daemon=True)
        self.process = process
        self.every = every
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.every):
            self.samples.append((time.monotonic(), self.process.rss()))

    @property
    def peak(self) -> int:
        return max((rss for _, rss in self.samples), default=0)

    @property
    def half_way(self) -> int:
        return self.samples[len(self.samples) // 2][1] if self.samples else 0


def run_hostile(config: HostileConfig) -> HostileResult:
    directory = Path(config.directory or tempfile.mkdtemp(prefix="mlxw-hostile-"))
    directory.mkdir(parents=True, exist_ok=True)
    prefix = "hostile"
    keys = Keys(prefix)
    pool = make_prompts(32, seed=config.seed)
    generator = Generator(config.seed, pool, config.max_tokens)
    entries = [generator.make(index) for index in range(config.entries)]
    references = reference_texts(pool, config.max_tokens)

    server = RedisServer(directory=directory / "redis")
    server.start()
    process = WorkerProcess(
        "hostile-1", server.url, prefix, directory, max_concurrency=config.max_concurrency
    )
    sampler = _MemorySampler(process)
    try:
        process.start().wait_ready()
        rss_ready = process.rss()
        warm = asyncio.run(_warm_up(server.url, prefix, pool, config.max_tokens))
        rss_warm = process.rss()
        sampler.start()
        started = time.monotonic()
        controls = config.control_messages or config.entries // 50
        asyncio.run(_flood(server.url, keys, entries, config.batch, controls, generator.rng))
        client = redis.Redis.from_url(server.url, socket_timeout=30)
        drained = _wait_drained(client, keys, process, config.timeout)
        elapsed = time.monotonic() - started
        sampler.stop.set()
        sampler.join()
        alive = process.running() and process.starts == 1
        ping_ok, memory = asyncio.run(_ping_and_memory(server.url, prefix, process.worker_id))
        rss_end = process.rss()
        result = _verify(entries, references, client, keys)
        redis_memory = int(client.info("memory")["used_memory"])
        client.close()
        stop_code = process.stop()
    finally:
        sampler.stop.set()
        process.kill()
        server.close() if config.directory is None else server.stop()

    crashes = [
        e for e in process.log_events() if e.get("event") in ("job_task_failed", "task_failed")
    ]
    problems = result.problems
    problems += [] if drained else ["the worker did not work off the queue in time"]
    problems += [] if alive else [f"the worker died (rc={process.returncode()})"]
    problems += [] if ping_ok else ["the worker did not answer ping after the flood"]
    problems += [f"worker log: {e}" for e in crashes[:10]]
    problems += [] if stop_code == 0 else [f"the worker did not stop cleanly (rc={stop_code})"]
    values = result.values
    values.update(
        elapsed=elapsed,
        rss_ready=rss_ready,
        rss_warm=rss_warm,
        rss_peak=sampler.peak,
        rss_half_way=sampler.half_way,
        rss_end=rss_end,
        mlx_active=memory.get("mlx_active_memory_bytes"),
        mlx_peak=memory.get("mlx_peak_memory_bytes"),
        warm_latency=warm,
        crashes=len(crashes),
    )
    mib = 1 / MIB
    result.figures = [
        ("entries", config.entries),
        ("bad entries (decoder refuses)", values["bad"]),
        ("protocol-valid jobs with absurd sampling values", values["absurd"]),
        ("valid greedy jobs mixed in", values["valid"]),
        ("hostile control messages", controls),
        ("bad entries dead-lettered with the decoder's code", values["dead_ok"]),
        ("... of which got an `error` event (request id readable)", values["error_events"]),
        ("absurd jobs ended: done / engine error / refused", values["absurd_endings"]),
        ("valid jobs done with the greedy reference text", values["valid_ok"]),
        ("valid job latency p50 / p99, queued behind the flood (s)", values["valid_latency"]),
        (
            "valid job generation time p50 (first event to end): before / during the flood (s)",
            f"{warm:.2f} / {values['valid_run_p50']:.2f}",
        ),
        ("entries per second worked off", round(config.entries / elapsed, 1)),
        ("worker crashes / restarts", f"{values['crashes']} / {process.starts - 1}"),
        (
            "worker RSS ready / warm / half-way / peak / end (MiB)",
            f"{rss_ready * mib:.0f} / {rss_warm * mib:.0f} / {sampler.half_way * mib:.0f} / "
            f"{sampler.peak * mib:.0f} / {rss_end * mib:.0f}",
        ),
        (
            "Redis used memory at the end (MiB; the dead-letter stream keeps every original)",
            f"{redis_memory * mib:.0f}",
        ),
        (
            "MLX active / peak memory at the end (MiB)",
            f"{(values['mlx_active'] or 0) * mib:.0f} / {(values['mlx_peak'] or 0) * mib:.0f}",
        ),
    ]
    result.values["directory"] = str(directory)
    return result


async def _warm_up(url: str, prefix: str, pool: list[str], max_tokens: int) -> float:
    """A few valid jobs before the flood (warm-up); their median generation time."""
    async with Client(url, prefix=prefix, max_connections=64) as client:
        durations = []
        for prompt in pool[:8]:
            done = await client.generate(prompt, max_tokens=max_tokens, temperature=0.0, timeout=60)
            assert isinstance(done, DoneEvent), done
            log = await client.redis.xrange(client.keys.log(done.request_id))
            durations.append(generation_seconds(log))
    return percentile(durations, 50)


async def _flood(
    url: str,
    keys: Keys,
    entries: list[Entry],
    batch: int,
    controls: int,
    rng: random.Random,
) -> None:
    """Queue every entry in order, pipelined; a hostile control message now and then."""
    control_every = max(1, len(entries) // controls) if controls else 0
    async with Client(url, prefix=keys.prefix) as client:
        for start in range(0, len(entries), batch):
            chunk = entries[start : start + batch]
            async with client.redis.pipeline(transaction=False) as pipe:
                for entry in chunk:
                    pipe.xadd(keys.jobs, entry.fields)  # type: ignore[arg-type]
                ids = await pipe.execute()
            for entry, entry_id in zip(chunk, ids, strict=True):
                entry.entry_id = entry_id.decode()
            if control_every:
                for index in range(start, start + len(chunk)):
                    if index % control_every == 0:
                        await client.redis.publish(keys.control, _hostile_control(keys, rng))


def _hostile_control(keys: Keys, rng: random.Random) -> bytes:
    token = f"c{rng.getrandbits(32)}"
    command = rng.choice(
        [
            {"kind": "cache_save", "name": "../../outside"},
            {"kind": "cache_load", "name": "/etc"},
            {"kind": "cache_save", "name": "a/b"},
            {"kind": "nonsense"},
            {"kind": "ping", "reply_to": keys.jobs},  # must not EXPIRE the job stream
            {"kind": "ping", "reply_to": "elsewhere:list"},
            {"kind": "stats", "id": "bad id"},
            {"kind": "abort"},
            {"kind": 5},
        ]
    )
    if rng.random() < 0.2:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 64)))
    message = {"v": 1, "id": token, "reply_to": keys.reply(token), **command}
    return _pack(message)


def _wait_drained(client: redis.Redis, keys: Keys, process: WorkerProcess, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.running():
        pending = client.xpending(keys.jobs, keys.group)["pending"]
        if client.xlen(keys.jobs) == 0 and pending == 0:
            return True
        time.sleep(0.25)
    return False


async def _ping_and_memory(url: str, prefix: str, worker_id: str) -> tuple[bool, dict[str, Any]]:
    async with Client(url, prefix=prefix) as client:
        pings = await client.ping(worker_id=worker_id, timeout=10)
        stats = await client.stats(worker_id=worker_id, timeout=30)
    result = stats[0].result or {}
    return bool(pings and pings[0].ok), dict(result.get("memory", {}))


def _verify(
    entries: list[Entry], references: dict[str, str], client: redis.Redis, keys: Keys
) -> HostileResult:
    problems: list[str] = []
    dead = {row["entry_id"].decode(): row for row in dead_letters(client, keys)}
    counts: Counter[str] = Counter()
    absurd_endings: Counter[str] = Counter()
    latencies: list[float] = []
    run_times: list[float] = []
    for entry in entries:
        where = f"entry {entry.index} ({entry.kind})"
        row = dead.pop(entry.entry_id, None)
        if entry.code is not None:
            counts["bad"] += 1
            if row is None:
                problems.append(f"{where}: not dead-lettered ({entry.code})")
            elif row["code"].decode() != entry.code or not row["message"]:
                problems.append(f"{where}: dead-lettered as {row['code']!r}, not {entry.code}")
            elif row.get("job", b"") != (entry.data or b""):
                problems.append(f"{where}: the dead letter does not hold the original bytes")
            else:
                counts["dead_ok"] += 1
            if entry.readable:
                assert entry.rid is not None
                log = check_log(entry.rid, read_log_entries(client, keys, entry.rid), queued=False)
                terminal = log.terminal
                if log.problems:
                    problems += [f"{where}: {p}" for p in log.problems]
                elif not (
                    isinstance(terminal, ErrorEvent)
                    and terminal.code == "invalid_job"
                    and terminal.message.startswith(f"{entry.code}:")
                ):
                    problems.append(f"{where}: ended with {terminal}")
                else:
                    counts["error_events"] += 1
            continue
        counts["valid" if entry.greedy_prompt else "absurd"] += 1
        if entry.rid is None:  # valid without a request id: it must only be acknowledged
            absurd_endings["unfollowable"] += 1
            continue
        log = check_log(entry.rid, read_log_entries(client, keys, entry.rid), queued=False)
        problems += [f"{where}: {p}" for p in log.problems]
        terminal = log.terminal
        if isinstance(terminal, ErrorEvent) and terminal.code == "invalid_job":
            if row is None or row["code"] != b"invalid_field":  # a check that needs the model
                problems.append(f"{where}: refused by the engine but not dead-lettered")
        elif row is not None:
            problems.append(f"{where}: dead-lettered though it ran ({row['code']!r})")
        if entry.greedy_prompt is not None:
            want = references[entry.greedy_prompt]
            if isinstance(terminal, DoneEvent) and terminal.output_text == want:
                counts["valid_ok"] += 1
                run_times.append(generation_seconds(client.xrange(keys.log(entry.rid))))
                done_ms = int(log_terminal_id(client, keys, entry.rid).split("-")[0])
                latencies.append((done_ms - int(entry.entry_id.split("-")[0])) / 1000)
            else:
                problems.append(f"{where}: {terminal} is not the greedy text {want!r}")
        else:
            name = (
                f"done/{terminal.finish_reason}"
                if isinstance(terminal, DoneEvent)
                else f"error/{terminal.code}"
                if isinstance(terminal, ErrorEvent)
                else "none"
            )
            absurd_endings[name] += 1
    problems += [f"unexpected dead letter {entry_id}: {row}" for entry_id, row in dead.items()]
    # Hostile control commands named these as reply_to: the worker must not have touched them.
    if client.ttl(keys.jobs) != -1:
        problems.append(f"the job stream got a TTL ({client.ttl(keys.jobs)} s)")
    if client.exists("elsewhere:list"):
        problems.append("a control command made the worker write a key outside its prefix")
    endings = ", ".join(f"{name} {count}" for name, count in sorted(absurd_endings.items()))
    values: dict[str, Any] = dict(counts)
    for name in ("bad", "absurd", "valid", "dead_ok", "error_events", "valid_ok"):
        values.setdefault(name, 0)
    values["absurd_endings"] = endings
    values["valid_run_p50"] = percentile(run_times, 50)
    values["valid_latency"] = (
        f"{percentile(latencies, 50):.2f} / {percentile(latencies, 99):.2f}" if latencies else "-"
    )
    return HostileResult(figures=[], problems=problems, values=values)


def generation_seconds(log: Any) -> float:
    """From a request's first worker event to its terminal event (log entry ids: Redis'
    clock): the time the worker spent generating, without the wait in the queue (which
    ``usage.duration_ms`` includes, counting from the job's arrival)."""
    stamps = [int(entry_id.split(b"-")[0]) for entry_id, fields in log if fields[b"seq"] != b"0"]
    return (stamps[-1] - stamps[0]) / 1000


def log_terminal_id(client: redis.Redis, keys: Keys, request_id: str) -> str:
    """The stream id (Redis clock, ms) of the request's last log entry."""
    newest = client.xrevrange(keys.log(request_id), "+", "-", count=1)
    return str(newest[0][0].decode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=HostileConfig.entries)
    parser.add_argument("--seed", type=int, default=HostileConfig.seed)
    parser.add_argument("--dir", type=Path, default=None, help="keep logs here")
    args = parser.parse_args(argv)
    result = run_hostile(HostileConfig(entries=args.entries, seed=args.seed, directory=args.dir))
    print(result.table())
    print(f"\nlogs: {result.values['directory']}")
    for problem in result.problems[:50]:
        print("PROBLEM:", problem)
    return 1 if result.problems else 0


if __name__ == "__main__":
    exit_now(main())
