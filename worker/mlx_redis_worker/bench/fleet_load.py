"""The producers and subscribers of ``mlx-worker bench fleet``: one load generator.

A generator submits jobs through the real client and follows each through the real client,
checking its stream whole and in order; it keeps counts and histograms, never the events, so a
run of many minutes stays in bounded memory. Two shapes of load:

- open loop: submits at ``rate`` per second, ``requests`` of them or for ``duration`` seconds,
  whatever the fleet does (the latency a given offered load sees);
- closed loop: keeps ``in_flight`` requests outstanding for ``duration`` seconds, a new one as
  each ends: with more in flight than the fleet has slots, jobs wait in the stream and the
  fleet delivers as fast as it can (its saturation), without a backlog that grows for ever.

One generator runs in the bench's process, or several in processes of their own
(``python -m mlx_redis_worker.bench.fleet_load SPEC_JSON`` prints ``ready`` once connected,
starts on a line on its standard input, and prints its summary as JSON), so that on a large
machine the client side is not the bottleneck being measured. Every generator starts at once,
when the last is ready: forty processes importing and connecting one after another would
otherwise start their loads seconds apart, inside the window a saturation is measured over.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import asdict, dataclass, field

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, Event, ResetEvent
from mlx_redis_worker.bench.fleet_spec import TICKS_PER_SECOND, expected_text, ticks

STREAM_TIMEOUT = 120.0  # seconds without an event before a stream counts as lost
PROBLEMS_KEPT = 20
BIN_SECONDS = 0.1  # delivered tokens are counted in bins of this width (since the epoch)


@dataclass(frozen=True, slots=True)
class LoadSpec:
    redis_url: str
    topology: str  # "standalone" | "cluster"
    prefix: str
    model: str
    epoch: float
    max_tokens: int
    name: str = "load"  # the requests' prompts say which generator sent them
    rate: float = 0.0  # open loop: submits per second (0: all at once)
    requests: int = 0  # open loop: this many (0: for ``duration``)
    duration: float = 0.0  # seconds of submitting (open loop) or of keeping in_flight (closed)
    in_flight: int = 0  # > 0: closed loop

    def encode(self) -> str:
        return json.dumps(asdict(self))


@dataclass(slots=True)
class LoadSummary:
    """What the subscribers saw. Histograms in integer bins (JSON keys are strings)."""

    submitted: int = 0
    ended_once: int = 0  # exactly one terminal event
    whole: int = 0  # ended once, seq gapless, the expected text
    duplicates: int = 0  # more than one terminal event
    lost: int = 0  # no terminal event: submit failed, stream timed out or broke
    problems: list[str] = field(default_factory=list)
    tokens: int = 0
    step_to_subscriber: dict[str, int] = field(default_factory=dict)  # 0.1 ms bins
    first_delta: dict[str, int] = field(default_factory=dict)  # 1 ms bins
    tokens_by_bin: dict[str, int] = field(default_factory=dict)  # BIN_SECONDS since epoch
    cpu_seconds: float = 0.0  # the generators' CPU while the load ran (not their start)

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> LoadSummary:
        return cls(**json.loads(text))

    @classmethod
    def merged(cls, parts: Iterable[LoadSummary]) -> LoadSummary:
        total = cls()
        counters: dict[str, Counter[str]] = {
            "step_to_subscriber": Counter(),
            "first_delta": Counter(),
            "tokens_by_bin": Counter(),
        }
        for part in parts:
            total.submitted += part.submitted
            total.ended_once += part.ended_once
            total.whole += part.whole
            total.duplicates += part.duplicates
            total.lost += part.lost
            total.tokens += part.tokens
            total.cpu_seconds += part.cpu_seconds
            total.problems += part.problems[: PROBLEMS_KEPT - len(total.problems)]
            for name, counter in counters.items():
                counter.update(getattr(part, name))
        for name, counter in counters.items():
            setattr(total, name, dict(counter))
        return total

    def tokens_per_second(self, start: float, end: float) -> float:
        """Tokens delivered from ``start`` to ``end`` (seconds since the epoch) per second."""
        first, last = int(start / BIN_SECONDS), int(end / BIN_SECONDS)
        if last <= first:
            return 0.0
        tokens = sum(n for b, n in self.tokens_by_bin.items() if first <= int(b) < last)
        return tokens / ((last - first) * BIN_SECONDS)

    def delivery_span(self) -> tuple[float, float]:
        """First and last bin with tokens, in seconds since the epoch (end exclusive)."""
        bins = [int(b) for b in self.tokens_by_bin]
        if not bins:
            return 0.0, 0.0
        return min(bins) * BIN_SECONDS, (max(bins) + 1) * BIN_SECONDS


def percentile(histogram: dict[str, int], fraction: float, unit: float) -> float:
    """The ``fraction`` quantile of an integer-bin histogram, in bins of ``unit``."""
    total = sum(histogram.values())
    if total == 0:
        return float("nan")
    rank, seen = min(total - 1, int(fraction * total)), 0
    for value, count in sorted((int(v), n) for v, n in histogram.items()):
        seen += count
        if seen > rank:
            return value * unit
    raise AssertionError("unreachable")


def check_whole(events: list[Event], max_tokens: int) -> str | None:
    """Why a stream is not whole and in order; None when it is."""
    body = [e for e in events if e.seq > 0]
    seqs = [e.seq for e in body]
    if seqs != list(range(1, len(body) + 1)):
        return f"seqs {seqs[:20]}"
    terminals = [e for e in body if e.terminal]
    if len(terminals) != 1 or body[-1] is not terminals[0]:
        return f"{len(terminals)} terminal events"
    done = terminals[0]
    if not isinstance(done, DoneEvent) or done.finish_reason != "length":
        return f"ended with {done}"
    last_reset = max((i for i, e in enumerate(body) if isinstance(e, ResetEvent)), default=-1)
    text = "".join(e.new_text for e in body[last_reset + 1 :] if isinstance(e, DeltaEvent))
    if text != expected_text(max_tokens) or done.output_text != text:
        return f"text {text[:60]!r}"
    return None


class Load:
    """One generator's requests, each followed to its end and folded into ``summary``."""

    def __init__(self, client: Client, spec: LoadSpec) -> None:
        self.client = client
        self.spec = spec
        self.summary = LoadSummary()
        self._steps: Counter[int] = Counter()
        self._firsts: Counter[int] = Counter()
        self._bins: Counter[int] = Counter()

    async def run(self) -> LoadSummary:
        if self.spec.in_flight > 0:
            await self._closed_loop()
        else:
            await self._open_loop()
        self.summary.step_to_subscriber = {str(k): n for k, n in self._steps.items()}
        self.summary.first_delta = {str(k): n for k, n in self._firsts.items()}
        self.summary.tokens_by_bin = {str(k): n for k, n in self._bins.items()}
        return self.summary

    async def _open_loop(self) -> None:
        spec, tasks = self.spec, set()
        began = time.monotonic()
        while not (spec.requests and self.summary.submitted >= spec.requests):
            if not spec.requests and time.monotonic() - began >= spec.duration:
                break
            task = asyncio.create_task(self.follow(self.summary.submitted))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            self.summary.submitted += 1
            if spec.rate > 0:  # by the clock, so a late wake-up catches up instead of drifting
                due = began + self.summary.submitted / spec.rate
                await asyncio.sleep(max(0.0, due - time.monotonic()))
        await asyncio.gather(*tasks)

    async def _closed_loop(self) -> None:
        deadline = time.monotonic() + self.spec.duration

        async def keep_one() -> None:
            while time.monotonic() < deadline:
                index = self.summary.submitted
                self.summary.submitted += 1
                await self.follow(index)

        await asyncio.gather(*(keep_one() for _ in range(self.spec.in_flight)))

    async def follow(self, index: int) -> None:
        spec, summary = self.spec, self.summary
        submitted = time.time()
        events: list[Event] = []
        received: list[float] = []
        failure = None
        try:
            request_id = await self.client.submit(
                f"request {index} of {spec.name}",
                model=spec.model,
                max_tokens=spec.max_tokens,
                temperature=0.0,
            )
            async with aclosing(self.client.stream(request_id, timeout=STREAM_TIMEOUT)) as stream:
                async for event in stream:
                    received.append(time.time())
                    events.append(event)
        except Exception as exc:  # counted, not raised: the table says how many
            failure = f"{type(exc).__name__}: {exc}"
        terminals = sum(e.terminal for e in events)
        if terminals > 1:
            summary.duplicates += 1
        elif terminals == 0:
            summary.lost += 1
        elif failure is None:
            summary.ended_once += 1
        problem = failure or check_whole(events, spec.max_tokens)
        if problem is None:
            summary.whole += 1
        elif len(summary.problems) < PROBLEMS_KEPT:
            summary.problems.append(f"{spec.name} #{index}: {problem}")
        first = None
        for event, at in zip(events, received, strict=True):
            if not isinstance(event, DeltaEvent):
                continue
            first = at if first is None else first
            summary.tokens += len(event.new_token_ids)
            self._bins[int((at - spec.epoch) / BIN_SECONDS)] += len(event.new_token_ids)
            now = ticks(spec.epoch, at)
            for tick in event.new_token_ids:  # each token's id is its step's time
                self._steps[round(10_000 * (now - tick) / TICKS_PER_SECOND)] += 1
        if first is not None:
            self._firsts[round(1000 * (first - submitted))] += 1


