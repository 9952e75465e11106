"""Slow, vanished and reconnecting subscribers: the others' throughput must not change.

    python -m tests.reliability.subscribers --requests 8 --max-tokens 96

Three phases of the same load on one worker (K greedy requests of T tokens, followed by
ordinary subscribers): a baseline; the same load while dozens of subscribers misbehave;
the baseline again. The misbehaving ones: *slow* subscribers that pattern-subscribe to every
request's channel and never read (Redis buffers for them, then drops them at its pub/sub
output-buffer limit), *vanished* ones that subscribe and reset their TCP connection after the
first message, one that leaves mid-stream and comes back a second later, and one whose
connection Redis kills mid-stream (CLIENT KILL). The two that reconnect must get every token.
"""

from __future__ import annotations

# `mlx_redis_worker` must be imported before anything imports mlx: it loads OpenBLAS first.
import mlx_redis_worker  # noqa: F401  # isort: skip

import asyncio
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_worker.local_redis import RedisServer
from tests.reliability.streams import Followed, follow
from tests.reliability.workers import worker_process
from tests.support.drivers import (
    DriverResult,
    config_from_arguments,
    exit_with,
    percentile,
    report,
    work_directory,
)
from tests.support.events import text_after_last_reset
from tests.support.prompts import random_prompts
from tests.support.references import tiny_reference

# Small pub/sub output-buffer limits so Redis drops the slow subscribers during the run.
BUFFER_LIMIT = ("--client-output-buffer-limit", "pubsub 32kb 8kb 1")


@dataclass
class SubscribersConfig:
    requests: int = 8
    max_tokens: int = 96
    slow: int = 20
    vanished: int = 20
    seed: int = 5
    directory: Path | None = None


