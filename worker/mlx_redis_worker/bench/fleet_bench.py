"""``mlx-worker bench fleet``: a simulated fleet on one Redis server or a local Cluster.

N workers run the real daemon (consumer group, reclaim, heartbeats, registry, publisher,
control channel) over ``SimulatedEngine`` (bench/fleet_engine.py): lanes in ``--hosts``
processes (bench/fleet_host.py says why). A producer submits ``--requests`` jobs at ``--rate``
through the real client; a subscriber follows each through the real client and checks its
stream whole and in order (seq gapless, one terminal event, the known words of its tokens).
Then, with the fleet idle, the control plane at that size: ``ctl stats``, ``ctl ping``, the
models catalogue (what ``mlx-worker models`` reads), a gateway's ``/v1/models`` and
``/status.json``; and what the idle fleet's upkeep (heartbeats, activity, registry, reclaims,
blocked reads) costs Redis. Redis CPU is ``INFO CPU`` (user + sys) of every node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import redis

from mlx_redis_protocol.catalogue import fleet_models
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, Event, ResetEvent
from mlx_redis_worker.bench.fleet_spec import TICKS_PER_SECOND, HostSpec, expected_text, ticks
from mlx_redis_worker.local_redis import LocalCluster, RedisServer, free_port

T = TypeVar("T")
MODEL = "sim"
READY_TIMEOUT = 600.0
CONTROL_TIMEOUT = 30.0
WORKERS_PER_HOST = 250


@dataclass(frozen=True, slots=True)
class FleetLoad:
    workers: int
    hosts: int = 2
    max_concurrency: int = 8
    step_ms: float = 50.0
    requests: int = 200
    max_tokens: int = 16
    rate: float = 50.0  # submits per second; 0: all at once
    idle_seconds: float = 5.0
    gateway: bool = True
    read_block_ms: int = 1000  # the workers' XREADGROUP BLOCK (their --read-block-ms)


@dataclass(slots=True)
class Followed:
    """What a subscriber saw of one request."""

    submitted: float
    events: list[Event] = field(default_factory=list)
    received: list[float] = field(default_factory=list)  # when each event arrived
    failure: str | None = None


@dataclass(frozen=True, slots=True)
class FleetResult:
    topology: str
    workers: int
    requests: int
    ended_once: int
    whole: int
    problems: tuple[str, ...]
    pending_after: int  # jobs still pending in the model's group once every stream ended
    tokens: int
    seconds: float
    redis_cpu_seconds: float
    step_to_subscriber_ms: tuple[float, float]  # p50, p99
    first_delta_p99_ms: float
    idle_redis_cpu_percent: float
    control_ms: dict[str, float]
    control_notes: dict[str, str]

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def redis_us_per_token(self) -> float:
        return 1e6 * self.redis_cpu_seconds / self.tokens if self.tokens else 0.0


# -- Redis -------------------------------------------------------------------------------------


@contextlib.contextmanager
def topology(kind: str, masters: int) -> Iterator[tuple[str, str, list[str]]]:
    """(URL, the workers' topology setting, every node's URL) of a private Redis."""
    # Some 7 connections per worker: past Redis' default 10,000 clients at 1,500 workers.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args = ["--maxclients", str(max(hard - 32, 1000))]
    if kind == "server":
        server = RedisServer(extra_args=args)
        server.start()
        try:
            yield server.url, "standalone", [server.url]
        finally:
            server.close()
        return
    cluster = LocalCluster(masters=masters, extra_args=args)
    cluster.start()
    try:
        yield cluster.url, "cluster", cluster.urls
    finally:
        cluster.close()


def redis_cpu_seconds(nodes: Sequence[str]) -> float:
    total = 0.0
    for url in nodes:
        client = redis.Redis.from_url(url, socket_timeout=30)
        try:
            info = client.info("cpu")
            total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        finally:
            client.close()
    return total


# -- the fleet's processes -----------------------------------------------------------------------


def start_hosts(
    url: str, kind: str, prefix: str, load: FleetLoad, epoch: float, logs: Path
) -> list[subprocess.Popen[str]]:
    # At least one process per WORKERS_PER_HOST: each worker holds some 7 connections, and a
    # process that imported mlx-lm may open at most 4096 files.
    hosts = max(1, min(max(load.hosts, -(-load.workers // WORKERS_PER_HOST)), load.workers))
    per_host = [
        load.workers // hosts + (1 if i < load.workers % hosts else 0) for i in range(hosts)
    ]
    processes, first = [], 0
    for index, count in enumerate(per_host):
        spec = HostSpec(
            redis_url=url,
            topology=kind,
            prefix=prefix,
            model=MODEL,
            id_prefix="sim-",
            first=first,
            count=count,
            max_concurrency=load.max_concurrency,
            step_seconds=load.step_ms / 1000,
            epoch=epoch,
            read_block_ms=load.read_block_ms,
        )
        first += count
        with (logs / f"host-{index}.log").open("w") as stderr:  # the child keeps its copy
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "mlx_redis_worker.bench.fleet_host", spec.encode()],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
            )
    for index, process in enumerate(processes):
        assert process.stdout is not None
        line = process.stdout.readline().strip()  # "ready N" or "failed ..."
        if not line.startswith("ready"):
            tail = (logs / f"host-{index}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"fleet host {index}: {line or 'exited'}\n{tail}")
    return processes


def stop_hosts(processes: Sequence[subprocess.Popen[str]]) -> list[str]:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    lines = []
    for process in processes:
        try:
            out, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        lines.append(out.strip().splitlines()[-1] if out.strip() else f"rc={process.returncode}")
    return lines


@contextlib.contextmanager
def gateway(url: str, prefix: str, logs: Path) -> Iterator[str]:
    """A gateway process on a free port; its base URL."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "mlx_redis_protocol.cli",
        "--log-level",
        "WARNING",
        "gateway",
        "--listen",
        f"127.0.0.1:{port}",
        "--redis-url",
        url,
        "--prefix",
        prefix,
    ]
    with (logs / "gateway.log").open("w") as log:  # the child keeps its copy
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"the gateway exited: {(logs / 'gateway.log').read_text()[-2000:]}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{base}/health", timeout=2) as answer,
            ):
                if answer.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not answer /health")
            time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        if process.poll() is None:
            process.kill()


