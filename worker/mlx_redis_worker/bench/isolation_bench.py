"""``mlx-worker bench isolation``: what one abusive HTTP client costs another tenant.

One Redis (a private redis-server unless ``--redis-url``), one worker and one gateway with
API keys: a **victim** key without limits and an **attacker** key (30 requests a minute, 4
at once); the worker has a slot for each victim stream and each of the attacker's requests.
Each phase runs the victim's load (``--concurrency`` greedy streams of
``--max-tokens`` through ``POST /v1/completions``, one rotation's prompts) while one attacker
runs beside it, or none (the baseline); a prober asks ``/health`` every 0.1 s throughout.
Phases alternate with baselines (base, A, base, B, …, base), so each attacker's ratio is
against the baselines on either side of it, in the same run.

Each attacker (``attackers``: huge header, huge body, read flood, resume flood, hostile schema,
idle sockets, keep-alive sockets from 500 addresses, bodies just under 4 MiB with a key, 48
agent tools, the image attackers: image bombs, 50 MB images, image floods, and long uncached
prompts inside the key's quota: about 2,300 tokens 4 at once, about 26k one at a time;
``--attackers`` picks some) is a process of its own at the lowest CPU priority, under a fresh
key of the attacker's quota (the resume flood under the attacker key, whose finished request it
resumes), connecting from an address of its own (127.0.0.2, 127.0.0.3, …: one per attack
phase), standing for a client on another host: the bench measures what its requests cost the
gateway, Redis and the worker, not what sending them costs the attacker. Reported per attacker:
the victim's tok/s, TTFT p50 and inter-token p99 (the gap between two of a stream's events with
text, over all its streams) as ratios to the baselines (goals: tok/s ≥ 0.8, inter-token p99 ≤
2.5), ``/health`` p99 (goal < 1 s), the cores the gateway, Redis (when the bench started it),
the worker and the attacker used (Linux), how many exchanges a second the attacker made, and
what it got back (statuses, and how many of its streams it read to the end).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from mlx_redis_gateway.api_keys import add_key
from mlx_redis_protocol.client import Client
from mlx_redis_worker.bench.attackers import (
    ATTACKER_MAX_CONCURRENT,
    attacks,
    bindable,
    get,
    source,
)
from mlx_redis_worker.bench.e2e_bench import pct
from mlx_redis_worker.bench.engine_bench import make_prompts
from mlx_redis_worker.bench.gateway_bench import MODEL_NAME, Stream, _Connections, _gateway
from mlx_redis_worker.bench.gateway_bench import _gateway_ready as gateway_ready
from mlx_redis_worker.bench.long_prompts import LONG_PROMPT_ATTACKS, QUOTA_PER_MINUTE, filler_text
from mlx_redis_worker.bench.worker_process import start_worker, stop_worker, wait_ready
from mlx_redis_worker.local_redis import free_port, local_redis
from mlx_redis_worker.models import load_model

# Attacks run under the attacker key itself (the resume flood resumes that key's finished
# request); every other attack phase gets a fresh key of the same quota (``Bench.phase_keys``).
ATTACKER_KEY_PHASES = frozenset({"resume-flood"})
TOKENS_GOAL = 0.8  # victim tok/s under attack / alone
GAP_GOAL = 2.5  # victim inter-token p99 under attack / alone
HEALTH_GOAL_S = 1.0  # /health p99
HEALTH_TIMEOUT = 5.0  # a /health that takes longer counts as this
ATTACK_LEAD_SECONDS = 1.0  # the attack under way before the victim starts (--attack-lead)
# A victim phase not done by then is stopped and counted as starved (0 tok/s): one attacker
# that holds the victim off for minutes (a prefill of 4 x 30k tokens on a CPU) gives its
# verdict, and the run goes on to the next attacker instead of failing at the gateway's 600 s.
VICTIM_PHASE_TIMEOUT = 300.0
# After an attack phase, the bench waits (up to this) until the worker holds no job: the next
# baseline measures the victim alone, not beside the attacker's aborted work still running.
SETTLE_TIMEOUT = 180.0


@dataclass(slots=True)
class Phase:
    attacker: str  # "" for a baseline
    tokens_per_second: float
    ttft_p50: float
    health: list[float]  # seconds per /health answer (HEALTH_TIMEOUT for one that failed)
    statuses: Counter[str] = field(default_factory=Counter)
    # Cores used over the phase (CPU seconds / wall seconds); None where not measured.
    gateway_cores: float | None = None
    redis_cores: float | None = None
    worker_cores: float | None = None
    attacker_cores: float | None = None
    exchanges_per_second: float = 0.0  # the attacker's requests (or connections) answered
    gap_p99: float = 0.0  # seconds between two of a victim stream's events with text, p99
    finished: int = 0  # the attacker's streams read to their end
    starved: bool = False  # the victim's streams were not done in VICTIM_PHASE_TIMEOUT
    # Seconds the worker still held jobs after the attacker left (its aborts taking effect).
    settle_seconds: float = 0.0


class Attacker:
    """One attacker process (``attackers``), started for a phase and stopped at its end."""

    def __init__(
        self,
        name: str,
        port: int,
        key: str,
        own_request: str,
        idle: int,
        address: str,
        prompt_file: str = "",
    ) -> None:
        command = [sys.executable, "-m", "mlx_redis_worker.bench.attackers", name]
        command += ["--port", str(port), "--key", key, "--own-request", own_request]
        command += ["--source", address, "--prompt-file", prompt_file]
        command += ["--idle-sockets", str(idle), "--model", MODEL_NAME]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE)

    def wait_ready(self) -> None:
        """Until its attack is under way (an image attacker builds its files first)."""
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if json.loads(line or b"{}").get("ready") is not True:
            raise RuntimeError(f"the attacker did not start (exit {self.process.poll()})")

    def stop(self) -> dict[str, Any]:
        """Its report: statuses, exchanges, CPU seconds."""
        # It attacks at the lowest priority (SCHED_IDLE: only CPU nobody else wants); on a
        # machine kept busy (a test run beside others) it would get none to stop and report
        # in, and the bench failed after 60 s. Its stop runs at the ordinary priority.
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(self.process.pid, os.SCHED_OTHER, os.sched_param(0))
        self.process.terminate()
        out, _ = self.process.communicate(timeout=60)
        lines = out.decode().strip().splitlines()
        if self.process.returncode != 0 or not lines:
            raise RuntimeError(f"the attacker failed (exit {self.process.returncode})")
        report: dict[str, Any] = json.loads(lines[-1])
        return report


def _cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU seconds so far (Linux's /proc; None elsewhere)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _probe_health(port: int, seconds: list[float]) -> None:
    while True:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(get("/health", "").encode())
                status = await reader.readline()
                await reader.read()
                writer.close()
            ok = status.split(b" ", 2)[1:2] == [b"200"]
            seconds.append(time.perf_counter() - start if ok else HEALTH_TIMEOUT)
        except (TimeoutError, OSError):
            seconds.append(HEALTH_TIMEOUT)
        await asyncio.sleep(0.1)


@dataclass(slots=True)
class Bench:
    """What every phase runs against: the gateway's port, the processes whose CPU is
    counted, the attacker's key and finished request, the victim's connections."""

    port: int
    gateway_pid: int
    redis_pid: int | None  # None: a Redis the bench did not start (its CPU is not counted)
    worker_pid: int
    attacker_key: str
    victim: _Connections
    max_tokens: int
    idle_sockets: int
    own_request: str = ""
    attacks_run: int = 0  # numbers each attack phase's source address
    attackers: tuple[str, ...] = ()  # the attacks to run, in order (``attacks``' names)
    # A fresh key (the attacker's quota) for each attack phase but the resume flood's, so that
    # one phase's use of the quota does not turn the next phase's tenant, inside its own
    # quota, into one refused (429): the logprobs fanout got 429 x5 and nothing else after
    # the nested-anyof phase had spent the shared key's 30 a minute.
    phase_keys: list[str] = field(default_factory=list)
    prompt_files: dict[str, str] = field(default_factory=dict)  # long-prompt attack: its text
    # Waits until the worker holds no job; returns the seconds it waited.
    settle: Callable[[], Awaitable[float]] | None = None
    attack_lead: float = ATTACK_LEAD_SECONDS  # the attack under way before the victim starts


async def _phase(bench: Bench, attack: str, prompts: list[str]) -> Phase:
    """The victim's streams, with ``attack`` running beside them ("" for none)."""
    health: list[float] = []
    prober = asyncio.create_task(_probe_health(bench.port, health))
    attacker = None
    if attack:
        attacker = Attacker(
            attack,
            bench.port,
            bench.attacker_key if attack in ATTACKER_KEY_PHASES else bench.phase_keys.pop(),
            bench.own_request,
            bench.idle_sockets,
            source(bench.attacks_run),
            bench.prompt_files.get(attack, ""),
        )
        bench.attacks_run += 1
        await asyncio.to_thread(attacker.wait_ready)
        await asyncio.sleep(bench.attack_lead)
    pids = [bench.gateway_pid, bench.redis_pid, bench.worker_pid]
    cpu_before = [_cpu_seconds(pid) for pid in pids]
    report: dict[str, Any] = {}
    try:
        start = time.perf_counter()
        streams: list[Stream] = []
        with contextlib.suppress(TimeoutError):  # starved: no streams
            streams = await asyncio.wait_for(
                asyncio.gather(*(_gateway(bench.victim, p, bench.max_tokens) for p in prompts)),
                VICTIM_PHASE_TIMEOUT,
            )
        seconds = time.perf_counter() - start
        cpu_after = [_cpu_seconds(pid) for pid in pids]
    finally:
        prober.cancel()
        await asyncio.gather(prober, return_exceptions=True)
        if attacker is not None:
            report = await asyncio.to_thread(attacker.stop)
    settled = await bench.settle() if attacker is not None and bench.settle else 0.0
    gateway, redis, worker = (
        (after - before) / seconds if before is not None and after is not None else None
        for before, after in zip(cpu_before, cpu_after, strict=True)
    )
    attacked = seconds + bench.attack_lead  # the attacker ran a little longer than this
    return Phase(
        _display(attack, bench.idle_sockets),
        sum(s.tokens for s in streams) / seconds,
        statistics.median(s.ttft for s in streams) if streams else seconds,
        health,
        Counter(report.get("statuses", {})),
        gateway_cores=gateway,
        redis_cores=redis,
        worker_cores=worker,
        attacker_cores=report["cpu_seconds"] / attacked if report else None,
        exchanges_per_second=report.get("exchanges", 0) / attacked,
        gap_p99=_gap_p99(streams) if streams else seconds,
        finished=report.get("finished", 0),
        starved=not streams,
        settle_seconds=settled,
    )


