"""``mlx-worker bench gateway``: the OpenAI gateway against the protocol client, same run.

One Redis (a private redis-server unless ``--redis-url``), one worker process and one gateway
process (``mlx-worker gateway``) serve both paths. Each run sends ``--concurrency`` greedy
requests at once and reads every stream to its end: **direct**, ``Client.submit`` +
``Client.stream`` in this process; **gateway**, streaming ``POST /v1/completions`` over
HTTP/1.1 (keep-alive connections, one per concurrent stream, as an SDK's pool holds them),
read by a minimal asyncio client (chunked transfer, SSE lines, one
``json.loads`` per chunk) whose own CPU stays small beside the gateway's. Paths alternate (A B,
B A, ...) so drift hits both alike; every run gets fresh prompts (text) of the same length, so
the worker's prefix cache never serves one run's prompts to the next.

Reported per path: tokens per second delivered (completion tokens, the gateway's from its
``usage``, over the wall time from the first send to the last stream's end); TTFT p50 / p90,
per request from its own send to its first non-empty text (not the gateway's role-only first
chunk); the part of TTFT outside the worker: TTFT less the time from the request's queued
marker to the worker's first text event, both read from the replay log's entry ids (Redis's
clock, ms), which takes out how the worker happens to admit a burst (the bulk of TTFT, and of
its noise); and the CPU seconds of the worker, Redis, the gateway and this process. Then the
ratios (medians of per-rotation values) against the goals: ≥ 0.95 and TTFT p50 ≤ +10 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, ErrorEvent
from mlx_redis_protocol.replay_log import read_log
from mlx_redis_worker.bench.e2e_bench import Run, cpu_of, pct, ratio, redis_pids
from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.bench.models_bench import Model, start_worker
from mlx_redis_worker.bench.worker_process import stop_worker, wait_ready
from mlx_redis_worker.local_redis import free_port, local_redis
from mlx_redis_worker.models import load_model

DIRECT = "direct (protocol client)"
GATEWAY = "gateway (HTTP + SSE)"
PATHS = (DIRECT, GATEWAY)
MODEL_NAME = "bench"  # the fleet's name of the model (the requests' ``model``)
TOKENS_GOAL = 0.95  # gateway / direct tok/s
TTFT_GOAL_MS = 10.0  # gateway TTFT p50 - direct TTFT p50
READY_TIMEOUT = 60.0
STREAM_TIMEOUT = 300.0


@dataclass(slots=True)
class Stream:
    """One request's outcome, timed from its own send (seconds)."""

    request_id: str
    tokens: int
    ttft: float  # to the first text (to the end where none came)
    latency: float
    gaps: list[float] = field(default_factory=list)  # between its events with text, in order


@dataclass(slots=True)
class Measured:
    run: Run
    outside: list[float]  # per request: TTFT outside the worker (seconds)
    cpu: dict[str, float | None]  # CPU seconds of each process group during the run


@dataclass(slots=True)
class Results:
    by_path: dict[str, list[Measured]] = field(default_factory=lambda: {p: [] for p in PATHS})


async def _direct(client: Client, prompt: str, max_tokens: int) -> Stream:
    start = time.perf_counter()
    request_id = await client.submit(
        prompt, model=MODEL_NAME, max_tokens=max_tokens, temperature=0.0
    )
    tokens, ttft = 0, None
    async for event in client.stream(request_id, timeout=STREAM_TIMEOUT):
        if isinstance(event, DeltaEvent):
            tokens += len(event.new_token_ids)
            if ttft is None and event.new_text:
                ttft = time.perf_counter() - start
        elif isinstance(event, ErrorEvent):
            raise RuntimeError(f"direct request {request_id} failed: {event.message}")
        elif isinstance(event, DoneEvent):
            latency = time.perf_counter() - start
            return Stream(request_id, tokens, latency if ttft is None else ttft, latency)
    raise RuntimeError(f"direct request {request_id} ended without a done event")