# -- the load --------------------------------------------------------------------------------------


async def follow(client: Client, load: FleetLoad, index: int) -> tuple[str, Followed]:
    followed = Followed(submitted=time.time())
    try:
        request_id = await client.submit(
            f"request {index} of the fleet",
            model=MODEL,
            max_tokens=load.max_tokens,
            temperature=0.0,
        )
    except Exception as exc:  # counted, not raised: the table says how many failed
        followed.failure = f"submit: {type(exc).__name__}: {exc}"
        return f"unsubmitted-{index}", followed
    try:
        async with aclosing(client.stream(request_id, timeout=120)) as events:
            async for event in events:
                followed.received.append(time.time())
                followed.events.append(event)
    except Exception as exc:
        followed.failure = f"stream: {type(exc).__name__}: {exc}"
    return request_id, followed


def check_whole(request_id: str, followed: Followed, max_tokens: int) -> str | None:
    """Why the stream is not whole and in order; None when it is."""
    if followed.failure is not None:
        return f"{request_id}: {followed.failure}"
    body = [e for e in followed.events if e.seq > 0]
    seqs = [e.seq for e in body]
    if seqs != list(range(1, len(body) + 1)):
        return f"{request_id}: seqs {seqs[:20]}"
    terminals = [e for e in body if e.terminal]
    if len(terminals) != 1 or body[-1] is not terminals[0]:
        return f"{request_id}: {len(terminals)} terminal events"
    done = terminals[0]
    if not isinstance(done, DoneEvent) or done.finish_reason != "length":
        return f"{request_id}: ended with {done}"
    last_reset = max((i for i, e in enumerate(body) if isinstance(e, ResetEvent)), default=-1)
    text = "".join(e.new_text for e in body[last_reset + 1 :] if isinstance(e, DeltaEvent))
    if text != expected_text(max_tokens) or done.output_text != text:
        return f"{request_id}: text {text[:60]!r}"
    return None


def percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def run_load(client: Client, load: FleetLoad) -> dict[str, Followed]:
    tasks = []
    for index in range(load.requests):
        tasks.append(asyncio.create_task(follow(client, load, index)))
        if load.rate > 0:
            await asyncio.sleep(1 / load.rate)
    return dict(await asyncio.gather(*tasks))