def _resp(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _raw_subscriber(port: int, command: bytes) -> socket.socket:
    """A bare TCP subscriber with a tiny receive buffer, so unread data backs up in Redis."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(command)
    return sock


def _reset(sock: socket.socket) -> None:
    """Close with RST (linger 0): the peer vanishes without unsubscribing."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def _phase(
    client: Client, prompts: list[str], max_tokens: int, tag: str
) -> tuple[float, list[DoneEvent], list[str]]:
    """Submit the load and wait for every done; returns (wall seconds, dones, request ids)."""
    started = time.monotonic()
    rids = [
        await client.submit(p, request_id=f"{tag}-{i}", max_tokens=max_tokens, temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    ends = await asyncio.gather(*(client.wait(rid, timeout=120) for rid in rids))
    elapsed = time.monotonic() - started
    dones = [end for end in ends if isinstance(end, DoneEvent)]
    return elapsed, dones, rids


async def _killed_mid_stream(url: str, prefix: str, request_id: str) -> tuple[Followed, int]:
    """Follow a request; once a few events are out, have Redis kill our pub/sub connection.
    Returns what the follower saw and how many connections were killed."""
    async with Client(url, prefix=prefix, client_name="mlxw-victim") as victim:
        task = asyncio.create_task(follow(victim, request_id, event_timeout=60))
        killed = 0
        async with Client(url, prefix=prefix) as admin:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not task.done():
                if await admin.redis.xlen(admin.keys.log(request_id)) >= 4:
                    break
                await asyncio.sleep(0.02)
            for entry in await admin.redis.client_list():
                name = _text(entry.get("name"))
                if name == "mlxw-victim" and int(_text(entry.get("sub")) or 0) > 0:
                    await admin.redis.client_kill_filter(_id=_text(entry["id"]))
                    killed += 1
        return await task, killed


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


async def _fill_kernel_buffers(client: Client, slow: int) -> int:
    """Publish filler on a channel the slow subscribers match until Redis itself holds output
    for each of them (the kernel's socket buffers are full): from then on, what the worker
    publishes piles up in Redis until the output-buffer limit drops them. Returns the bytes
    published."""
    channel = client.keys.out("filler")
    chunk = b"f" * 4096
    published = 0
    while published < 64 << 20:
        for _ in range(64):
            await client.redis.publish(channel, chunk)
        published += 64 * len(chunk)
        clients = await client.redis.client_list()
        waiting = [c for c in clients if int(_text(c.get("psub")) or 0) > 0]
        if len(waiting) >= slow and all(int(_text(c.get("omem")) or 0) > 0 for c in waiting):
            return published
    return published


async def _stress_phase(
    config: SubscribersConfig, url: str, prefix: str, port: int, prompts: list[str]
) -> dict[str, Any]:
    channel_pattern = f"{prefix}:out:*"
    slow = [_raw_subscriber(port, _resp("PSUBSCRIBE", channel_pattern)) for _ in range(config.slow)]
    async with Client(url, prefix=prefix, max_connections=256) as client:
        backlog = await _fill_kernel_buffers(client, config.slow)
        rids = [f"stress-{i}" for i in range(len(prompts))]
        vanished = [
            _raw_subscriber(port, _resp("SUBSCRIBE", client.keys.out(rids[i % len(rids)])))
            for i in range(config.vanished)
        ]
        started = time.monotonic()
        submitted = [
            await client.submit(p, request_id=rid, max_tokens=config.max_tokens, temperature=0.0)
            for rid, p in zip(rids, prompts, strict=True)
        ]
        waits = [asyncio.create_task(client.wait(rid, timeout=120)) for rid in submitted]
        rejoining = asyncio.create_task(
            follow(client, rids[0], event_timeout=60, drop_after=3, pause=1.0)
        )
        killed = asyncio.create_task(_killed_mid_stream(url, prefix, rids[1]))
        # The vanished ones leave after their first message (or at once when none came yet).
        await asyncio.sleep(0.5)
        for sock in vanished:
            _reset(sock)
        ends = await asyncio.gather(*waits)
        elapsed = time.monotonic() - started
        victim, kills = await killed
        followed = [await rejoining, victim]
        info = await client.redis.info("stats")
    dropped = 0
    for sock in slow:
        sock.setblocking(False)
        try:
            while sock.recv(1 << 20):
                pass
        except BlockingIOError:
            pass  # still connected, data waiting
        except OSError:
            dropped += 1
        else:
            dropped += 1  # EOF: Redis closed it
        sock.close()
    return {
        "elapsed": elapsed,
        "dones": [e for e in ends if isinstance(e, DoneEvent)],
        "followed": followed,
        "kills": kills,
        "backlog": backlog,
        "dropped": dropped,
        "buffer_disconnections": int(info.get("client_output_buffer_limit_disconnections", 0)),
    }


def _prompt_sets(config: SubscribersConfig) -> list[list[str]]:
    return [
        random_prompts(config.requests, seed=config.seed + phase, words=(6, 6))
        for phase in range(3)
    ]


async def _run(config: SubscribersConfig, url: str, prefix: str, port: int) -> dict[str, Any]:
    prompt_sets = _prompt_sets(config)
    async with Client(url, prefix=prefix, max_connections=256) as client:
        await _phase(client, random_prompts(4, seed=99), 8, "warm")
        first = await _phase(client, prompt_sets[0], config.max_tokens, "base1")
    stress = await _stress_phase(config, url, prefix, port, prompt_sets[1])
    async with Client(url, prefix=prefix, max_connections=256) as client:
        second = await _phase(client, prompt_sets[2], config.max_tokens, "base2")
    return {"base": [first, second], "stress": stress, "prompts": prompt_sets}


def run_subscribers(config: SubscribersConfig) -> DriverResult:
    directory = work_directory(config.directory, "subscribers")
    prefix = "subs"
    references = tiny_reference().by_prompt(
        [p for prompts in _prompt_sets(config) for p in prompts], config.max_tokens
    )
    with RedisServer(extra_args=BUFFER_LIMIT, directory=directory / "redis") as server:
        process = worker_process("subs-1", server.url, prefix, directory, max_concurrency=8)
        try:
            process.start().wait_ready()
            outcome = asyncio.run(_run(config, server.url, prefix, server.port))
            stop_code = process.stop()
        finally:
            process.kill()
    result = _verify(config, outcome, stop_code, references)
    result.values["directory"] = str(directory)
    return result


def _verify(
    config: SubscribersConfig,
    outcome: dict[str, Any],
    stop_code: int | None,
    references: dict[str, str],
) -> DriverResult:
    problems: list[str] = []
    prompt_sets: list[list[str]] = outcome["prompts"]
    tokens = config.requests * config.max_tokens
    stress = outcome["stress"]
    phases = [*outcome["base"][:1], (stress["elapsed"], stress["dones"], []), outcome["base"][1]]
    for prompts, (_, dones, _) in zip(
        [prompt_sets[0], prompt_sets[1], prompt_sets[2]], phases, strict=True
    ):
        if len(dones) != len(prompts):
            problems.append(f"{len(prompts) - len(dones)} requests did not end with done")
        for prompt, done in zip(prompts, dones, strict=False):
            if done.output_text != references[prompt]:
                problems.append(f"{done.request_id}: not the greedy text")
    base_rates = [tokens / elapsed for elapsed, _, _ in outcome["base"]]
    stress_rate = tokens / stress["elapsed"]
    ratio = stress_rate / (sum(base_rates) / len(base_rates))
    rejoined, killed = stress["followed"]
    for name, followed, prompt in (
        ("rejoining", rejoined, prompt_sets[1][0]),
        ("killed", killed, prompt_sets[1][1]),
    ):
        seqs = followed.seqs
        terminal = followed.terminal
        text = text_after_last_reset(followed.events)
        if followed.error or followed.duplicates:
            problems.append(f"{name} subscriber: {followed.error} / {followed.duplicates} dups")
        if seqs != list(range(len(seqs))) or not isinstance(terminal, DoneEvent):
            problems.append(f"{name} subscriber: seqs {seqs} end with {terminal}")
        elif text != references[prompt] or terminal.output_text != references[prompt]:
            problems.append(f"{name} subscriber: text differs from the greedy reference")
    if rejoined.reconnects < 1:
        problems.append("the rejoining subscriber never left")
    if stress["kills"] < 1:
        problems.append("Redis killed no subscriber connection")
    if stop_code != 0:
        problems.append(f"the worker did not stop cleanly (rc={stop_code})")
    run_times = [d.usage.duration_ms / 1000 for d in stress["dones"]]
    base_runs = [d.usage.duration_ms / 1000 for _, dones, _ in outcome["base"] for d in dones]
    values = {
        "base_rates": base_rates,
        "stress_rate": stress_rate,
        "ratio": ratio,
        "dropped": stress["dropped"],
        "buffer_disconnections": stress["buffer_disconnections"],
        "rejoin_skipped": rejoined.replay_skipped,
    }
    figures: list[tuple[str, Any]] = [
        ("load per phase", f"{config.requests} greedy requests x {config.max_tokens} tokens"),
        (
            "tokens/s: baseline / with bad subscribers / baseline again",
            f"{base_rates[0]:.0f} / {stress_rate:.0f} / {base_rates[1]:.0f}",
        ),
        ("throughput with bad subscribers vs baseline", f"{ratio:.2f}x"),
        (
            "request run time p50: baseline / with bad subscribers (s)",
            f"{percentile(base_runs, 50):.2f} / {percentile(run_times, 50):.2f}",
        ),
        ("slow subscribers (psubscribe, never read, socket buffers full)", config.slow),
        ("... dropped by Redis at its pub/sub buffer limit during the run", stress["dropped"]),
        ("vanished subscribers (TCP reset mid-stream)", config.vanished),
        (
            "subscriber that left for 1 s mid-stream: events / replayed and skipped / lost",
            f"{len(rejoined.events)} / {rejoined.replay_skipped} / 0"
            if not any("rejoining" in p for p in problems)
            else "FAILED",
        ),
        (
            "subscriber killed by Redis mid-stream: events / lost",
            f"{len(killed.events)} / 0" if not any("killed" in p for p in problems) else "FAILED",
        ),
    ]
    return DriverResult(
        "Slow, vanished and reconnecting subscribers", figures, problems=problems, values=values
    )


def main(argv: list[str] | None = None) -> int:
    options = ("requests", "max_tokens", "slow", "vanished")
    config = config_from_arguments(SubscribersConfig(), __doc__, options, argv)
    return report(run_subscribers(config), config)


if __name__ == "__main__":
    exit_with(main)
