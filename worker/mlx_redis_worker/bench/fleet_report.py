"""``mlx-worker bench fleet``'s command and tables: one row per load of each fleet (its
phases), one row per fleet for what it costs idle, its control plane and its reclaim sweep."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from mlx_redis_worker.bench.fleet_bench import (
    WORKERS_PER_HOST,
    FleetLoad,
    FleetResult,
    PhaseResult,
    measure_fleet,
)

CONTROL_COLUMNS = ("ctl stats", "ctl ping", "models", "/v1/models", "/status.json")
PROCESS_GROUPS = ("hosts", "clients", "bench")
COMMANDS_SHOWN = 8  # the most frequent commands of a load, per delivered token


def cpu_cores(result: FleetResult, ph: PhaseResult) -> str:
    """Cores used over a load: each Redis node (the job stream's marked *), then the host
    processes, the load generators and the bench (- where not known)."""
    nodes = " ".join(
        f"{ph.cores(seconds):.2f}" + ("*" if index == result.stream_node else "")
        for index, seconds in enumerate(ph.node_cpu_seconds)
    )
    groups = " / ".join(
        f"{ph.cores(ph.process_cpu_seconds[g]):.2f}" if g in ph.process_cpu_seconds else "-"
        for g in PROCESS_GROUPS
    )
    return f"{nodes} / {groups}"


def commands_lines(results: Sequence[FleetResult]) -> str:
    """Each load's CPU per delivered token (Redis, each process group) and its most frequent
    Redis commands per delivered token."""
    lines = []
    for r in results:
        for ph in r.phases:
            tokens = ph.summary.tokens or 1
            cpu = ", ".join(
                f"{name} {1e6 * seconds / tokens:.0f}"
                for name, seconds in {
                    "Redis": ph.redis_cpu_seconds,
                    **ph.process_cpu_seconds,
                }.items()
            )
            if len(ph.node_cpu_seconds) > 1:  # each node's share, the job stream's marked
                shares = " + ".join(
                    f"{1e6 * seconds / tokens:.1f}" + ("*" if index == r.stream_node else "")
                    for index, seconds in enumerate(ph.node_cpu_seconds)
                )
                cpu += f" (nodes {shares})"
            ranked = list(ph.calls_per_token().items())[:COMMANDS_SHOWN]
            each = ", ".join(f"{name} {n:.3f}" for name, n in ranked)
            lines.append(
                f"{r.topology} x{r.workers}, {ph.label}: CPU µs/token {cpu}; calls/token {each}"
            )
    return "\n".join(lines)


def parse_cpus(text: str) -> list[int]:
    """``0-5,8`` -> [0, 1, 2, 3, 4, 5, 8]."""
    cpus: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def one_master_ratio(result: FleetResult, results: Sequence[FleetResult]) -> str:
    """The first load's tokens/s against one master's (a 1-master Cluster, else the server)
    with as many workers in this run: how a Cluster scales."""
    same = [r for r in results if r.workers == result.workers and r.phases]
    base = next((r for r in same if r.masters == 1), None) or next(
        (r for r in same if r.masters == 0), None
    )
    if base is None or not result.phases or base.phases[0].tokens_per_second <= 0:
        return "-"
    return f"{result.phases[0].tokens_per_second / base.phases[0].tokens_per_second:.2f}x"


def load_table(results: Sequence[FleetResult]) -> str:
    rows = [
        "| topology | workers | load | requests | ended once / whole / duplicates / lost "
        "| tokens/s | vs one master | Redis CPU µs/token | step→subscriber p50 / p99 ms "
        "| submit→first delta p99 ms | CPU cores: Redis nodes (* job stream) / hosts "
        "/ clients / bench |",
        "|" + "---|" * 11,
    ]
    for r in results:
        for index, ph in enumerate(r.phases):
            s = ph.summary
            p50, p99 = ph.step_to_subscriber_ms
            ratio = one_master_ratio(r, results) if index == 0 else "-"
            rows.append(
                f"| {r.topology} | {r.workers} | {ph.label} | {s.submitted} "
                f"| {s.ended_once} / {s.whole} / {s.duplicates} / {s.lost} "
                f"| {ph.tokens_per_second:.0f} | {ratio} | {ph.redis_us_per_token:.1f} "
                f"| {p50:.1f} / {p99:.1f} | {ph.first_delta_p99_ms:.0f} "
                f"| {cpu_cores(r, ph)} |"
            )
    return "\n".join(rows)


def fleet_table(results: Sequence[FleetResult]) -> str:
    rows = [
        "| topology | workers | idle fleet Redis CPU % | "
        + " | ".join(f"{c} ms" for c in CONTROL_COLUMNS)
        + " | reclaim sweep: pending, first pass ms (taken), all passes ms (passes, worst) "
        "| PING during sweep p99 / max ms |",
        "|" + "---|" * (5 + len(CONTROL_COLUMNS)),
    ]
    for r in results:
        control = " | ".join(
            f"{r.control_ms[c]:.0f} ({r.control_notes[c]})" if c in r.control_ms else "-"
            for c in CONTROL_COLUMNS
        )
        sweep, ping = "-", "-"
        if (c := r.reclaim) is not None:
            sweep = (
                f"{c.pending}, {c.first_pass_ms:.1f} ({c.first_taken}), {c.sweep_ms:.0f} "
                f"({c.passes} passes took {c.taken}, worst {c.worst_pass_ms:.1f})"
            )
            ping = f"{c.ping_p99_ms:.1f} / {c.ping_max_ms:.1f}"
        rows.append(
            f"| {r.topology} | {r.workers} | {r.idle_redis_cpu_percent:.1f} | {control} "
            f"| {sweep} | {ping} |"
        )
    return "\n".join(rows)


def fleet_load(args: argparse.Namespace, workers: int) -> FleetLoad:
    return FleetLoad(
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
        duration=args.duration,
        saturate=args.saturate,
        saturate_seconds=args.saturate_seconds,
        saturate_in_flight=args.saturate_in_flight,
        load_fraction=args.load_fraction,
        reclaim_pending=args.reclaim_pending,
        clients=args.clients,
    )


def run_fleet_bench(args: argparse.Namespace) -> int:
    logs = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    redis_cpus = parse_cpus(args.redis_cpus)
    if redis_cpus:
        # Everything but Redis (this process, the hosts, the load generators, the gateway:
        # children inherit it) off the Redis nodes' CPUs, so Redis has cores of its own.
        rest = set(range(os.cpu_count() or 1)) - set(redis_cpus)
        if not rest:
            raise SystemExit("--redis-cpus leaves no CPU for the workers and the clients")
        os.sched_setaffinity(0, rest)
    results = []
    for workers in (int(n) for n in str(args.workers).split(",")):
        load = fleet_load(args, workers)
        for kind in str(args.topology).split(","):
            for masters in (
                [int(m) for m in str(args.masters).split(",")] if kind == "cluster" else [0]
            ):
                results.append(measure_fleet(kind, masters, load, logs, redis_cpus))
                done = results[-1:]
                print(load_table(done) if done[0].phases else fleet_table(done), flush=True)
    shape = (
        f"saturation ({args.saturate_seconds:g} s closed loop) then "
        f"{100 * args.load_fraction:g}% of it"
        if args.saturate
        else f"{args.rate:g}/s"
    )
    amount = f"for {args.duration:g} s" if args.duration else f"{args.requests} requests"
    print(
        f"\nsimulated fleet: at least {args.hosts} host processes, one per "
        f"{WORKERS_PER_HOST} workers, {args.clients} load process(es), "
        f"--max-concurrency {args.max_concurrency}, step {args.step_ms:g} ms, "
        f"{args.max_tokens} tokens a request, {shape}, {amount}, stream interval 1; "
        f"Redis CPUs {args.redis_cpus or 'shared'}; load average {os.getloadavg()[0]:.2f} "
        f"(on {os.cpu_count()} CPUs); logs in {logs}\n"
    )
    print(load_table(results))
    if any(r.phases for r in results):
        print()
        print(commands_lines(results))
    print()
    print(fleet_table(results))
    for r in results:
        total = sum(r.idle_commands.values())
        each = ", ".join(f"{name} {n:.2f}" for name, n in r.idle_commands.items() if n >= 0.005)
        print(f"\n{r.topology} x{r.workers} idle, commands/worker/s: {total:.2f} ({each})")
    failed = [r for r in results if r.problems or r.pending_after]
    for result in failed:
        print(
            f"\n{result.topology} x{result.workers}: {len(result.problems)} problems, "
            f"{result.pending_after} pending after"
        )
        for problem in result.problems[:10]:
            print(f"  {problem}")
    return 1 if failed else 0