async def run_load(
    spec: LoadSpec, ready: Callable[[], Awaitable[None]], max_in_flight: int = 256
) -> LoadSummary:
    """One generator with a client of its own: connected, it awaits ``ready()``, then runs."""
    async with Client(
        spec.redis_url, prefix=spec.prefix, topology=spec.topology, max_in_flight=max_in_flight
    ) as client:
        await ready()
        cpu_before = time.process_time()
        summary = await Load(client, spec).run()
    summary.cpu_seconds = time.process_time() - cpu_before
    return summary


def split(spec: LoadSpec, parts: int) -> list[LoadSpec]:
    """``spec`` shared by ``parts`` generators (rate, requests and in-flight divided)."""

    def share(n: int, i: int) -> int:
        return n // parts + (1 if i < n % parts else 0)

    specs = [
        LoadSpec(
            **{
                **asdict(spec),
                "name": f"{spec.name}-{i}",
                "rate": spec.rate / parts,
                "requests": share(spec.requests, i),
                "in_flight": share(spec.in_flight, i),
            }
        )
        for i in range(parts)
    ]
    if spec.in_flight:
        return [s for s in specs if s.in_flight]
    return [s for s in specs if s.requests or not spec.requests]


async def run_loads(
    spec: LoadSpec, processes: int, on_start: Callable[[], Awaitable[None]]
) -> LoadSummary:
    """``spec`` in this process (``processes`` <= 1) or split over that many processes;
    ``on_start()`` is awaited once every generator is connected, just before they start."""
    if processes <= 1:
        return await run_load(spec, on_start)
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "mlx_redis_worker.bench.fleet_load",
            part.encode(),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for part in split(spec, processes)
    ]
    for child in children:
        assert child.stdout is not None and child.stdin is not None
        if (await child.stdout.readline()).strip() != b"ready":
            for other in children:
                if other.returncode is None:
                    other.kill()
            await asyncio.gather(*(other.wait() for other in children))
            raise RuntimeError(f"a load process failed to start (rc {await child.wait()})")
    await on_start()
    for child in children:
        assert child.stdin is not None
        child.stdin.write(b"go\n")
    outputs = await asyncio.gather(*(child.communicate() for child in children))
    parts = []
    for child, (out, _) in zip(children, outputs, strict=True):
        lines = out.decode().strip().splitlines()
        if child.returncode != 0 or not lines:
            raise RuntimeError(f"a load process failed (rc {child.returncode})")
        parts.append(LoadSummary.decode(lines[-1]))
    return LoadSummary.merged(parts)


async def _ready_then_go() -> None:
    """Say this generator is connected, then wait for the word to start."""
    print("ready", flush=True)
    if not await asyncio.to_thread(sys.stdin.readline):
        raise SystemExit("the bench went away before the load started")


def main() -> int:
    spec = LoadSpec(**json.loads(sys.argv[1]))
    summary = asyncio.run(run_load(spec, _ready_then_go))
    print(summary.encode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
