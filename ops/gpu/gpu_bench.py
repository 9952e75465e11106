"""Decode throughput of our engine against raw mlx-lm BatchGenerator on an NVIDIA GPU
(MLX's CUDA backend), with random-weight models of real shapes built on the device.

For each shape: bf16 weights; decode tokens/s at each batch size for raw ``BatchGenerator``, for
``EngineCore.generate_batch_sync`` (which also detokenizes every token) and for the daemon's
streamed path (``add_request`` + ``stream_outputs``, one output per token), and for the daemon's
own streaming path (``add_request(collect=False)`` + one step listener call per engine step, as
the worker's publisher gets them); the engine's own host
time per token (its step time outside ``BatchGenerator.next``, from ``stats()``), which is
what separates it from raw when a step is host-bound; and the batch-1 step time against the
memory-bandwidth floor (weight bytes / measured copy bandwidth).
Run by ops/gpu/run.sh on the lent machine; prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

import mlx_redis_worker  # noqa: F401  (OpenBLAS on CPU; harmless on GPU)
from mlx_redis_worker.bench.engine_bench import engine_host_us
from mlx_redis_worker.engine import EngineConfig, EngineCore, SamplingParams, SchedulerConfig

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B-like, Qwen2.5-1.5B-like and Llama-3-8B-like dimensions (llama blocks).
    "0.5B": dict(
        hidden_size=896,
        num_hidden_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "1.5B": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    "smoke": dict(
        hidden_size=256,
        num_hidden_layers=2,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
    ),
    "8B": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
}


def copy_bandwidth(gib: float = 4) -> float:
    """Bytes read + written per second by a large device-to-device copy (median of 10)."""
    x = mx.random.uniform(shape=(int(gib * (1 << 30)) // 2 // 4096, 4096)).astype(mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        y = x + 1
        mx.eval(y)
        mx.synchronize()
        times.append(time.perf_counter() - start)
        del y
    times = sorted(times[2:])
    return 2 * x.nbytes / times[len(times) // 2]


def word_tokenizer(vocab_size: int) -> TokenizerWrapper:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="w1", unk_token="w0")
    # The streaming detokenizer real (byte-level BPE) models get: cheap per token.
    return TokenizerWrapper(fast, BPEStreamingDetokenizer, eos_token_ids=[1])


def build_model(shape: dict[str, Any]) -> tuple[Any, int]:
    args = llama.ModelArgs(
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **shape,
    )
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return model, weight_bytes


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    key = mx.random.key(seed)
    ids = mx.random.randint(2, vocab, shape=(batch, length), key=key)
    return ids.tolist()


def raw_decode(model: Any, batch: list[list[int]], max_tokens: int) -> float:
    """Decode tokens/s: tokens after each sequence's first, over first token -> last."""
    generator = BatchGenerator(
        model, stop_tokens=[[1]], completion_batch_size=len(batch), prefill_batch_size=len(batch)
    )
    start = time.perf_counter()
    generator.insert(batch, [max_tokens] * len(batch))
    first = None
    tokens = 0
    remaining = len(batch)
    steps = 0
    stamps: list[float] = []
    cpu = time.thread_time()
    while remaining:
        began = time.perf_counter()
        _, responses = generator.next()
        steps += 1
        if TRACING:
            TRACING[-1].append((began, time.perf_counter() - began, len(responses), 0, 0))
        if responses:
            stamps.append(time.perf_counter())
        if responses and first is None:
            first = stamps[-1]
            tokens -= len(responses)
        tokens += len(responses)
        remaining -= sum(r.finish_reason is not None for r in responses)
    mx.synchronize()
    generator.close()
    assert first is not None
    end = time.perf_counter()
    LAST_RUN.update(
        steps=steps,
        e2e_tok_s=(tokens + len(batch)) / (end - start),
        step_ms=_median_step_ms(stamps),
        cpu_us=(time.thread_time() - cpu) / max(tokens, 1) * 1e6,
    )
    return tokens / (end - first)


