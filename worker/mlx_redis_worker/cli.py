"""The worker's verbs of ``mlx-worker``: run, health, model, bench and demo.

The command itself belongs to the protocol distribution (`mlx_redis_protocol.cli`); this
module is registered in the entry-point group ``mlx_redis_worker.commands`` and adds the
worker's subcommands, each handing its work to its layer.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import mlx_redis_worker  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from mlx_redis_protocol.cli import OperatorError
from mlx_redis_worker.daemon.settings import WorkerSettings, load_settings

Command = Callable[[argparse.Namespace], int]


def add_commands(commands: Any) -> None:
    """Register the worker's subcommands on the ``mlx-worker`` parser's subcommands."""
    _add_model_commands(commands)
    _add_bench_commands(commands)
    _add_daemon_commands(commands)
    _add_demo_command(commands)


def _lazy(module: str, function: str) -> Command:
    """A command whose module is imported only when it runs: most import mlx (a second),
    which submit, stream and ctl never need."""

    def command(args: argparse.Namespace) -> int:
        run: Command = getattr(importlib.import_module(module), function)
        try:
            return run(args)
        except Exception as exc:
            if _is_model_unavailable(exc):
                raise OperatorError(str(exc)) from exc
            raise

    return command


def _add_model_commands(commands: Any) -> None:
    model = commands.add_parser("model", help="prepare offline model fixtures")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser("prepare", help="build an mlx-lm model folder")
    prepare.add_argument(
        "name",
        choices=["smollm2", "smollm2-draft", "tiny", "tiny-vision", "tiny-embed", "minilm"],
    )
    prepare.add_argument("--dtype", choices=["float32", "bfloat16", "q4"], default="float32")
    prepare.add_argument("--arch", choices=["llama", "qwen3"], default="llama")
    prepare.add_argument(
        "--size",
        choices=["micro", "small", "medium", "2b"],
        default="small",
        help="tiny: micro | small | medium; tiny-vision: small | 2b (SmolVLM2-2.2B's shape)",
    )
    prepare.add_argument(
        "--cache-dir", default=None, help="default: ~/.cache/mlx-redis-worker/models"
    )
    prepare.add_argument(
        "--layers",
        type=int,
        default=None,
        help="smollm2-draft: SmolLM2 layers the draft keeps (of 30; default: the measured one)",
    )
    prepare.add_argument("--force", action="store_true", help="rebuild even when present")
    prepare.set_defaults(func=_lazy("mlx_redis_worker.models.prepare", "run_prepare"))


def _add_bench_commands(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks with same-run baselines")
    benches = bench.add_subparsers(dest="bench_command", required=True)

    engine = benches.add_parser("engine", help="engine vs mlx-lm, same load")
    _add_load_flags(engine)
    engine.add_argument(
        "--sequential-max",
        type=int,
        default=32,
        help="skip the sequential baseline above this concurrency",
    )
    engine.add_argument(
        "--skip", default="", help="paths to skip: sequential,batch,sync,async,vllm-mlx"
    )
    engine.add_argument(
        "--against",
        choices=["vllm-mlx"],
        default=None,
        help="also run the async load through vllm-mlx's EngineCore (optional install)",
    )
    engine.add_argument(
        "--prompt-lengths",
        default=None,
        type=_length_range,
        metavar="MIN-MAX",
        help="mixed prompt lengths drawn from MIN..MAX (seeded) instead of --prompt-tokens each",
    )
    engine.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="also run the streamed load with every request asking for N top logprobs a "
        "token, and print its tok/s against the same load without",
    )
    engine.add_argument(
        "--chat-prompts",
        action="store_true",
        help="chat questions through the model's chat template instead of random tokens "
        "(--prompt-tokens and --prompt-lengths then do not apply)",
    )
    engine.add_argument(
        "--temperature",
        type=float,
        default=None,
        metavar="T",
        help="also run the streamed load sampled at temperature T (each request its own "
        "sampler), and print its tok/s against the same load greedy",
    )
    engine.add_argument(
        "--max-prefill-stall",
        type=float,
        default=None,
        help="the engine's SchedulerConfig.max_prefill_stall (default: its own; inf: whole "
        "prefill chunks beside each decode step)",
    )
    engine.set_defaults(func=_lazy("mlx_redis_worker.bench.engine_bench", "run_bench"))

    stall = benches.add_parser(
        "stall",
        help="running streams' inter-token gaps while a long prompt arrives, per prefill bound",
    )
    stall.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or hub id")
    stall.add_argument("--streams", type=int, default=4, help="running streams")
    stall.add_argument(
        "--long", default="2048,26000", help="comma-separated lengths of the long prompt"
    )
    stall.add_argument(
        "--stalls",
        default="inf,1.0",
        help="comma-separated max_prefill_stall values (inf: whole chunks, the old bound)",
    )
    stall.add_argument("--repeat", type=int, default=1, help="rotations of all policies")
    stall.set_defaults(func=_lazy("mlx_redis_worker.bench.stall_bench", "run_stall_bench"))

    e2e = benches.add_parser("e2e", help="Redis + worker + client vs engine alone")
    _add_load_flags(e2e)
    e2e.add_argument("--redis-url", default=None, help="default: MLXW_REDIS_URL or a private one")
    e2e.add_argument(
        "--cluster",
        action="store_true",
        help="also run end to end on a private 3-master Redis Cluster (a second worker)",
    )
    e2e.set_defaults(func=_lazy("mlx_redis_worker.bench.e2e_bench", "run_e2e_bench"))

    prefix = benches.add_parser(
        "prefix", help="TTFT with a shared system prompt: cold, warm, after a restart"
    )
    prefix.add_argument("--model", default="smollm2", help="smollm2 | tiny | a path or hub id")
    prefix.add_argument("--system-tokens", type=int, default=1000)
    prefix.add_argument("--user-tokens", type=int, default=32)
    prefix.add_argument("--requests", type=int, default=5, help="questions per system prompt")
    prefix.add_argument("--rounds", type=int, default=2, help="distinct system prompts")
    prefix.add_argument("--max-tokens", type=int, default=8)
    prefix.add_argument("--restored-from", default=None, help=argparse.SUPPRESS)
    prefix.set_defaults(func=_lazy("mlx_redis_worker.bench.prefix_bench", "run_prefix_bench"))

    publish = benches.add_parser(
        "publish", help="worker CPU per published delta: one script call per step vs per event"
    )
    publish.add_argument("--batch", default="1,8,32,128", help="streams, comma-separated")
    publish.add_argument("--events", type=int, default=4096, help="events per measurement")
    publish.add_argument("--repeat", type=int, default=5, help="rotations of both paths")
    publish.add_argument("--redis-url", default=None, help="default: a private redis-server")
    publish.set_defaults(func=_lazy("mlx_redis_worker.bench.publish_bench", "run_publish_bench"))

    models = benches.add_parser(
        "models", help="two models on one worker vs one worker each: tok/s per model"
    )
    models.add_argument("--models", default="tiny,tiny-qwen3", help="two fixture names or paths")
    models.add_argument("--concurrency", type=int, default=8, help="streams per model")
    models.add_argument("--prompt-tokens", type=int, default=32)
    models.add_argument("--max-tokens", type=int, default=64)
    models.add_argument("--repeat", type=int, default=3, help="rotations of both layouts")
    models.add_argument("--redis-url", default=None, help="default: a private redis-server")
    models.set_defaults(func=_lazy("mlx_redis_worker.bench.models_bench", "run_models_bench"))

    embeddings = benches.add_parser(
        "embeddings", help="the embedding engine vs mlx-embeddings directly: inputs/s"
    )
    embeddings.add_argument("--model", default="minilm", help="an embedding model")
    embeddings.add_argument("--batch", type=int, nargs="+", default=[1, 64], help="batch sizes")
    embeddings.add_argument("--inputs", type=int, default=256, help="texts per measurement")
    embeddings.add_argument("--words", type=int, default=12, help="words per text")
    embeddings.add_argument("--repeat", type=int, default=5, help="rotations of both ways")
    embeddings.set_defaults(
        func=_lazy("mlx_redis_worker.bench.embeddings_bench", "run_embeddings_bench")
    )

    keyspace = benches.add_parser(
        "keyspace", help="stats and submit --model with 1,000,000 unrelated keys vs none"
    )
    keyspace.add_argument("--keys", type=int, default=1_000_000, help="unrelated keys")
    keyspace.add_argument("--samples", type=int, default=20, help="per measure and rotation")
    keyspace.add_argument("--repeat", type=int, default=3, help="rotations of both servers")
    keyspace.set_defaults(func=_lazy("mlx_redis_worker.bench.keyspace_bench", "run_keyspace_bench"))

    fleet = benches.add_parser(
        "fleet",
        help="N simulated workers (the real daemon over an engine stand-in) on one Redis "
        "server or a local Cluster: tokens/s, Redis CPU per token, latencies, control plane",
    )
    fleet.add_argument("--workers", default="10", help="fleet sizes, comma-separated")
    fleet.add_argument("--hosts", type=int, default=2, help="processes the workers run in")
    fleet.add_argument("--topology", default="server,cluster", help="server, cluster or both")
    fleet.add_argument("--masters", default="3", help="Cluster masters, comma-separated")
    fleet.add_argument("--max-concurrency", type=int, default=8, help="each worker's batch")
    fleet.add_argument("--step-ms", type=float, default=50.0, help="the stand-in's step time")
    fleet.add_argument("--requests", type=int, default=200)
    fleet.add_argument("--max-tokens", type=int, default=16, help="tokens per request")
    fleet.add_argument("--rate", type=float, default=50.0, help="submits per second (0: at once)")
    fleet.add_argument(
        "--idle-seconds", type=float, default=5.0, help="idle fleet's Redis CPU sampled this long"
    )
    fleet.add_argument("--no-gateway", action="store_true", help="skip /v1/models, /status.json")
    fleet.add_argument(
        "--read-block-ms", type=int, default=0, help="the workers' XREADGROUP BLOCK (0: default)"
    )
    fleet.add_argument(
        "--duration", type=float, default=0.0, help="submit at --rate this long (not --requests)"
    )
    fleet.add_argument(
        "--saturate",
        action="store_true",
        help="measure saturation first, then load at --load-fraction of it",
    )
    fleet.add_argument("--saturate-seconds", type=float, default=20.0)
    fleet.add_argument(
        "--saturate-in-flight", type=int, default=0, help="requests kept open (0: 1.5x slots)"
    )
    fleet.add_argument("--load-fraction", type=float, default=0.7)
    fleet.add_argument(
        "--reclaim-pending", type=int, default=0, help="time a reclaim sweep of N orphaned jobs"
    )
    fleet.add_argument(
        "--clients", type=int, default=1, help="load generator processes (1: in the bench's)"
    )
    fleet.add_argument(
        "--redis-cpus",
        default="",
        help="CPUs for the Redis nodes (e.g. 0-5, a node each); the rest run everything else",
    )
    fleet.set_defaults(func=_lazy("mlx_redis_worker.bench.fleet_report", "run_fleet_bench"))

    gateway = benches.add_parser(
        "gateway", help="OpenAI gateway vs the protocol client: tok/s and TTFT, same run"
    )
    gateway.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or hub id")
    gateway.add_argument("--concurrency", type=int, default=32, help="streams at once")
    gateway.add_argument("--prompt-tokens", type=int, default=32)
    gateway.add_argument("--max-tokens", type=int, default=64)
    gateway.add_argument("--repeat", type=int, default=3, help="rotations of both paths")
    gateway.add_argument("--redis-url", default=None, help="default: a private redis-server")
    gateway.set_defaults(func=_lazy("mlx_redis_worker.bench.gateway_bench", "run_gateway_bench"))

    fairness = benches.add_parser(
        "fairness", help="three tenants on one worker: fair share vs FIFO, TTFT and tok/s"
    )
    fairness.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or hub id")
    fairness.add_argument("--slots", type=int, default=2, help="the worker's max_concurrency")
    fairness.add_argument("--prompt-tokens", type=int, default=16)
    fairness.add_argument("--bulk-jobs", type=int, default=24, help="queued at once")
    fairness.add_argument("--bulk-tokens", type=int, default=96)
    fairness.add_argument("--steady-jobs", type=int, default=10)
    fairness.add_argument("--steady-tokens", type=int, default=32)
    fairness.add_argument("--steady-every", type=float, default=1.5, help="seconds")
    fairness.add_argument("--interactive-jobs", type=int, default=8)
    fairness.add_argument("--interactive-tokens", type=int, default=8)
    fairness.add_argument("--interactive-every", type=float, default=2.0, help="seconds")
    fairness.add_argument("--repeat", type=int, default=2, help="rotations of both modes")
    fairness.add_argument("--redis-url", default=None, help="default: a private redis-server")
    fairness.set_defaults(func=_lazy("mlx_redis_worker.bench.fairness_bench", "run_fairness_bench"))

    isolation = benches.add_parser(
        "isolation",
        help="a victim tenant's tok/s, TTFT and /health beside each abusive HTTP client",
    )
    isolation.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or hub id")
    isolation.add_argument("--concurrency", type=int, default=8, help="the victim's streams")
    isolation.add_argument("--max-tokens", type=int, default=48)
    isolation.add_argument("--idle-sockets", type=int, default=1000)
    isolation.add_argument("--repeat", type=int, default=1, help="rotations of all attackers")
    isolation.add_argument(
        "--attack-lead",
        type=float,
        default=1.0,
        help="seconds each attack runs before the victim starts (a test's quick run: less)",
    )
    isolation.add_argument(
        "--attackers",
        default=None,
        help="the attackers to run, comma-separated (default: all; e.g. "
        "image-bomb,image-50mb,image-flood)",
    )
    isolation.add_argument(
        "--fair-share",
        action="store_true",
        help="the worker starts jobs by fair share between the keys (tenants), not in order",
    )
    isolation.add_argument(
        "--max-prefill-stall",
        type=float,
        default=None,
        help="the worker's --max-prefill-stall (default: the worker's own)",
    )
    isolation.add_argument("--redis-url", default=None, help="default: a private redis-server")
    isolation.set_defaults(
        func=_lazy("mlx_redis_worker.bench.isolation_bench", "run_isolation_bench")
    )

    scheduler = benches.add_parser(
        "scheduler", help="the engine's own host work per token, model replayed"
    )
    scheduler.add_argument("--model", default="tiny", help="whose tokenizer: tiny | smollm2 | …")
    scheduler.add_argument("--sequences", type=int, default=128)
    scheduler.add_argument("--tokens", type=int, default=256)
    scheduler.add_argument("--repeat", type=int, default=7, help="rotations of all paths")
    scheduler.set_defaults(
        func=_lazy("mlx_redis_worker.bench.scheduler_bench", "run_scheduler_bench")
    )

    structured = benches.add_parser(
        "structured", help="JSON-schema constrained decoding: validity, tok/s, compile time"
    )
    structured.add_argument("--model", default="smollm2", help="smollm2 | tiny | a path or hub id")
    structured.add_argument("--schemas", type=int, default=200, help="size of the schema suite")
    structured.add_argument("--seed", type=int, default=0, help="of the schema suite")
    structured.add_argument("--batch", type=int, default=8, help="requests in flight at once")
    structured.add_argument("--max-tokens", type=int, default=256)
    structured.add_argument("--temperature", type=float, default=0.7)
    structured.add_argument("--repeat", type=int, default=4, help="rotations of both paths")
    hostile = structured.add_argument_group(
        "--hostile", "a victim's tok/s beside a hostile-schema attacker (bench/hostile_bench.py)"
    )
    hostile.add_argument("--hostile", action="store_true", help="run this bench instead")
    hostile.add_argument(
        "--kind",
        default="mixed",
        help="deep_anyof | nested_anyof | long_enum | bounded_repeat | mixed",
    )
    hostile.add_argument("--attackers", type=int, default=2, help="attacker requests in flight")
    hostile.add_argument("--attacker-tokens", type=int, default=16, help="max_tokens of each")
    hostile.add_argument("--fresh", type=int, default=8, help="new schemas per fresh run")
    hostile.add_argument("--head-start", type=float, default=1.0, help="seconds of attack first")
    hostile.add_argument("--max-schema-bytes", type=int, default=None, help="default: the worker's")
    hostile.add_argument("--max-grammar-compile-ms", type=int, default=None)
    hostile.add_argument("--max-mask-us", type=int, default=None)
    structured.set_defaults(
        func=_lazy("mlx_redis_worker.bench.structured_bench", "run_structured_bench")
    )

    tools = benches.add_parser(
        "tools", help="tool calls: do all parse and validate (required, auto)? how often called?"
    )
    tools.add_argument("--model", default="smollm2", help="smollm2 | tiny | a path or hub id")
    tools.add_argument("--schemas", type=int, default=200, help="functions, one per schema")
    tools.add_argument("--seed", type=int, default=0, help="of the schema suite")
    tools.add_argument("--batch", type=int, default=8, help="requests in flight at once")
    tools.add_argument("--max-tokens", type=int, default=256)
    tools.add_argument("--temperature", type=float, default=0.7)
    tools.add_argument(
        "--parallel",
        action="store_true",
        help="let an answer hold several calls (each prompt asks for one: off by default)",
    )
    tools.add_argument(
        "--slice",
        default=None,
        metavar="START:STOP",
        help="run only these schemas of the suite (to split a long run into parts)",
    )
    tools.add_argument(
        "--passes", default="required,auto", help="which passes, comma-separated (required, auto)"
    )
    tools.set_defaults(func=_lazy("mlx_redis_worker.bench.tools_bench", "run_tools_bench"))

    speculative = benches.add_parser(
        "speculative", help="speculative decoding vs plain: batch 1 speedup, batch N tok/s"
    )
    speculative.add_argument("--model", default="smollm2", help="smollm2 | tiny | a path")
    speculative.add_argument("--prompts", type=int, default=6, help="input-grounded prompts")
    speculative.add_argument("--max-tokens", type=int, default=128, help="per batch-1 request")
    speculative.add_argument("--num-draft-tokens", type=int, default=4)
    speculative.add_argument(
        "--method", choices=["prompt_lookup", "draft_model"], default="prompt_lookup"
    )
    speculative.add_argument(
        "--draft-model", default=None, help="with --method draft_model: smollm2-draft | a path"
    )
    speculative.add_argument("--repeat", type=int, default=2, help="rotations at batch 1")
    speculative.add_argument(
        "--batch", type=int, default=32, help="requests added together (0: batch 1 only)"
    )
    speculative.add_argument("--batch-max-tokens", type=int, default=64)
    speculative.set_defaults(
        func=_lazy("mlx_redis_worker.bench.speculative_bench", "run_speculative_bench")
    )

    vision = benches.add_parser(
        "vision", help="image requests: engine vs mlx-vlm one after another and batched"
    )
    vision.add_argument("--model", default="tiny-vision", help="tiny-vision | a folder")
    vision.add_argument("--concurrency", type=int, default=8, help="image requests at once")
    vision.add_argument("--max-tokens", type=int, default=64)
    vision.add_argument("--image-size", default="512x384", help="WIDTHxHEIGHT of each picture")
    vision.add_argument("--repeat", type=int, default=3, help="rotations of the three paths")
    vision.set_defaults(func=_lazy("mlx_redis_worker.bench.vision_bench", "run_vision_bench"))


def _length_range(text: str) -> tuple[int, int]:
    """``MIN-MAX`` with 1 <= MIN <= MAX (``bench engine --prompt-lengths``)."""
    low, sep, high = text.partition("-")
    if sep and low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high):
        return int(low), int(high)
    raise argparse.ArgumentTypeError(f"want MIN-MAX with 1 <= MIN <= MAX, got {text!r}")


def _add_load_flags(bench: argparse.ArgumentParser) -> None:
    """The generation load of the engine and end-to-end benches."""
    bench.add_argument("--model", default="tiny", help="tiny | smollm2 | a path or hub id")
    bench.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    bench.add_argument("--prompt-tokens", type=int, default=32)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--repeat", type=int, default=3, help="rotations of all paths per level")


def _add_daemon_commands(commands: Any) -> None:
    run = commands.add_parser("run", help="run the worker daemon")
    _add_worker_flags(run)
    run.set_defaults(func=_run_worker)
    health = commands.add_parser("health", help="exit 0 when the worker's heartbeat is alive")
    _add_worker_flags(
        health,
        only=("redis_url", "redis_url_file", "redis_topology", "prefix", "worker_id", "config"),
    )
    health.set_defaults(func=_check_health)


def _add_demo_command(commands: Any) -> None:
    demo = commands.add_parser("demo", help="stream a few concurrent generations")
    demo.add_argument("--model", default="smollm2", help="smollm2 | tiny | a path or hub id")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument(
        "--embedded-redis",
        action="store_true",
        help="use the embedded Redis even when a real one is available",
    )
    demo.set_defaults(func=_lazy("mlx_redis_worker.demo", "run_demo"))


WORKER_FLAGS: dict[str, tuple[type, str]] = {
    "model": (
        list,
        "a model to serve, [NAME=]SOURCE with SOURCE a folder, hub id or fixture name (tiny, "
        "smollm2); repeat for several (env: comma-separated)",
    ),
    "default_model": (str, "the model jobs naming none run with (default: the first --model)"),
    "memory_limit_mb": (int, "memory the models may use (default: what the machine has free)"),
    "redis_url": (
        str,
        "redis://[user:password@]host:port/db (a server or any Cluster node), rediss:// for "
        "TLS, or redis+sentinel://host:port[,host:port…]/service_name[/db]",
    ),
    "redis_topology": (str, "auto | standalone | cluster: what a redis:// URL names"),
    "redis_start_timeout": (
        float,
        "seconds to wait at start for Redis to answer, then exit with status 75 for the "
        "service manager to restart the worker (default 60; 0: wait forever)",
    ),
    "allow_eviction": (bool, "run although Redis may evict keys (maxmemory-policy)"),
    "redis_url_file": (
        str,
        "a file (mode 0600) holding the Redis URL, to keep secrets out of argv",
    ),
    "prefix": (str, "key prefix"),
    "worker_id": (str, "consumer name (default: host name + a stable suffix)"),
    "max_concurrency": (int, "jobs running at once (the engine's batch)"),
    "max_schema_bytes": (int, "a job's response_format, as compact JSON (default 131072)"),
    "max_grammar_symbols": (int, "symbols of a job's grammar (default 500000)"),
    "max_grammar_lexer_fuel": (int, "lexer work to build a job's grammar (default 1000000)"),
    "max_mask_items": (int, "Earley items of one token's mask (default 50000)"),
    "max_mask_lexer_fuel": (int, "lexer work of one token's mask (default 200000)"),
    "max_lexer_states": (int, "lexer states one grammar may build (default 50000)"),
    "max_grammar_compile_ms": (int, "safety net: compiling a job's grammar (default 30000)"),
    "max_mask_us": (int, "safety net: one token's mask (default 250000)"),
    "cache_dir": (str, "where cache_save/cache_load keep prefix caches"),
    "lease_seconds": (float, "idle time after which another worker reclaims a job"),
    "fair_share": (bool, "start waiting jobs by fair share between tenants, not in order"),
    "priority_age_seconds": (
        float,
        "with fair share: a job waiting this long goes before its tenant's urgent ones",
    ),
    "max_deliveries": (int, "deliveries before a job is dead-lettered"),
    "dead_letter_maxlen": (int, "dead letters kept (about; the oldest go first)"),
    "drain_timeout": (float, "seconds in-flight jobs get to finish on SIGTERM"),
    "idempotency_seconds": (
        int,
        "how long a finished request id is remembered: a job queued again under it does not "
        "run again (default 86400)",
    ),
    "heartbeat_interval": (float, "seconds between heartbeats"),
    "activity_interval": (float, "seconds between writes of the activity key (status page)"),
    "metrics_port": (int, "serve Prometheus metrics on 127.0.0.1:PORT"),
    "speculative": (
        str,
        "speculative decoding for jobs that do not ask: off, or METHOD[:DRAFT_TOKENS] "
        "(prompt_lookup, prompt_lookup:4, draft_model:4)",
    ),
    "draft_model": (
        str,
        "the draft model of speculative draft_model: a folder, hub id or fixture name "
        "(smollm2-draft); it must share the served models' tokenizer",
    ),
    "max_prefill_stall": (
        float,
        "while sequences decode, prefill takes about this share of the engine's time "
        "(default 0.2: streams keep ~0.8 of their speed beside another tenant's long prompts; "
        "1.0: long prompts beside streams prefill faster; inf: a whole chunk each step)",
    ),
    "media_threads": (int, "threads decoding jobs' images and videos (default 2)"),
    "max_images": (int, "images in one job (default 16)"),
    "max_image_bytes": (int, "one image file (default 20 MiB)"),
    "max_image_pixels": (int, "width x height of an image or video frame (default 32 Mi)"),
    "max_media_bytes": (int, "all media files of one job (default 128 MiB)"),
    "max_video_bytes": (int, "one video file (default 64 MiB)"),
    "max_video_frames": (int, "frames sampled from one video (default 64)"),
    "max_video_seconds": (int, "a video's duration (default 600)"),
    "media_fetch_hosts": (
        str,
        "hosts whose image/video URLs jobs may name, comma-separated (*.example.com: its "
        "subdomains); default none: no URL is fetched",
    ),
    "media_fetch_networks": (
        str,
        "non-public networks (CIDRs) media URLs may resolve to all the same (default none)",
    ),
    "media_fetch_timeout": (float, "seconds one media URL may take (default 10)"),
}


def _add_worker_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    for name, (kind, help_text) in WORKER_FLAGS.items():
        if only is None or name in only:
            flag = "--" + name.replace("_", "-")
            help_text = f"{help_text} (env MLXW_{name.upper()})"
            if kind is bool:  # --NAME and --no-NAME: a flag overrides the config file and env
                parser.add_argument(
                    flag,
                    dest=name,
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
            elif kind is list:
                parser.add_argument(flag, dest=name, action="append", default=None, help=help_text)
            else:
                parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    parser.add_argument(
        "--config",
        default=os.environ.get("MLXW_CONFIG"),
        help="TOML file with the same settings (env MLXW_CONFIG)",
    )


def _worker_settings(args: argparse.Namespace) -> WorkerSettings:
    flags = {name: getattr(args, name, None) for name in WORKER_FLAGS}
    if (models := flags.get("model")) is not None:  # --model repeated: a comma-separated list
        flags["model"] = ",".join(models)
    flags["log_format"] = args.log_format
    flags["log_level"] = args.log_level
    return load_settings(flags, config_file=args.config)


def _run_worker(args: argparse.Namespace) -> int:
    def serve(settings: WorkerSettings) -> int:
        # Imported once the settings are valid: the daemon (and MLX and the engine, which it
        # imports when it loads a model) a mistake in the settings needs none of.
        from mlx_redis_worker.daemon.service import serve

        return serve(settings, debug=args.debug)

    return _with_settings(args, serve)


def _check_health(args: argparse.Namespace) -> int:
    from mlx_redis_worker.daemon.health import check_health

    return _with_settings(args, check_health)


def _with_settings(args: argparse.Namespace, use: Callable[[WorkerSettings], int]) -> int:
    """``use`` the settings of flags, env and TOML; bad settings are a usage error."""
    try:
        settings = _worker_settings(args)
    except (ValueError, OSError) as exc:
        raise OperatorError(f"bad settings: {exc}") from exc
    return use(settings)


def _is_model_unavailable(exc: BaseException) -> bool:
    """A model that cannot be loaded (demo, bench) is the operator's mistake. Its class is
    looked up only once loaded: importing it imports mlx (a second), which submit, stream and
    ctl never need."""
    loading = sys.modules.get("mlx_redis_worker.models.loading")
    return loading is not None and isinstance(exc, loading.ModelUnavailable)
