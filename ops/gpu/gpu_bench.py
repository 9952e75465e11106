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
import json
import sys
import time
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
    generator.insert(batch, [max_tokens] * len(batch))
    first = None
    tokens = 0
    remaining = len(batch)
    while remaining:
        _, responses = generator.next()
        if responses and first is None:
            first = time.perf_counter()
            tokens -= len(responses)
        tokens += len(responses)
        remaining -= sum(r.finish_reason is not None for r in responses)
    mx.synchronize()
    generator.close()
    assert first is not None
    return tokens / (time.perf_counter() - first)


def own_host_time(
    path: Any, engine: EngineCore, batch: list[list[int]], max_tokens: int
) -> tuple[float, float]:
    """``path``'s tokens/s and the engine's own host µs per generated token meanwhile."""
    before = engine.stats()
    rate: float = path(engine, batch, max_tokens)
    return rate, engine_host_us(before, engine.stats())


def engine_decode(engine: EngineCore, batch: list[list[int]], max_tokens: int) -> float:
    start = time.perf_counter()
    outputs = engine.generate_batch_sync(
        batch, SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    end = time.perf_counter()
    first = min(o.ttft for o in outputs if o.ttft is not None)
    tokens = sum(o.completion_tokens - 1 for o in outputs)
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

        ids = [await engine.add_request(prompt, params) for prompt in batch]
        await asyncio.gather(*(consume(request_id) for request_id in ids))
        end = time.perf_counter()
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
            if not first:
                first.append(time.perf_counter())
            for output in outputs:
                counts["tokens"] += len(output.new_token_ids)
                counts["finished"] += output.finished
            if counts["finished"] == len(batch):
                done.set()

        engine.set_step_listener(on_step)
        try:
            for prompt in batch:
                await engine.add_request(prompt, params, collect=False)
            await done.wait()
        finally:
            engine.set_step_listener(None)
        end = time.perf_counter()
        return (counts["tokens"] - len(batch)) / (end - first[0])

    return asyncio.run(scenario())


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
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval (s) for the whole run: how long the event loop's thread may"
        " wait for the GIL the engine thread holds (CPython's default 0.005)",
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
        engine = EngineCore(model, tokenizer, EngineConfig(scheduler_config=config))
        warm = prompts(2, args.prompt_tokens, SHAPES[name]["vocab_size"], 0)
        raw_decode(model, warm, 8)
        engine_decode(engine, warm, 8)
        engine_stream_decode(engine, warm, 8)
        engine_listener_decode(engine, warm, 8)
        for batch in batches:
            data = prompts(batch, args.prompt_tokens, SHAPES[name]["vocab_size"], batch)
            raw, ours, streamed, ours_own, streamed_own = [], [], [], [], []
            listened: list[float] = []
            for _ in range(args.repeat):  # alternate: drift hits every path alike
                # Each run starts from an empty buffer cache, as the engine does after idling.
                mx.clear_cache()
                raw.append(raw_decode(model, data, args.max_tokens))
                mx.clear_cache()
                rate, own = own_host_time(engine_decode, engine, data, args.max_tokens)
                ours.append(rate)
                ours_own.append(own)
                mx.clear_cache()
                rate, own = own_host_time(engine_stream_decode, engine, data, args.max_tokens)
                streamed.append(rate)
                streamed_own.append(own)
                mx.clear_cache()
                listened.append(engine_listener_decode(engine, data, args.max_tokens))
            row = {
                "shape": name,
                "params": weight_bytes / 2,
                "batch": batch,
                "raw_tok_s": _median(raw),
                "engine_tok_s": _median(ours),
                "ratio": _median([o / r for o, r in zip(ours, raw, strict=True)]),
                "stream_tok_s": _median(streamed),
                "stream_ratio": _median([s / r for s, r in zip(streamed, raw, strict=True)]),
                "raw_us_per_token": 1e6 / _median(raw),
                "engine_own_us_per_token": _median(ours_own),
                "stream_own_us_per_token": _median(streamed_own),
                "listener_tok_s": _median(listened),
                "listener_ratio": _median([s / r for s, r in zip(listened, raw, strict=True)]),
                # Every rotation, to show the spread the medians hide.
                "raw_all": raw,
                "engine_all": ours,
                "stream_all": streamed,
                "listener_all": listened,
            }
            raw_med, ours_med = row["raw_tok_s"], row["engine_tok_s"]
            if batch == 1:
                floor_ms = weight_bytes / bandwidth * 1e3
                row["step_ms"] = 1e3 / raw_med
                row["engine_step_ms"] = 1e3 / ours_med
                row["floor_ms"] = floor_ms
            rows.append(row)
            print(json.dumps(row), flush=True)
        engine.close()
        del model, engine
        mx.clear_cache()
    print()
    print(
        "| shape | batch | raw BatchGenerator tok/s | engine tok/s | engine / raw |"
        " streamed tok/s | streamed / raw | daemon path tok/s | daemon path / raw |"
        " raw µs/token |"
        " engine own µs/token (sync / streamed) |"
        " batch-1 step ms (raw / engine) | floor ms | floor / engine step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        step = f"{r['step_ms']:.2f} / {r['engine_step_ms']:.2f}" if "step_ms" in r else ""
        floor = f"{r['floor_ms']:.2f}" if "floor_ms" in r else ""
        eff = f"{r['floor_ms'] / r['engine_step_ms']:.0%}" if "floor_ms" in r else ""
        print(
            f"| {r['shape']} | {r['batch']} | {r['raw_tok_s']:.0f} | {r['engine_tok_s']:.0f} "
            f"| {r['ratio']:.3f} | {r['stream_tok_s']:.0f} | {r['stream_ratio']:.3f} "
            f"| {r['listener_tok_s']:.0f} | {r['listener_ratio']:.3f} "
            f"| {r['raw_us_per_token']:.1f} "
            f"| {r['engine_own_us_per_token']:.1f} / {r['stream_own_us_per_token']:.1f} "
            f"| {step} | {floor} | {eff} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"bandwidth": bandwidth, "rows": rows}, handle, indent=1)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


if __name__ == "__main__":
    main()
