"""``mlx-worker bench fleet``: a simulated fleet on one Redis server or a local Cluster.

N workers run the real daemon (consumer group, reclaim, heartbeats, registry, publisher,
control channel) over ``SimulatedEngine`` (bench/fleet_engine.py): lanes in ``--hosts``
processes (bench/fleet_host.py says why). First, with the fleet idle: what its upkeep
(heartbeats, activity, registry, reclaims, blocked reads) costs Redis, the control plane at
that size (``ctl stats``, ``ctl ping``, the models catalogue as ``mlx-worker models`` reads it,
a gateway's ``/v1/models`` and ``/status.json``) and, when asked, a reclaim sweep
(bench/fleet_reclaim.py). Then the load (bench/fleet_load.py, in ``--clients`` processes):
``--requests`` jobs or ``--duration`` seconds at ``--rate``, or with ``--saturate`` the fleet's
saturation (a closed loop with more requests in flight than it has slots) and then an open loop
at ``--load-fraction`` of it; every stream checked whole and in order. Redis CPU is
``INFO CPU`` (user + sys) of every node; each load also says where the CPU went (each node,
the host processes, the load generators, the bench itself) and which commands Redis ran per
delivered token (``INFO commandstats``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.crc import key_slot

from mlx_redis_protocol.catalogue import fleet_models
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.connection import as_text
from mlx_redis_worker.bench.fleet_load import LoadSpec, LoadSummary, percentile, run_loads
from mlx_redis_worker.bench.fleet_reclaim import ReclaimResult, reclaim_sweep
from mlx_redis_worker.bench.fleet_spec import LEASE_SECONDS, HostSpec
from mlx_redis_worker.local_redis import LocalCluster, RedisServer, free_port

T = TypeVar("T")
MODEL = "sim"
READY_TIMEOUT = 600.0
CONTROL_TIMEOUT = 30.0
WORKERS_PER_HOST = 250
CONNECTIONS_PER_WORKER = 8  # some 7 (fleet_host.py), and a margin
CONNECTIONS_PER_CLIENT = 300  # a load generator's commands and subscriptions, at most


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
    read_block_ms: int = 0  # the workers' XREADGROUP BLOCK (0: the worker's default)
    duration: float = 0.0  # > 0: submit at ``rate`` for this long instead of ``requests``
    saturate: bool = False  # measure saturation first, then load at ``load_fraction`` of it
    saturate_seconds: float = 20.0
    saturate_in_flight: int = 0  # 0: 1.5x the fleet's slots
    load_fraction: float = 0.7
    reclaim_pending: int = 0  # > 0: time a reclaim sweep of this many orphaned jobs
    clients: int = 1  # load generator processes (1: in the bench's own process)

    @property
    def in_flight(self) -> int:
        return self.saturate_in_flight or -(-3 * self.workers * self.max_concurrency // 2)


@dataclass(frozen=True, slots=True)
class PhaseResult:
    """One load on the fleet: what its subscribers saw, and what it cost whom."""

    label: str
    summary: LoadSummary
    tokens_per_second: float
    node_cpu_seconds: tuple[float, ...]  # each Redis node's, in the fleet's node order
    seconds: float = 0.0  # the load's wall time, ramp and drain included
    # CPU seconds of the host processes, the load generators and the bench's own process
    # (its in-process generator taken out); a group missing where it cannot be read.
    process_cpu_seconds: dict[str, float] = field(default_factory=dict)
    commands: dict[str, int] = field(default_factory=dict)  # calls over the load, all nodes

    @property
    def redis_cpu_seconds(self) -> float:
        return sum(self.node_cpu_seconds)

    @property
    def redis_us_per_token(self) -> float:
        tokens = self.summary.tokens
        return 1e6 * self.redis_cpu_seconds / tokens if tokens else 0.0

    def cores(self, cpu_seconds: float) -> float:
        """CPU seconds over the load as cores used on average."""
        return cpu_seconds / self.seconds if self.seconds > 0 else 0.0

    def calls_per_token(self) -> dict[str, float]:
        """Redis commands (scripts' calls included) per delivered token, most first."""
        tokens = self.summary.tokens or 1
        ranked = sorted(self.commands.items(), key=lambda item: -item[1])
        return {name: n / tokens for name, n in ranked}

    @property
    def step_to_subscriber_ms(self) -> tuple[float, float]:
        steps = self.summary.step_to_subscriber
        return percentile(steps, 0.5, 0.1), percentile(steps, 0.99, 0.1)

    @property
    def first_delta_p99_ms(self) -> float:
        return percentile(self.summary.first_delta, 0.99, 1.0)


@dataclass(frozen=True, slots=True)
class FleetResult:
    topology: str
    masters: int  # 0: one server
    workers: int
    phases: tuple[PhaseResult, ...]
    problems: tuple[str, ...]
    pending_after: int  # jobs still pending in the model's group once every stream ended
    idle_redis_cpu_percent: float
    control_ms: dict[str, float]
    control_notes: dict[str, str]
    reclaim: ReclaimResult | None = None
    # Commands per idle worker per second, by command (INFO commandstats; the bench's own
    # INFO reads included, a few per sample).
    idle_commands: dict[str, float] = field(default_factory=dict)
    stream_node: int | None = None  # the node holding the model's job stream (a Cluster's)


# -- Redis -------------------------------------------------------------------------------------


@contextlib.contextmanager
def topology(kind: str, masters: int) -> Iterator[tuple[str, str, list[str], list[int]]]:
    """(URL, the workers' topology setting, every node's URL, their pids) of a private Redis."""
    # Some 7 connections per worker: past Redis' default 10,000 clients at 1,500 workers.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    args = ["--maxclients", str(max(hard - 32, 1000))]
    if kind == "server":
        server = RedisServer(extra_args=args)
        server.start()
        try:
            yield server.url, "standalone", [server.url], [server.pid or 0]
        finally:
            server.close()
        return
    cluster = LocalCluster(masters=masters, extra_args=args)
    cluster.start()
    try:
        yield cluster.url, "cluster", cluster.urls, [node.pid or 0 for node in cluster.nodes]
    finally:
        cluster.close()


def check_connection_room(nodes: Sequence[str], load: FleetLoad) -> None:
    """Refuse, in one line, a fleet that the nodes' ``maxclients`` (the open-files limit the
    bench could raise, less 32) cannot seat: all of it may connect to one node. Past it,
    workers would fail one by one as Redis refused them, minutes into a run."""
    need = CONNECTIONS_PER_WORKER * load.workers + CONNECTIONS_PER_CLIENT * max(load.clients, 1)
    for url in nodes:
        with redis.Redis.from_url(url, socket_timeout=30) as client:
            room = int(as_text(client.config_get("maxclients")["maxclients"]))
        if room < need:
            raise RuntimeError(
                f"Redis takes {room} clients, {load.workers} workers and {load.clients} load "
                f"processes may need {need}: raise the hard open-files limit (ulimit -Hn) "
                "of the shell that starts the bench"
            )


def redis_command_calls(nodes: Sequence[str]) -> Counter[str]:
    """``INFO commandstats`` calls by command, summed over every node."""
    calls: Counter[str] = Counter()
    for url in nodes:
        with redis.Redis.from_url(url, socket_timeout=30) as client:
            for name, stats in client.info("commandstats").items():
                calls[name.removeprefix("cmdstat_")] += int(stats["calls"])
    return calls


def redis_node_cpu_seconds(nodes: Sequence[str]) -> list[float]:
    """Each node's ``INFO CPU`` user + sys so far."""
    seconds = []
    for url in nodes:
        with redis.Redis.from_url(url, socket_timeout=30) as client:
            info = client.info("cpu")
            seconds.append(float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
    return seconds


def redis_cpu_seconds(nodes: Sequence[str]) -> float:
    return sum(redis_node_cpu_seconds(nodes))


def node_of_key(nodes: Sequence[str], key: str) -> int | None:
    """Which of a Cluster's ``nodes`` serves ``key``'s slot (from each node's own line of
    ``CLUSTER NODES``); None on one server."""
    slot = key_slot(key.encode())
    for index, url in enumerate(nodes):
        with redis.Redis.from_url(url, socket_timeout=30) as client:
            if not client.info("cluster").get("cluster_enabled"):
                return None
            lines = as_text(client.execute_command("CLUSTER", "NODES")).splitlines()
        mine = next(line.split() for line in lines if "myself" in line.split()[2])
        for served in mine[8:]:
            if served.startswith("["):  # a slot being migrated
                continue
            first, _, last = served.partition("-")
            if int(first) <= slot <= int(last or first):
                return index
    return None


@dataclass(frozen=True, slots=True)
class CostSample:
    """What the fleet's parts had spent at one moment: a load's cost is two samples apart."""

    wall: float
    nodes: list[float]
    commands: Counter[str]
    hosts: float | None
    bench: float

    @classmethod
    def take(cls, nodes: Sequence[str], hosts: Sequence[int]) -> CostSample:
        return cls(
            wall=time.monotonic(),
            nodes=redis_node_cpu_seconds(nodes),
            commands=redis_command_calls(nodes),
            hosts=process_cpu_seconds(hosts),
            bench=time.process_time(),
        )


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
    try:
        for index, process in enumerate(processes):
            assert process.stdout is not None
            line = process.stdout.readline().strip()  # "ready N" or "failed ..."
            if not line.startswith("ready"):
                tail = (logs / f"host-{index}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"fleet host {index}: {line or 'exited'}\n{tail}")
    except BaseException:
        # The others would serve on (retrying a Redis that is gone) after the bench exits.
        stop_hosts(processes)
        raise
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


def load_spec(url: str, kind: str, prefix: str, epoch: float, load: FleetLoad) -> LoadSpec:
    return LoadSpec(
        redis_url=url,
        topology=kind,
        prefix=prefix,
        model=MODEL,
        epoch=epoch,
        max_tokens=load.max_tokens,
        rate=load.rate,
        requests=0 if load.duration > 0 else load.requests,
        duration=load.duration,
    )


async def phase(
    spec: LoadSpec,
    label: str,
    nodes: Sequence[str],
    clients: int,
    hosts: Sequence[int],
    steady_from: float = 0.0,
) -> PhaseResult:
    """``spec`` on the fleet. tokens/s: from the first submit to the last delta, or with
    ``steady_from`` (a fraction of ``spec.duration``) over the rest of the submitting only,
    leaving out the ramp up and the drain (a timed load, a saturation). CPU and commands:
    over the whole load, from when every generator is connected."""
    started: list[tuple[CostSample, float]] = []

    async def on_start() -> None:
        sample = await asyncio.to_thread(CostSample.take, nodes, hosts)
        started.append((sample, time.time() - spec.epoch))

    summary = await run_loads(spec, clients, on_start)
    after = await asyncio.to_thread(CostSample.take, nodes, hosts)
    ((before, began),) = started
    if steady_from > 0:
        start = began + steady_from * spec.duration
        tokens_per_second = summary.tokens_per_second(start, began + spec.duration)
    else:
        _, last = summary.delivery_span()
        tokens_per_second = summary.tokens / (last - began) if last > began else 0.0
    bench = after.bench - before.bench
    processes = {
        # One generator runs in the bench's process: its CPU is the bench's, less the rest.
        "clients": summary.cpu_seconds,
        "bench": max(bench - summary.cpu_seconds, 0.0) if clients <= 1 else bench,
    }
    if after.hosts is not None and before.hosts is not None:
        processes = {"hosts": after.hosts - before.hosts, **processes}
    return PhaseResult(
        label,
        summary,
        tokens_per_second,
        node_cpu_seconds=tuple(a - b for a, b in zip(after.nodes, before.nodes, strict=True)),
        seconds=after.wall - before.wall,
        process_cpu_seconds=processes,
        commands=dict(after.commands - before.commands),
    )


async def loads(
    url: str,
    kind: str,
    prefix: str,
    epoch: float,
    load: FleetLoad,
    nodes: Sequence[str],
    hosts: Sequence[int],
) -> list[PhaseResult]:
    spec = load_spec(url, kind, prefix, epoch, load)
    if not load.saturate:
        if not spec.requests and not spec.duration:
            return []
        offered = f"{spec.rate:g}/s" + (f" for {spec.duration:g} s" if spec.duration else "")
        steady = 0.25 if spec.duration else 0.0
        return [await phase(spec, f"offered {offered}", nodes, load.clients, hosts, steady)]
    # More in flight than the fleet has slots: jobs wait in the stream, every slot stays busy
    # unless Redis or the machine caps what is delivered. Steady state: the last 3/4.
    saturation = await phase(
        replace(spec, name="saturate", in_flight=load.in_flight, duration=load.saturate_seconds),
        f"saturation ({load.in_flight} in flight)",
        nodes,
        load.clients,
        hosts,
        steady_from=0.25,
    )
    rate = load.load_fraction * saturation.tokens_per_second / load.max_tokens
    if rate <= 0:
        return [saturation]
    at = replace(spec, name="at-fraction", rate=rate)
    label = f"{100 * load.load_fraction:.0f}% of saturation ({rate:.1f}/s)"
    steady = 0.25 if at.duration else 0.0
    return [saturation, await phase(at, label, nodes, load.clients, hosts, steady)]


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


def process_cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU of these processes so far (Linux /proc; None elsewhere)."""
    total = 0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    except OSError:
        return None
    return total / os.sysconf("SC_CLK_TCK")


async def broadcast(
    action: Callable[[], Awaitable[list[Any]]], workers: int, hosts: Sequence[int], idle_rate: float
) -> tuple[float, str]:
    """A control broadcast's median ms, and a note: replies of ``workers``, and the CPU one
    reply cost the workers' host processes (their idle upkeep, ``idle_rate`` CPU seconds a
    second, taken out) and the sender, in ms: figures a loaded machine's wall time hides."""
    host_before, sender_before = process_cpu_seconds(hosts), time.process_time()
    began = time.perf_counter()
    ms, replies = await timed(action)
    wall = time.perf_counter() - began
    sender = time.process_time() - sender_before
    host_after = process_cpu_seconds(hosts)
    note = f"{len(replies)}/{workers} replies"
    count = 3 * max(len(replies), 1)
    if host_before is not None and host_after is not None:
        host = max(host_after - host_before - idle_rate * wall, 0.0)
        note += f"; CPU a reply, ms: hosts {1000 * host / count:.2f}"
        note += f", sender {1000 * sender / count:.2f}"
    return ms, note


async def control_plane(
    client: Client,
    workers: int,
    base: str | None,
    hosts: Sequence[int] = (),
    idle_rate: float = 0.0,
) -> tuple[dict[str, float], dict[str, str]]:
    ms: dict[str, float] = {}
    notes: dict[str, str] = {}
    ms["ctl stats"], notes["ctl stats"] = await broadcast(
        lambda: client.stats(timeout=CONTROL_TIMEOUT), workers, hosts, idle_rate
    )
    ms["ctl ping"], notes["ctl ping"] = await broadcast(
        lambda: client.ping(timeout=CONTROL_TIMEOUT), workers, hosts, idle_rate
    )
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
    await asyncio.to_thread(check_connection_room, nodes, load)
    hosts = await asyncio.to_thread(start_hosts, url, kind, prefix, load, epoch, logs)
    reclaim = None
    try:
        async with Client(url, prefix=prefix, topology=kind, max_in_flight=256) as client:
            pids = [host.pid for host in hosts]
            idle_before = await asyncio.to_thread(redis_cpu_seconds, nodes)
            calls_before = await asyncio.to_thread(redis_command_calls, nodes)
            hosts_before = process_cpu_seconds(pids)
            await asyncio.sleep(load.idle_seconds)
            hosts_after = process_cpu_seconds(pids)
            idle_cpu = await asyncio.to_thread(redis_cpu_seconds, nodes) - idle_before
            calls = await asyncio.to_thread(redis_command_calls, nodes) - calls_before
            with gateway(url, prefix, logs) if load.gateway else contextlib.nullcontext() as base:
                # The hosts' own idle upkeep, taken out of what a broadcast cost them.
                idle_rate = (
                    (hosts_after - hosts_before) / load.idle_seconds
                    if hosts_after is not None and hosts_before is not None
                    else 0.0
                )
                control_ms, notes = await control_plane(client, load.workers, base, pids, idle_rate)
            if load.reclaim_pending > 0:
                lease_ms = int(1000 * LEASE_SECONDS)
                reclaim = await reclaim_sweep(
                    client, nodes, load.reclaim_pending, load.max_concurrency, lease_ms
                )
            phases = await loads(url, kind, prefix, epoch, load, nodes, pids)
            stream_node = await asyncio.to_thread(
                node_of_key, nodes, client.keys.model_stream(MODEL).stream
            )
            pending = await settled_pending(client)
    finally:
        host_lines = await asyncio.to_thread(stop_hosts, hosts)
    problems = [p for ph in phases for p in ph.summary.problems]
    problems += [
        f"host: {line}"
        for line in host_lines
        if not line.startswith("stopped") or " failed 0" not in line
    ]
    return FleetResult(
        topology=label,
        masters=0 if kind == "standalone" else len(nodes),
        workers=load.workers,
        phases=tuple(phases),
        problems=tuple(problems),
        pending_after=pending,
        idle_redis_cpu_percent=100 * idle_cpu / load.idle_seconds,
        control_ms=control_ms,
        control_notes=notes,
        reclaim=reclaim,
        idle_commands={
            name: n / load.workers / load.idle_seconds for name, n in calls.most_common()
        },
        stream_node=stream_node,
    )


def measure_fleet(
    kind: str, masters: int, load: FleetLoad, logs: Path, redis_cpus: Sequence[int] = ()
) -> FleetResult:
    """One fleet on a fresh private Redis of ``kind`` ("server" or "cluster"); its nodes
    pinned one to a CPU of ``redis_cpus`` (round robin) when given."""
    label = "server" if kind == "server" else f"cluster x{masters}"
    with topology(kind, masters) as (url, setting, nodes, pids):
        for index, pid in enumerate(pids):
            if redis_cpus and pid:
                os.sched_setaffinity(pid, {redis_cpus[index % len(redis_cpus)]})
        return asyncio.run(measure(url, setting, nodes, label, load, logs))