async def _measure(bench: Bench, prompts: list[list[str]], repeat: int) -> list[Phase]:
    attacker = _Connections(bench.port, headers=f"Authorization: Bearer {bench.attacker_key}\r\n")
    try:
        bench.own_request = (await _gateway(attacker, prompts[0][0], 4)).request_id
        await _phase(bench, "", prompts[0])  # warm-up
        phases: list[Phase] = []
        batch = iter(prompts[1:])
        for _ in range(repeat):
            for name in bench.attackers:
                phases.append(await _phase(bench, "", next(batch)))
                _progress(phases[-1])
                phases.append(await _phase(bench, name, next(batch)))
                _progress(phases[-1])
        phases.append(await _phase(bench, "", next(batch)))
        _progress(phases[-1])
        return phases
    finally:
        bench.victim.close()
        attacker.close()


async def _settle(client: Client, worker_id: str) -> float:
    """Wait until the worker holds no job (its ``stats``), at most ``SETTLE_TIMEOUT``; the
    seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE_TIMEOUT:
        replies = await client.stats(worker_id=worker_id, timeout=5.0)
        result = replies[0].result if replies else None
        if result is not None and not result["jobs"]["in_flight"]:
            break
        await asyncio.sleep(0.25)
    return time.perf_counter() - start


def _gap_p99(streams: list[Stream]) -> float:
    """The p99 of the gaps between the victim's events with text (0 where none had two)."""
    gaps = [gap for stream in streams for gap in stream.gaps]
    return pct(gaps, 0.99) if gaps else 0.0


