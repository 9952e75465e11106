"""``mlx-worker bench isolation``: what one abusive HTTP client costs another tenant.

One Redis (a private redis-server unless ``--redis-url``), one worker and one gateway with
API keys: a **victim** key without limits and an **attacker** key (30 requests a minute, 4
at once). Each phase runs the victim's load (``--concurrency`` greedy streams of
``--max-tokens`` through ``POST /v1/completions``, one rotation's prompts) while one attacker
runs beside it, or none (the baseline); a prober asks ``/health`` every 0.1 s throughout.
Phases alternate with baselines (base, A, base, B, …, base), so each attacker's ratio is
against the baselines on either side of it, in the same run.

Attackers: **huge header** (heads of 16 MB, one connection after another), **huge body**
(bodies that say 500 MB, sent until refused), **read flood** (200 connections reading random
request ids with the attacker's key), **resume flood** (200 connections resuming the
attacker's own finished request), **idle sockets** (``--idle-sockets`` connections that send
nothing, reopened when closed). Reported per attacker: the victim's tok/s and TTFT p50 as
ratios to the baselines (goal ≥ 0.8 for tok/s), ``/health`` p99 (goal < 1 s), and what the
attacker got back (statuses).
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
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_redis_gateway.api_keys import add_key
from mlx_redis_protocol.client import Client
from mlx_redis_worker.bench.e2e_bench import pct
from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.bench.gateway_bench import MODEL_NAME, Stream, _Connections, _gateway
from mlx_redis_worker.bench.gateway_bench import _gateway_ready as gateway_ready
from mlx_redis_worker.bench.models_bench import Model, start_worker
from mlx_redis_worker.bench.worker_process import stop_worker, wait_ready
from mlx_redis_worker.local_redis import free_port, local_redis
from mlx_redis_worker.models import load_model

TOKENS_GOAL = 0.8  # victim tok/s under attack / alone
HEALTH_GOAL_S = 1.0  # /health p99
HEALTH_TIMEOUT = 5.0  # a /health that takes longer counts as this
FLOOD_CONNECTIONS = 200
HUGE_HEADER = 16 * 1024 * 1024
HUGE_BODY = 500 * 1024 * 1024
PIECE = b"a" * 65536


@dataclass(slots=True)
class Phase:
    attacker: str  # "" for a baseline
    tokens_per_second: float
    ttft_p50: float
    health: list[float]  # seconds per /health answer (HEALTH_TIMEOUT for one that failed)
    statuses: Counter[str] = field(default_factory=Counter)


class Target:
    """The gateway under attack: its port and the attacker's key."""

    def __init__(self, port: int, attacker: str) -> None:
        self.port = port
        self.auth = f"Authorization: Bearer {attacker}\r\n"
        self.statuses: Counter[str] = Counter()
        self.own_request = ""  # the attacker's finished request, for the resume flood

    async def exchange(self, head: str, body_pieces: int = 0) -> None:
        """One request on a connection of its own; its status (or failure) is counted."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError as exc:
            self.statuses[f"connect failed: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)
            return
        try:
            # The gateway may refuse (and close) before it all arrived: then the answer is
            # read all the same.
            with contextlib.suppress(OSError):
                writer.write(head.encode())
                for _ in range(body_pieces):
                    writer.write(PIECE)
                    await writer.drain()
            status = await reader.readline()
            self.statuses[status.split(b" ", 2)[1].decode() if status else "closed"] += 1
            await reader.read()
        except (OSError, IndexError) as exc:
            self.statuses[type(exc).__name__] += 1
        finally:
            writer.close()


async def huge_header(target: Target) -> None:
    head = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    while True:
        await target.exchange(head, HUGE_HEADER // len(PIECE))


async def huge_body(target: Target) -> None:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{target.auth}"
        f"Content-Type: application/json\r\nContent-Length: {HUGE_BODY}\r\n\r\n"
    )
    while True:
        await target.exchange(head, HUGE_BODY // len(PIECE))


async def read_flood(target: Target) -> None:
    async def reader() -> None:
        while True:
            path = f"/v1/requests/cmpl-{uuid.uuid4().hex}"
            await target.exchange(_get(path, target.auth))

    await asyncio.gather(*(reader() for _ in range(FLOOD_CONNECTIONS)))


async def resume_flood(target: Target) -> None:
    async def resumer() -> None:
        while True:
            await target.exchange(_get(f"/v1/requests/{target.own_request}/stream", target.auth))

    await asyncio.gather(*(resumer() for _ in range(FLOOD_CONNECTIONS)))


def idle_sockets(count: int) -> Callable[[Target], Coroutine[Any, Any, None]]:
    async def attack(target: Target) -> None:
        async def hold() -> None:
            while True:  # the gateway closes it after its header timeout: open another
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", target.port)
                except OSError as exc:
                    target.statuses[f"connect failed: {type(exc).__name__}"] += 1
                    await asyncio.sleep(0.5)
                    continue
                with contextlib.suppress(OSError):
                    status = await reader.readline()
                    target.statuses[status.split(b" ", 2)[1].decode() if status else "closed"] += 1
                writer.close()

        await asyncio.gather(*(hold() for _ in range(count)))

    return attack


def _get(path: str, auth: str) -> str:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n"


async def _probe_health(port: int, seconds: list[float]) -> None:
    while True:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(_get("/health", "").encode())
                status = await reader.readline()
                await reader.read()
                writer.close()
            ok = status.split(b" ", 2)[1:2] == [b"200"]
            seconds.append(time.perf_counter() - start if ok else HEALTH_TIMEOUT)
        except (TimeoutError, OSError):
            seconds.append(HEALTH_TIMEOUT)
        await asyncio.sleep(0.1)


async def _phase(
    name: str,
    attack: Callable[[Target], Coroutine[Any, Any, None]] | None,
    target: Target,
    victim: _Connections,
    prompts: list[str],
    max_tokens: int,
) -> Phase:
    target.statuses = Counter()
    health: list[float] = []
    background = [asyncio.create_task(_probe_health(target.port, health))]
    if attack is not None:
        background.append(asyncio.create_task(attack(target)))
        await asyncio.sleep(1.0)  # the attack under way before the victim starts
    try:
        start = time.perf_counter()
        streams: list[Stream] = await asyncio.gather(
            *(_gateway(victim, p, max_tokens) for p in prompts)
        )
        seconds = time.perf_counter() - start
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    return Phase(
        name,
        sum(s.tokens for s in streams) / seconds,
        statistics.median(s.ttft for s in streams),
        health,
        target.statuses,
    )


async def _measure(
    port: int, victim_key: str, target: Target, prompts: list[list[str]], args: argparse.Namespace
) -> list[Phase]:
    attackers: list[tuple[str, Callable[[Target], Coroutine[Any, Any, None]]]] = [
        ("huge header", huge_header),
        ("huge body", huge_body),
        ("read flood", read_flood),
        ("resume flood", resume_flood),
        (f"{args.idle_sockets} idle sockets", idle_sockets(args.idle_sockets)),
    ]
    victim = _Connections(port, headers=f"Authorization: Bearer {victim_key}\r\n")
    attacker = _Connections(port, headers=target.auth)
    try:
        target.own_request = (await _gateway(attacker, prompts[0][0], 4)).request_id
        await _phase("", None, target, victim, prompts[0], args.max_tokens)  # warm-up
        phases: list[Phase] = []
        batch = iter(prompts[1:])
        for _ in range(args.repeat):
            for name, attack in attackers:
                phases.append(await _phase("", None, target, victim, next(batch), args.max_tokens))
                phases.append(
                    await _phase(name, attack, target, victim, next(batch), args.max_tokens)
                )
        phases.append(await _phase("", None, target, victim, next(batch), args.max_tokens))
        return phases
    finally:
        victim.close()
        attacker.close()


def format_isolation(phases: list[Phase]) -> str:
    rows, met = [], True
    names = list(dict.fromkeys(p.attacker for p in phases if p.attacker))
    base_health = [s for p in phases if not p.attacker for s in p.health]
    rows.append(f"| alone (baselines) | 1.00 | 1.00 | {pct(base_health, 0.99) * 1e3:.0f} | |")
    for name in names:
        tokens, ttft, health, statuses = [], [], [], Counter[str]()
        for i, phase in enumerate(phases):
            if phase.attacker != name:
                continue
            before, after = phases[i - 1], phases[i + 1]
            tokens.append(
                phase.tokens_per_second
                / statistics.mean([before.tokens_per_second, after.tokens_per_second])
            )
            ttft.append(phase.ttft_p50 / statistics.mean([before.ttft_p50, after.ttft_p50]))
            health += phase.health
            statuses.update(phase.statuses)
        p99 = pct(health, 0.99)
        met = met and statistics.median(tokens) >= TOKENS_GOAL and p99 < HEALTH_GOAL_S
        got = ", ".join(f"{status} ×{count}" for status, count in statuses.most_common(4))
        rows.append(
            f"| {name} | {statistics.median(tokens):.2f} | {statistics.median(ttft):.2f} | "
            f"{p99 * 1e3:.0f} | {got} |"
        )
    alone = statistics.median(p.tokens_per_second for p in phases if not p.attacker)
    return "\n".join(
        [
            f"victim alone: {alone:.0f} tok/s (median of baselines)",
            "",
            "| attacker | victim tok/s ratio | victim TTFT p50 ratio | /health p99 ms | "
            "attacker got |",
            "|---|---:|---:|---:|---|",
            *rows,
            "",
            f"goals: victim tok/s ≥ {TOKENS_GOAL} × alone and /health p99 < "
            f"{HEALTH_GOAL_S * 1e3:.0f} ms under every attacker: {'met' if met else 'NOT met'}",
        ]
    )


def _start_gateway(
    url: str, prefix: str, port: int, keys: Path, log: str
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "mlx_redis_protocol.cli", "--log-level", "WARNING", "gateway"]
    command += ["--listen", f"127.0.0.1:{port}", "--redis-url", url, "--prefix", prefix]
    command += ["--api-keys", str(keys)]
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)


def run_isolation_bench(args: argparse.Namespace) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the idle sockets need room
    tokenizer = load_model(args.model)[1]
    phases = 2 + args.repeat * 10
    prompts = [
        [tokenizer.decode(p) for p in make_prompts(tokenizer, args.concurrency, 32, seed=i)]
        for i in range(phases)
    ]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as directory:
        url, what = stack.enter_context(local_redis(args.redis_url))
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        keys = Path(directory) / "keys.toml"
        victim = add_key(keys, "victim", requests_per_minute=None, max_concurrent=None)
        attacker = add_key(keys, "attacker", requests_per_minute=30, max_concurrent=4)
        model = Model(MODEL_NAME, args.model, [], [])
        worker = start_worker(url, prefix, f"{prefix}-worker", [model], args.concurrency)
        stack.callback(stop_worker, worker.process)
        port = free_port()
        log = os.path.join(tempfile.gettempdir(), f"mlxw-{prefix}-gateway.log")
        gateway = _start_gateway(url, prefix, port, keys, log)
        stack.callback(stop_worker, gateway)
        print(f"Redis: {what}; logs: {worker.log_path}, {log}")

        async def run() -> list[Phase]:
            async with Client(url, prefix=prefix) as client:
                await wait_ready(client, [worker])
            await gateway_ready(port, gateway)
            return await _measure(port, victim, Target(port, attacker), prompts, args)

        results = asyncio.run(run())
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print(format_isolation(results))
    return 0