async def settled_pending(client: Client, patience: float = 30.0) -> int:
    """The model group's pending jobs once acknowledgements settle: a worker acknowledges a
    job just after its terminal event is in the log, so a subscriber can see the end first."""
    stream = client.keys.model_stream(MODEL)
    deadline = time.monotonic() + patience
    while True:
        pending = int((await client.redis.xpending(stream.stream, stream.group))["pending"])
        if pending == 0 or time.monotonic() > deadline:
            return pending
        await asyncio.sleep(0.1)


# -- the control plane ---------------------------------------------------------------------------


async def timed(action: Callable[[], Awaitable[T]], repeat: int = 3) -> tuple[float, T]:
    """The median wall time of ``repeat`` calls in ms, and the last call's result."""
    times, result = [], None
    for _ in range(repeat):
        began = time.perf_counter()
        result = await action()
        times.append(1000 * (time.perf_counter() - began))
    assert result is not None
    return statistics.median(times), result


def http_get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return len(answer.read())


async def control_plane(
    client: Client, workers: int, base: str | None
) -> tuple[dict[str, float], dict[str, str]]:
    ms: dict[str, float] = {}
    notes: dict[str, str] = {}
    ms["ctl stats"], stats = await timed(lambda: client.stats(timeout=CONTROL_TIMEOUT))
    notes["ctl stats"] = f"{len(stats)}/{workers} replies"
    ms["ctl ping"], pings = await timed(lambda: client.ping(timeout=CONTROL_TIMEOUT))
    notes["ctl ping"] = f"{len(pings)}/{workers} replies"
    ms["models"], fleet = await timed(lambda: fleet_models(client.redis, client.keys))
    served = fleet.model(MODEL)
    notes["models"] = f"{len(served.workers) if served else 0} workers of {MODEL}"
    if base is not None:
        ms["/v1/models"], size = await timed(
            lambda: asyncio.to_thread(http_get, f"{base}/v1/models")
        )
        notes["/v1/models"] = f"{size} bytes"
        ms["/status.json"], size = await timed(
            lambda: asyncio.to_thread(http_get, f"{base}/status.json")
        )
        notes["/status.json"] = f"{size} bytes"
    return ms, notes


# -- one measurement -------------------------------------------------------------------------------


async def measure(
    url: str, kind: str, nodes: list[str], label: str, load: FleetLoad, logs: Path
) -> FleetResult:
    prefix = f"fleet{uuid.uuid4().hex[:6]}"
    epoch = time.time()
    hosts = await asyncio.to_thread(start_hosts, url, kind, prefix, load, epoch, logs)
    try:
        async with Client(url, prefix=prefix, topology=kind, max_in_flight=256) as client:
            idle_before = await asyncio.to_thread(redis_cpu_seconds, nodes)
            await asyncio.sleep(load.idle_seconds)
            idle_cpu = await asyncio.to_thread(redis_cpu_seconds, nodes) - idle_before
            with gateway(url, prefix, logs) if load.gateway else contextlib.nullcontext() as base:
                control_ms, notes = await control_plane(client, load.workers, base)
            cpu_before = await asyncio.to_thread(redis_cpu_seconds, nodes)
            began = time.time()
            followed = await run_load(client, load)
            cpu = await asyncio.to_thread(redis_cpu_seconds, nodes) - cpu_before
            pending = await settled_pending(client)
    finally:
        host_lines = await asyncio.to_thread(stop_hosts, hosts)
    problems = [p for rid, f in followed.items() if (p := check_whole(rid, f, load.max_tokens))]
    problems += [
        f"host: {line}"
        for line in host_lines
        if not line.startswith("stopped") or " failed 0" not in line
    ]
    ended_once = sum(
        1 for f in followed.values() if f.failure is None and sum(e.terminal for e in f.events) == 1
    )
    tokens, latencies, firsts, last = 0, [], [], began
    for f in followed.values():
        deltas = [
            (e, at) for e, at in zip(f.events, f.received, strict=True) if isinstance(e, DeltaEvent)
        ]
        for event, at in deltas:
            tokens += len(event.new_token_ids)
            now = ticks(epoch, at)
            latencies += [1000 * (now - tick) / TICKS_PER_SECOND for tick in event.new_token_ids]
            last = max(last, at)
        if deltas:
            firsts.append(1000 * (deltas[0][1] - f.submitted))
    return FleetResult(
        topology=label,
        workers=load.workers,
        requests=load.requests,
        ended_once=ended_once,
        whole=load.requests - len([p for p in problems if not p.startswith("host:")]),
        problems=tuple(problems),
        pending_after=pending,
        tokens=tokens,
        seconds=last - began,
        redis_cpu_seconds=cpu,
        step_to_subscriber_ms=(percentile(latencies, 0.5), percentile(latencies, 0.99)),
        first_delta_p99_ms=percentile(firsts, 0.99),
        idle_redis_cpu_percent=100 * idle_cpu / load.idle_seconds,
        control_ms=control_ms,
        control_notes=notes,
    )