def _median_step_ms(stamps: list[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return _median(gaps) * 1e3 if gaps else float("nan")


# What the last run measured beside its rate: steps taken (raw: ``next()`` calls; engine:
# its thread's steps), the median time between steps that yielded tokens (raw and daemon path
# only: where the benchmark sees every step), host CPU µs per token (raw: the calling thread;
# engine: its thread).
LAST_RUN: dict[str, float] = {}
# While a trace runs, its steps: (start, seconds, outputs, decoding rows, rows in prefill);
# raw: one per ``next()``, engine: one per scheduler step (on the engine thread).
Step = tuple[float, float, int, int, int]
TRACING: list[list[Step]] = []


class StepClock:
    """While installed, every scheduler step of ``engine`` is timed into ``TRACING[-1]``: a
    wrapper around its scheduler's ``step`` (one clock read and two attribute reads a step)."""

    def __init__(self, engine: EngineCore) -> None:
        self.scheduler = engine.scheduler
        self.step = self.scheduler.step

    def traced(self) -> Any:
        scheduler = self.scheduler
        began = time.perf_counter()
        output = self.step()
        generator = scheduler._generator  # the benchmark's look inside
        decoding = generator.num_decoding if generator is not None else 0
        prefilling = generator.num_prefilling if generator is not None else 0
        seconds = time.perf_counter() - began
        TRACING[-1].append((began, seconds, len(output.outputs), decoding, prefilling))
        return output

    def __enter__(self) -> StepClock:
        TRACING.append([])
        self.scheduler.step = self.traced  # type: ignore[method-assign]
        return self

    def __exit__(self, *_: object) -> None:
        del self.scheduler.step


def _median_period_ms(steps: list[Step]) -> float:
    """The median time from one step's start to the next one's."""
    return _median_step_ms([step[0] for step in steps])


def own_host_time(
    path: Any, engine: EngineCore, batch: list[list[int]], max_tokens: int
) -> tuple[float, float]:
    """``path``'s tokens/s and the engine's own host µs per generated token meanwhile."""
    before = engine.stats()
    LAST_RUN.clear()
    with StepClock(engine):
        rate: float = path(engine, batch, max_tokens)
    steps = TRACING.pop()
    after = engine.stats()
    tokens = after.scheduler.total_completion_tokens - before.scheduler.total_completion_tokens
    LAST_RUN.update(
        steps=after.steps_executed - before.steps_executed,
        cpu_us=(after.engine_thread_cpu_seconds - before.engine_thread_cpu_seconds)
        / max(tokens, 1)
        * 1e6,
    )
    LAST_RUN.setdefault("step_ms", float("nan"))
    LAST_RUN["period_ms"] = _median_period_ms(steps)
    return rate, engine_host_us(before, after)


def engine_decode(engine: EngineCore, batch: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    outputs = engine.generate_batch_sync(
        batch, SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    end = time.perf_counter()
    first = min(o.ttft for o in outputs if o.ttft is not None)
    tokens = sum(o.completion_tokens - 1 for o in outputs)
    LAST_RUN["e2e_tok_s"] = (tokens + len(batch)) / (end - start)
    return tokens / (end - start - first)


def engine_stream_decode(engine: EngineCore, batch: list[list[int]], max_tokens: int) -> float:
    """The daemon's path: add_request + stream_outputs, an output for every token."""

    async def scenario() -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        first: list[float] = []
        tokens = 0

        async def consume(request_id: str) -> None:
            nonlocal tokens
            async for output in engine.stream_outputs(request_id):
                if output.new_token_ids:
                    if not first:
                        first.append(time.perf_counter())
                    tokens += len(output.new_token_ids)

        start = time.perf_counter()
        ids = [await engine.add_request(prompt, params) for prompt in batch]
        await asyncio.gather(*(consume(request_id) for request_id in ids))
        end = time.perf_counter()
        LAST_RUN["e2e_tok_s"] = tokens / (end - start)
        # The engine thread stays up between runs, as it does in service.
        return (tokens - len(batch)) / (end - first[0])

    return asyncio.run(scenario())


def engine_listener_decode(engine: EngineCore, batch: list[list[int]], max_tokens: int) -> float:
    """The worker daemon's path: no per-request collector; every step's outputs reach one
    step listener on the event loop (the publisher's hook)."""

    async def scenario() -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        first: list[float] = []
        counts = {"tokens": 0, "finished": 0}
        done = asyncio.Event()

        def on_step(outputs: list[Any]) -> None:
            first.append(time.perf_counter())
            for output in outputs:
                counts["tokens"] += len(output.new_token_ids)
                counts["finished"] += output.finished
            if counts["finished"] == len(batch):
                done.set()

        engine.set_step_listener(on_step)
        start = time.perf_counter()
        try:
            for prompt in batch:
                await engine.add_request(prompt, params, collect=False)
            await done.wait()
        finally:
            engine.set_step_listener(None)
        end = time.perf_counter()
        LAST_RUN["step_ms"] = _median_step_ms(first)
        LAST_RUN["e2e_tok_s"] = counts["tokens"] / (end - start)
        return (counts["tokens"] - len(batch)) / (end - first[0])

    return asyncio.run(scenario())


ENGINE_PATHS: dict[str, Any] = {
    "engine": engine_decode,
    "stream": engine_stream_decode,
    "listener": engine_listener_decode,
}
PATHS = ("raw", *ENGINE_PATHS)


def profile_runs(
    model: Any, engine: EngineCore, batch: list[list[int]], max_tokens: int
) -> dict[str, list[str]]:
    """One raw and one ``generate_batch_sync`` run under cProfile (enabled on the thread that
    runs each: the engine's through a command; the caller only waits meanwhile), the top
    functions by own time."""
    import cProfile
    import io
    import pstats

    def top(profile: cProfile.Profile, label: str) -> list[str]:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        lines = [line for line in text.getvalue().splitlines() if line.strip()]
        print(f"--- profile: {label}", *lines, sep="\n", flush=True)
        return lines

    out = {}
    mx.clear_cache()
    profile = cProfile.Profile()
    profile.enable()
    raw_decode(model, batch, max_tokens)
    profile.disable()
    out["raw"] = top(profile, "raw BatchGenerator")
    mx.clear_cache()
    profile = cProfile.Profile()
    thread = engine._engine_thread  # the benchmark's look inside: profile the engine thread
    thread.call_sync(lambda _: profile.enable())
    engine_decode(engine, batch, max_tokens)
    thread.call_sync(lambda _: profile.disable())
    out["engine"] = top(profile, "engine generate_batch_sync (engine thread)")
    return out


def trace_runs(
    model: Any, engine: EngineCore, batch: list[list[int]], max_tokens: int
) -> dict[str, dict[str, Any]]:
    """One more raw, ``generate_batch_sync`` and daemon-path run with every step timed (the
    engine's by a wrapper around its scheduler's ``step``: one clock read a step): which
    steps the paths spend their time in, beyond the median step."""
    out = {}
    for label in PATHS:
        if label == "stream":
            continue
        mx.clear_cache()
        if label == "raw":
            TRACING.append([])
            rate = raw_decode(model, batch, max_tokens)
        else:
            with StepClock(engine):
                rate = ENGINE_PATHS[label](engine, batch, max_tokens)
        steps = TRACING.pop()
        start = steps[0][0]
        seconds = sorted(s[1] for s in steps)
        summary = {
            "tok_s": rate,
            "steps": len(steps),
            "median_ms": _median(seconds) * 1e3,
            "sum_ms": sum(seconds) * 1e3,
            "span_ms": (steps[-1][0] + steps[-1][1] - start) * 1e3,
            # (ms from the first step's start, ms, outputs, decoding, prefilling) a step
            "steps_ms": [
                (round((b - start) * 1e3, 2), round(d * 1e3, 2), n, dec, pre)
                for b, d, n, dec, pre in steps
            ],
        }
        longest = sorted(range(len(steps)), key=lambda i: -steps[i][1])[:6]
        worst = [(i, summary["steps_ms"][i]) for i in longest]
        print(
            f"--- trace {label}: {rate:.0f} tok/s, {len(steps)} steps, median"
            f" {summary['median_ms']:.2f} ms, sum {summary['sum_ms']:.1f} ms, span"
            f" {summary['span_ms']:.1f} ms; first 4: {summary['steps_ms'][:4]}; last 3:"
            f" {summary['steps_ms'][-3:]}; longest: {worst}",
            flush=True,
        )
        out[label] = summary
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5B,1.5B,8B")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--copy-gib", type=float, default=4.0)
    parser.add_argument(
        "--trace-batch",
        type=int,
        default=0,
        help="after this batch's rotations, one more raw, sync and daemon-path run with every"
        " step timed",
    )
    parser.add_argument(
        "--profile-batch",
        type=int,
        default=0,
        help="after this batch's rotations, one more raw and one more generate_batch_sync run"
        " under cProfile: the top functions by own time (host time, inflated by profiling)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (s) for the whole run: how long the event loop's thread may"
        " wait for the GIL the engine thread holds (CPython's default 0.005)",
    )
    parser.add_argument(
        "--max-prefill-pass",
        type=float,
        default=None,
        help="SchedulerConfig.max_prefill_pass (s; 0: whole chunks): how long a prefill pass"
        " with nothing decoding may take, so how many groups a burst's prompts start in",
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(f"device {mx.default_device()}, {json.dumps(mx.device_info())}", flush=True)
    bandwidth = copy_bandwidth(args.copy_gib)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for name in args.shapes.split(","):
        model, weight_bytes = build_model(SHAPES[name])
        tokenizer = word_tokenizer(SHAPES[name]["vocab_size"])
        batches = [int(b) for b in args.batches.split(",")]
        config = SchedulerConfig(
            max_num_seqs=max(batches), prefill_batch_size=max(batches), enable_prefix_cache=False
        )
        if args.max_prefill_pass is not None:
            config = replace(config, max_prefill_pass=args.max_prefill_pass)
        engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
        warm = prompts(2, args.prompt_tokens, SHAPES[name]["vocab_size"], 0)
        raw_decode(model, warm, 8)
        engine_decode(engine, warm, 8)
        engine_stream_decode(engine, warm, 8)
        engine_listener_decode(engine, warm, 8)
        for batch in batches:
            data = prompts(batch, args.prompt_tokens, SHAPES[name]["vocab_size"], batch)
            runs: dict[str, list[dict[str, float]]] = {path: [] for path in PATHS}
            for rotation in range(args.repeat):
                # Paths alternate, each rotation starting one path later, so no path always
                # runs first or always follows the same one (a fixed order hands any
                # position effect, a cache warmed or a stall after a path, to one path).
                order = PATHS[rotation % len(PATHS) :] + PATHS[: rotation % len(PATHS)]
                for path in order:
                    # Each run starts from an empty buffer cache, as the engine does after
                    # idling.
                    mx.clear_cache()
                    LAST_RUN.clear()
                    own = float("nan")
                    if path == "raw":
                        rate = raw_decode(model, data, args.max_tokens)
                    else:
                        rate, own = own_host_time(ENGINE_PATHS[path], engine, data, args.max_tokens)
                    runs[path].append(
                        dict(LAST_RUN, tok_s=rate, own_us=own, position=order.index(path))
                    )
            raw = [run["tok_s"] for run in runs["raw"]]
            row: dict[str, Any] = {
                "shape": name,
                "params": weight_bytes / 2,
                "batch": batch,
                "repeat": args.repeat,
                "raw_tok_s": _median(raw),
                "raw_us_per_token": 1e6 / _median(raw),
            }
            for path, key in (
                ("engine", "ratio"),
                ("stream", "stream_ratio"),
                ("listener", "listener_ratio"),
            ):
                rates = [run["tok_s"] for run in runs[path]]
                # Each rotation's own ratio (the path against raw run beside it); the median
                # of those, and their range: one rotation's pair shares the host's state.
                ratios = sorted(o / r for o, r in zip(rates, raw, strict=True))
                row[f"{path}_tok_s"] = _median(rates)
                row[key] = _median(ratios)
                row[f"{key}_min"], row[f"{key}_max"] = ratios[0], ratios[-1]
                row[f"{key}_wins"] = sum(ratio >= 0.95 for ratio in ratios)
            raw_e2e = [run["e2e_tok_s"] for run in runs["raw"]]
            for path in PATHS[1:]:
                # End to end (submit -> last token, every token): the prefill counts for both,
                # wherever each path puts it (raw prefills the whole batch before its first
                # token; the engine starts decoding the first rows while later ones prefill,
                # inside the decode window above).
                e2e = sorted(
                    run["e2e_tok_s"] / r for run, r in zip(runs[path], raw_e2e, strict=True)
                )
                row[f"{path}_e2e_ratio"] = _median(e2e)
                row[f"{path}_e2e_min"], row[f"{path}_e2e_max"] = e2e[0], e2e[-1]
            for path in PATHS:
                row[f"{path}_steps"] = _median([run["steps"] for run in runs[path]])
                row[f"{path}_cpu_us_per_token"] = _median([run["cpu_us"] for run in runs[path]])
            row["raw_step_ms"] = _median([run["step_ms"] for run in runs["raw"]])
            for path in PATHS[1:]:
                # The steady decode step: the median step period (engine thread, start to
                # start) against raw's median step in the same rotation; the batch's first
                # and last steps (prefill, finishing) drop out of a median.
                row[f"{path}_period_ms"] = _median([run["period_ms"] for run in runs[path]])
                steady = sorted(
                    r["step_ms"] / run["period_ms"]
                    for run, r in zip(runs[path], runs["raw"], strict=True)
                )
                row[f"{path}_steady_ratio"] = _median(steady)
                row[f"{path}_steady_min"], row[f"{path}_steady_max"] = steady[0], steady[-1]
            row["listener_step_ms"] = _median([run["step_ms"] for run in runs["listener"]])
            row["engine_own_us_per_token"] = _median([run["own_us"] for run in runs["engine"]])
            row["stream_own_us_per_token"] = _median([run["own_us"] for run in runs["stream"]])
            row["listener_own_us_per_token"] = _median([run["own_us"] for run in runs["listener"]])
            # Every run, to show the spread the medians hide.
            row["runs"] = runs
            if batch == args.trace_batch:
                row["trace"] = trace_runs(model, engine, data, args.max_tokens)
            if batch == args.profile_batch:
                row["profile"] = profile_runs(model, engine, data, args.max_tokens)
            raw_med, ours_med = row["raw_tok_s"], row["engine_tok_s"]
            if batch == 1:
                floor_ms = weight_bytes / bandwidth * 1e3
                row["step_ms"] = 1e3 / raw_med
                row["engine_step_ms"] = 1e3 / ours_med
                row["floor_ms"] = floor_ms
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after every point: a run cut short still leaves its points
                with open(args.json, "w") as handle:
                    json.dump({"bandwidth": bandwidth, "rows": rows}, handle, indent=1)
        engine.close()
        del model, engine
        mx.clear_cache()
    print()
    print(
        "| shape | batch | raw tok/s | engine / raw | streamed / raw | daemon path / raw |"
        " rotations >= 0.95 (engine / streamed / daemon) |"
        " raw µs/token | engine own µs/token (sync / streamed / daemon) |"
        " batch-1 step ms (raw / engine) | floor ms | floor / engine step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        step = f"{r['step_ms']:.2f} / {r['engine_step_ms']:.2f}" if "step_ms" in r else ""
        floor = f"{r['floor_ms']:.2f}" if "floor_ms" in r else ""
        eff = f"{r['floor_ms'] / r['engine_step_ms']:.0%}" if "floor_ms" in r else ""
        spread = " | ".join(
            f"{r[k]:.3f} ({r[k + '_min']:.2f}–{r[k + '_max']:.2f})"
            for k in ("ratio", "stream_ratio", "listener_ratio")
        )
        wins = " / ".join(str(r[k + "_wins"]) for k in ("ratio", "stream_ratio", "listener_ratio"))
        print(
            f"| {r['shape']} | {r['batch']} | {r['raw_tok_s']:.0f} | {spread} "
            f"| {wins} of {r['repeat']} | {r['raw_us_per_token']:.1f} "
            f"| {r['engine_own_us_per_token']:.1f} / {r['stream_own_us_per_token']:.1f}"
            f" / {r['listener_own_us_per_token']:.1f} | {step} | {floor} | {eff} |"
        )
    print()
    print(
        "| shape | batch | end to end / raw (engine / streamed / daemon) |"
        " steady step / raw (engine / streamed / daemon) |"
        " steps (raw / engine / streamed / daemon) |"
        " median step ms (raw / engine / streamed / daemon; daemon at the loop) |"
        " host CPU µs/token (raw / engine / streamed / daemon) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        steps = " / ".join(f"{r[p + '_steps']:.0f}" for p in PATHS)
        cpu = " / ".join(f"{r[p + '_cpu_us_per_token']:.1f}" for p in PATHS)
        e2e = " / ".join(
            f"{r[p + '_e2e_ratio']:.3f} ({r[p + '_e2e_min']:.2f}–{r[p + '_e2e_max']:.2f})"
            for p in PATHS[1:]
        )
        steady = " / ".join(
            f"{r[p + '_steady_ratio']:.3f} ({r[p + '_steady_min']:.2f}–{r[p + '_steady_max']:.2f})"
            for p in PATHS[1:]
        )
        periods = " / ".join(f"{r[p + '_period_ms']:.2f}" for p in PATHS[1:])
        print(
            f"| {r['shape']} | {r['batch']} | {e2e} | {steady} | {steps} "
            f"| {r['raw_step_ms']:.2f} / {periods}; {r['listener_step_ms']:.2f} | {cpu} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bandwidth": bandwidth, "rows": rows}, handle, indent=1)


def _median(values: list[float]) -> float:
    # The mean of the two middle values for an even count (the upper one alone, as before,
    # leans every median up).
    return statistics.median(values)


if __name__ == "__main__":
    main()