def _ratio(value: float, alone: float) -> float:
    """``value`` over ``alone``; where alone is 0 (no gaps to measure), 1 for 0, else inf."""
    if alone > 0:
        return value / alone
    return 1.0 if value == 0 else float("inf")


def _progress(phase: Phase) -> None:
    """One line on stderr per phase: a long run shows where it is, and a phase that went
    wrong can be told from its neighbours."""
    print(
        f"{time.strftime('%H:%M:%S')} {phase.attacker or 'alone'}: "
        f"{phase.tokens_per_second:.0f} tok/s, TTFT p50 {phase.ttft_p50 * 1e3:.0f} ms, "
        f"inter-token p99 {phase.gap_p99 * 1e3:.0f} ms"
        + (f", worker idle {phase.settle_seconds:.1f} s later" if phase.attacker else ""),
        file=sys.stderr,
        flush=True,
    )


def _display(attack: str, idle_sockets: int) -> str:
    """An attacker's name in the table: ``huge header``, ``1000 idle sockets``."""
    if attack == "idle-sockets":
        return f"{idle_sockets} idle sockets"
    return attack.replace("-", " ")


def _cores(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if known else "–"


def format_isolation(phases: list[Phase]) -> str:
    rows, met = [], True
    names = list(dict.fromkeys(p.attacker for p in phases if p.attacker))
    bases = [p for p in phases if not p.attacker]
    base_health = [s for p in bases for s in p.health]
    rows.append(
        f"| alone (baselines) | 1.00 | 1.00 | 1.00 | {pct(base_health, 0.99) * 1e3:.0f} | "
        f"{_cores([p.gateway_cores for p in bases])} | {_cores([p.redis_cores for p in bases])} | "
        f"{_cores([p.worker_cores for p in bases])} | | | |"
    )
    for name in names:
        tokens, ttft, gaps, health, statuses = [], [], [], [], Counter[str]()
        attacked: list[Phase] = []
        for i, phase in enumerate(phases):
            if phase.attacker != name:
                continue
            attacked.append(phase)
            before, after = phases[i - 1], phases[i + 1]
            tokens.append(
                phase.tokens_per_second
                / statistics.mean([before.tokens_per_second, after.tokens_per_second])
            )
            ttft.append(phase.ttft_p50 / statistics.mean([before.ttft_p50, after.ttft_p50]))
            gaps.append(_ratio(phase.gap_p99, statistics.mean([before.gap_p99, after.gap_p99])))
            health += phase.health
            statuses.update(phase.statuses)
        p99 = pct(health, 0.99)
        met = met and statistics.median(tokens) >= TOKENS_GOAL and p99 < HEALTH_GOAL_S
        met = met and statistics.median(gaps) <= GAP_GOAL
        answers = ", ".join(f"{status} ×{count}" for status, count in statuses.most_common(4))
        finished = sum(p.finished for p in attacked)
        starved = sum(p.starved for p in attacked)
        busy = max(p.settle_seconds for p in attacked)
        notes = [
            answers or "no answer",
            f"finished ×{finished}" if finished else "",
            f"victim not done in {VICTIM_PHASE_TIMEOUT:.0f} s ×{starved}" if starved else "",
            f"worker busy {busy:.0f} s after it left" if busy >= 1 else "",
        ]
        got = "; ".join(note for note in notes if note)
        rate = statistics.median(p.exchanges_per_second for p in attacked)
        rows.append(
            f"| {name} | {statistics.median(tokens):.2f} | {statistics.median(ttft):.2f} | "
            f"{statistics.median(gaps):.2f} | "
            f"{p99 * 1e3:.0f} | {_cores([p.gateway_cores for p in attacked])} | "
            f"{_cores([p.redis_cores for p in attacked])} | "
            f"{_cores([p.worker_cores for p in attacked])} | "
            f"{_cores([p.attacker_cores for p in attacked])} | {rate:.0f} | {got} |"
        )
    alone = statistics.median(p.tokens_per_second for p in bases)
    gap_alone = statistics.median(p.gap_p99 for p in bases)
    return "\n".join(
        [
            f"victim alone: {alone:.0f} tok/s, inter-token p99 {gap_alone * 1e3:.0f} ms "
            "(medians of baselines)",
            "",
            "| attacker | victim tok/s ratio | victim TTFT p50 ratio | "
            "victim inter-token p99 ratio | /health p99 ms | "
            "gateway cores | Redis cores | worker cores | attacker cores | "
            "attacker exchanges/s | attacker got |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            *rows,
            "",
            f"goals: victim tok/s ≥ {TOKENS_GOAL} × alone, inter-token p99 ≤ {GAP_GOAL} × "
            f"alone and /health p99 < {HEALTH_GOAL_S * 1e3:.0f} ms under every attacker: "
            f"{'met' if met else 'NOT met'}",
        ]
    )


def _redis_pid(url: str) -> int:
    with redis.Redis.from_url(url) as plain:
        return int(plain.info("server")["process_id"])


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
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the gateway's too (inherited)
    tokenizer = load_model(args.model)[1]
    chosen = tuple(attacks(0)) if args.attackers is None else tuple(args.attackers.split(","))
    unknown = sorted(set(chosen) - set(attacks(0)))
    if unknown:
        raise SystemExit(f"unknown attackers {', '.join(unknown)}: {', '.join(attacks(0))}")
    phases = 2 + args.repeat * 2 * len(chosen)
    prompts = [
        [tokenizer.decode(p) for p in make_prompts(tokenizer, args.concurrency, 32, seed=i)]
        for i in range(phases)
    ]
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as directory:
        url, what = stack.enter_context(local_redis(args.redis_url))
        prefix = f"bench{uuid.uuid4().hex[:8]}"
        keys = Path(directory) / "keys.toml"
        victim = add_key(keys, "victim", requests_per_minute=None, max_concurrent=None)
        attacker = add_key(
            keys,
            "attacker",
            requests_per_minute=QUOTA_PER_MINUTE,
            max_concurrent=ATTACKER_MAX_CONCURRENT,
        )
        fresh_phases = args.repeat * sum(name not in ATTACKER_KEY_PHASES for name in chosen)
        phase_keys = [
            add_key(
                keys,
                f"attacker{index}",
                requests_per_minute=QUOTA_PER_MINUTE,
                max_concurrent=ATTACKER_MAX_CONCURRENT,
            )
            for index in range(fresh_phases)
        ]
        prompt_files = {}
        for name in set(chosen) & set(LONG_PROMPT_ATTACKS):
            path = Path(directory) / f"{name}.txt"
            text = filler_text(tokenizer, LONG_PROMPT_ATTACKS[name][0])
            path.write_text(text)
            prompt_files[name] = str(path)
            print(f"{name}: prompts of {len(tokenizer.encode(text))} tokens and a salt")
        fair: tuple[str, ...] = ("--fair-share",) if args.fair_share else ()
        if args.max_prefill_stall is not None:
            fair += ("--max-prefill-stall", str(args.max_prefill_stall))
            print(f"worker: --max-prefill-stall {args.max_prefill_stall}")
        # Slots for the victim's streams and the attacker's cap: what is measured is what one
        # tenant's work costs another's steps (prefill, grammar, media, HTTP), not a queue the
        # attacker's long requests fill first (fair share's question: --fair-share).
        slots = args.concurrency + ATTACKER_MAX_CONCURRENT
        worker = start_worker(
            url, prefix, f"{prefix}-worker", [f"{MODEL_NAME}={args.model}"], slots, *fair
        )
        stack.callback(stop_worker, worker.process)
        port = free_port()
        log = os.path.join(tempfile.gettempdir(), f"mlxw-{prefix}-gateway.log")
        gateway = _start_gateway(url, prefix, port, keys, log)
        stack.callback(stop_worker, gateway)
        print(f"Redis: {what}; logs: {worker.log_path}, {log}")
        print(
            f"each attack phase connects from an address of its own ({source(0)}, "
            f"{source(1)}, …), the victim from 127.0.0.1"
            if bindable(source(0))
            else f"attackers connect from 127.0.0.1, as the victim does ({source(0)} cannot be "
            "bound here: the gateway's per-address cool-down then turns the victim away too)"
        )

        async def run() -> list[Phase]:
            async with Client(url, prefix=prefix) as client:
                await wait_ready(client, [worker])
                await gateway_ready(port, gateway)
                return await measure(client)

        async def measure(client: Client) -> list[Phase]:
            victim_connections = _Connections(port, headers=f"Authorization: Bearer {victim}\r\n")
            bench = Bench(
                port,
                gateway.pid,
                _redis_pid(url) if what.startswith("a private") else None,
                worker.process.pid,
                attacker,
                victim_connections,
                args.max_tokens,
                args.idle_sockets,
                attackers=chosen,
                phase_keys=phase_keys,
                prompt_files=prompt_files,
                settle=functools.partial(_settle, client, worker.worker_id),
                attack_lead=args.attack_lead,
            )
            return await _measure(bench, prompts, args.repeat)

        results = asyncio.run(run())
        # Before the teardown: a worker still busy with an attacker's long prompts may not
        # stop in time, and the table must not be lost with it.
        print(format_isolation(results), flush=True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return 0