class _Connections:
    """Keep-alive HTTP/1.1 connections to the gateway, one per concurrent stream, as an
    OpenAI SDK's connection pool holds them: a request does not pay a TCP connect."""

    def __init__(self, port: int, headers: str = "") -> None:
        """``headers``: lines (each ending CRLF) every request carries, a key's, say."""
        self.port = port
        self.headers = headers
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    @contextlib.asynccontextmanager
    async def request(self, head: str, body: bytes = b"") -> AsyncIterator[asyncio.StreamReader]:
        """Send one request; the reader, past a 200's headers. The connection goes back to
        the pool only when the caller read the whole answer without failing."""
        request = (
            f"{head} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n{self.headers}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        reader, writer, status = await self._send(request)
        reusable = False
        try:
            if status.split(b" ", 2)[1:2] != [b"200"]:
                raise RuntimeError(f"{head}: {status.decode().strip()}")
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # the headers: every answer read here is chunked (the size lines say so)
            yield reader
            reusable = True
        finally:
            if reusable:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def _send(
        self, request: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
        """Send on an idle connection, or a new one when the server has closed that one."""
        while self._idle:
            reader, writer = self._idle.pop()
            writer.write(request)
            with contextlib.suppress(ConnectionError):
                if status := await reader.readline():
                    return reader, writer, status
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(request)
        return reader, writer, await reader.readline()

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The body's chunks (chunked transfer), to the last one (size 0) included."""
    while size := int((await reader.readline()).split(b";")[0], 16):
        yield (await reader.readexactly(size + 2))[:-2]
    await reader.readline()  # the empty trailer


async def _gateway(connections: _Connections, prompt: str, max_tokens: int) -> Stream:
    """One streaming completion through the gateway: its SSE data lines, de-chunked."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    request_id, tokens, ttft, latency, pending = "", 0, None, None, b""
    gaps: list[float] = []
    last_text = 0.0
    async with connections.request("POST /v1/completions", json.dumps(body).encode()) as reader:
        async for chunk in _chunks(reader):
            *lines, pending = (pending + chunk).split(b"\n")
            for line in (line.rstrip(b"\r") for line in lines):
                if not line.startswith(b"data: "):
                    continue  # id:, blank separators, ping comments
                if line == b"data: [DONE]":
                    latency = time.perf_counter() - start
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"gateway request failed: {data['error']}")
                request_id = data["id"]
                if data["choices"] and data["choices"][0]["text"]:
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        gaps.append(now - last_text)
                    last_text = now
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
    if latency is None:
        raise RuntimeError("a gateway stream ended without [DONE]")
    return Stream(request_id, tokens, latency if ttft is None else ttft, latency, gaps)


async def _worker_share(client: Client, request_id: str) -> float:
    """Seconds from the request's queued marker to its first text event, by the ms times of
    their entry ids in its replay log (both stamped by Redis); 0 where no text came."""

    def at(entry_id: bytes) -> float:
        return int(entry_id.split(b"-")[0]) / 1e3

    entries = await read_log(client.redis, client.keys, request_id)
    for entry in entries:
        event = decode_event(entry.data)
        if isinstance(event, DeltaEvent) and event.new_text:
            return at(entry.stream_id) - at(entries[0].stream_id)
    return 0.0


async def _load(
    client: Client,
    connections: _Connections,
    pids: dict[str, list[int]],
    path: str,
    prompts: list[str],
    tokens: int,
) -> Measured:
    cpu_before = cpu_of(pids)
    start = time.perf_counter()
    if path == DIRECT:
        streams = await asyncio.gather(*(_direct(client, p, tokens) for p in prompts))
    else:
        streams = await asyncio.gather(*(_gateway(connections, p, tokens) for p in prompts))
    seconds = time.perf_counter() - start
    cpu_after = cpu_of(pids)
    cpu = {
        name: after - before if before is not None and after is not None else None
        for (name, before), after in zip(cpu_before.items(), cpu_after.values(), strict=True)
    }
    shares = await asyncio.gather(*(_worker_share(client, s.request_id) for s in streams))
    run = Run(
        path,
        len(prompts),
        sum(s.tokens for s in streams),
        seconds,
        [s.ttft for s in streams],
        [s.latency for s in streams],
    )
    return Measured(run, [s.ttft - share for s, share in zip(streams, shares, strict=True)], cpu)


async def _gateway_ready(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited during start-up ({process.returncode})")
        with contextlib.suppress(OSError, RuntimeError):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            status = await reader.readline()
            writer.close()
            if status.split(b" ", 2)[1:2] == [b"200"]:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not answer /health within {READY_TIMEOUT} s")
        await asyncio.sleep(0.2)


def _start_gateway(url: str, prefix: str, port: int, log_path: str) -> subprocess.Popen[bytes]:
    listen = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlx_redis_protocol.cli", "--log-level", "WARNING", "gateway"]
    command += ["--listen", listen, "--redis-url", url, "--prefix", prefix]
    with open(log_path, "ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


async def _measure(
    url: str,
    prefix: str,
    worker: subprocess.Popen[bytes],
    gateway: subprocess.Popen[bytes],
    port: int,
    prompts: dict[tuple[int, str], list[str]],
    args: argparse.Namespace,
) -> Results:
    results = Results()
    async with Client(url, prefix=prefix) as client:
        await _gateway_ready(port, gateway)
        pids = {
            "worker": [worker.pid],
            "Redis": await redis_pids(url, prefix),
            "gateway": [gateway.pid],
            "client": [os.getpid()],
        }
        connections = _Connections(port)
        try:
            for path in PATHS:
                await _load(client, connections, pids, path, prompts[(-1, path)], args.max_tokens)
            for rotation in range(args.repeat):
                for path in PATHS if rotation % 2 == 0 else PATHS[::-1]:
                    batch = prompts[(rotation, path)]
                    measured = await _load(client, connections, pids, path, batch, args.max_tokens)
                    results.by_path[path].append(measured)
        finally:
            connections.close()
    return results


def run_gateway_bench(args: argparse.Namespace) -> int:
    tokenizer = load_model(args.model)[1]
    prompts: dict[tuple[int, str], list[str]] = {}
    for rotation in range(-1, args.repeat):  # -1: a full warm-up (pools, caches)
        for index, path in enumerate(PATHS):
            ids = make_prompts(
                tokenizer, args.concurrency, args.prompt_tokens, seed=2 * rotation + index
            )
            prompts[(rotation, path)] = [tokenizer.decode(p) for p in ids]
    with contextlib.ExitStack() as stack:
        url, what = stack.enter_context(local_redis(args.redis_url))
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        model = Model(MODEL_NAME, args.model, [], [])
        worker = start_worker(url, prefix, f"{prefix}-worker", [model], args.concurrency)
        stack.callback(stop_worker, worker.process)
        port = free_port()
        gateway_log = os.path.join(tempfile.gettempdir(), f"mlxw-{prefix}-gateway.log")
        gateway = _start_gateway(url, prefix, port, gateway_log)
        stack.callback(stop_worker, gateway)
        print(f"Redis: {what}; logs: {worker.log_path}, {gateway_log}")

        async def ready() -> None:
            async with Client(url, prefix=prefix) as client:
                await wait_ready(client, [worker])

        asyncio.run(ready())
        results = asyncio.run(_measure(url, prefix, worker.process, gateway, port, prompts, args))
    print(format_gateway(results, args))
    return 0


def _p50_ms(values: list[float]) -> float:
    return pct(values, 0.5) * 1e3


def _row(measured: list[Measured]) -> str:
    runs = [m.run for m in measured]
    tokens = statistics.median(r.tokens for r in runs)
    speed = statistics.median(r.tokens_per_second for r in runs)
    p50 = statistics.median(_p50_ms(r.ttfts) for r in runs)
    p90 = statistics.median(pct(r.ttfts, 0.9) * 1e3 for r in runs)
    outside = statistics.median(_p50_ms(m.outside) for m in measured)
    latency = statistics.median(_p50_ms(r.latencies) for r in runs)
    cpu = " | ".join(_cpu(measured, name) for name in measured[0].cpu)
    return (
        f"| {runs[0].path} | {runs[0].concurrency} | {tokens:.0f} | {speed:.1f} "
        f"| {p50:.1f} / {p90:.1f} | {outside:.1f} | {latency:.0f} | {cpu} |"
    )


def _cpu(measured: list[Measured], name: str) -> str:
    values = [m.cpu[name] for m in measured]
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if len(known) == len(values) else "-"


def _goal(text: str, met: bool, rotations: list[float], unit: str = "") -> str:
    each = ", ".join(f"{v:+.1f}" if unit else f"{v:.3f}" for v in rotations)
    return f"{text} ({'met' if met else 'MISSED'}; per rotation {each}{unit})"


def format_gateway(results: Results, args: argparse.Namespace) -> str:
    direct, gateway = results.by_path[DIRECT], results.by_path[GATEWAY]
    names = list(direct[0].cpu)
    pairs = list(zip(direct, gateway, strict=True))
    speed = [g.run.tokens_per_second / d.run.tokens_per_second for d, g in pairs]
    added = [_p50_ms(g.run.ttfts) - _p50_ms(d.run.ttfts) for d, g in pairs]
    added_outside = [_p50_ms(g.outside) - _p50_ms(d.outside) for d, g in pairs]
    tokens_ratio = ratio([g.run for g in gateway], [d.run for d in direct])
    ttft, outside = statistics.median(added), statistics.median(added_outside)
    goal = f"goal ≤ +{TTFT_GOAL_MS:.0f} ms"
    return "\n".join(
        [
            f"model {args.model}, {args.concurrency} concurrent streams, prompt "
            f"{args.prompt_tokens} tokens (as text), max_tokens {args.max_tokens}, greedy, "
            f"{args.repeat} rotations (medians)",
            "| path | streams | tokens | tok/s | TTFT p50 / p90 (ms) "
            "| TTFT outside the worker p50 (ms) | latency p50 (ms) | "
            + " | ".join(f"CPU s {name}" for name in names)
            + " |",
            "|---|---:|---:|---:|---:|---:|---:|" + "---:|" * len(names),
            _row(direct),
            _row(gateway),
            "",
            _goal(
                f"gateway / direct tok/s = {tokens_ratio:.3f}, goal ≥ {TOKENS_GOAL:.2f}",
                tokens_ratio >= TOKENS_GOAL,
                speed,
            ),
            _goal(
                f"gateway - direct TTFT p50 = {ttft:+.1f} ms, {goal}",
                ttft <= TTFT_GOAL_MS,
                added,
                " ms",
            ),
            _goal(
                f"  outside the worker (submit, delivery) = {outside:+.1f} ms, {goal}",
                outside <= TTFT_GOAL_MS,
                added_outside,
                " ms",
            ),
            "(medians of per-rotation values; TTFT from each request's send to its first "
            "text; outside the worker: less the time from its queued marker to the worker's "
            "first text event, which varies with how the worker admits the burst)",
        ]
    )