def measure_fleet(kind: str, masters: int, load: FleetLoad, logs: Path) -> FleetResult:
    """One fleet on a fresh private Redis of ``kind`` ("server" or "cluster")."""
    label = "server" if kind == "server" else f"cluster x{masters}"
    with topology(kind, masters) as (url, setting, nodes):
        return asyncio.run(measure(url, setting, nodes, label, load, logs))


# -- the command -----------------------------------------------------------------------------------


CONTROL_COLUMNS = ("ctl stats", "ctl ping", "models", "/v1/models", "/status.json")


def table(results: Sequence[FleetResult]) -> str:
    head = (
        "| topology | workers | requests ended once / whole | tokens/s | Redis CPU µs/token "
        "| step→subscriber p50 / p99 ms | submit→first delta p99 ms | idle fleet Redis CPU % | "
        + " | ".join(f"{c} ms" for c in CONTROL_COLUMNS)
        + " |"
    )
    rows = [head, "|" + "---|" * (8 + len(CONTROL_COLUMNS))]
    for r in results:
        control = " | ".join(
            f"{r.control_ms[c]:.0f} ({r.control_notes[c]})" if c in r.control_ms else "-"
            for c in CONTROL_COLUMNS
        )
        rows.append(
            f"| {r.topology} | {r.workers} | {r.ended_once}/{r.requests} / {r.whole} "
            f"| {r.tokens_per_second:.0f} | {r.redis_us_per_token:.1f} "
            f"| {r.step_to_subscriber_ms[0]:.1f} / {r.step_to_subscriber_ms[1]:.1f} "
            f"| {r.first_delta_p99_ms:.0f} | {r.idle_redis_cpu_percent:.1f} | {control} |"
        )
    return "\n".join(rows)


def run_fleet_bench(args: argparse.Namespace) -> int:
    logs = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    results = []
    for workers in (int(n) for n in str(args.workers).split(",")):
        load = FleetLoad(
            workers=workers,
            hosts=args.hosts,
            max_concurrency=args.max_concurrency,
            step_ms=args.step_ms,
            requests=args.requests,
            max_tokens=args.max_tokens,
            rate=args.rate,
            idle_seconds=args.idle_seconds,
            gateway=not args.no_gateway,
            read_block_ms=args.read_block_ms,
        )
        for kind in str(args.topology).split(","):
            for masters in (
                [int(m) for m in str(args.masters).split(",")] if kind == "cluster" else [0]
            ):
                results.append(measure_fleet(kind, masters, load, logs))
                print(table(results[-1:]).splitlines()[-1], flush=True)
    print(
        f"\nsimulated fleet: at least {args.hosts} host processes, one per "
        f"{WORKERS_PER_HOST} workers, "
        f"--max-concurrency {args.max_concurrency}, "
        f"step {args.step_ms:g} ms, {args.requests} requests of {args.max_tokens} tokens at "
        f"{args.rate:g}/s, stream interval 1; load average {os.getloadavg()[0]:.2f} "
        f"(on {os.cpu_count()} CPUs); logs in {logs}\n"
    )
    print(table(results))
    failed = [r for r in results if r.problems]
    for result in failed:
        print(f"\n{result.topology} x{result.workers}: {len(result.problems)} problems")
        for problem in result.problems[:10]:
            print(f"  {problem}")
    return 1 if failed else 0
