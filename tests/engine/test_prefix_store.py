"""A declared shared prefix is stored while its request prefills, and the prefix cache's own
index of its entries stays in step with mlx-lm's LRU (saving lists them from it)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_redis_worker.engine import EngineCore, RequestOutput, SamplingParams
from mlx_redis_worker.engine.prefix_cache import FULL, SHARED_PREFIX, PrefixCache
from tests.support.engines import PROMPTS, MakeEngine, collect
from tests.support.waiting import run

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _system_and_questions(tokenizer: Any) -> tuple[list[int], list[list[int]]]:
    system = tokenizer.encode(" ".join(PROMPTS))
    questions = [tokenizer.encode(f" question {q}", add_special_tokens=False) for q in "abc"]
    return system, questions


def test_the_shared_prefix_is_cached_before_its_request_ends(
    tiny_model: Any, engine: EngineCore
) -> None:
    _, tokenizer = tiny_model
    system, (first, second, _) = _system_and_questions(tokenizer)
    boundary = len(system)

    async def scenario() -> tuple[Any, RequestOutput]:
        long = SamplingParams(max_tokens=400, temperature=0.0)
        rid = await engine.add_request(system + first, long, prefix_boundary=boundary)
        stream = cast(AsyncGenerator[RequestOutput, None], engine.stream_outputs(rid))
        await anext(stream)  # its first token: prefill is done, and the request still runs
        stored_while_running = engine.cache_stats()
        behind = await engine.generate(system + second, GREEDY, prefix_boundary=boundary)
        await stream.aclose()  # aborts the first request
        await engine.stop()
        return stored_while_running, behind

    stored, behind = run(scenario())
    assert stored is not None and (stored.entries, stored.stores) == (1, 1)
    assert behind.cached_tokens == boundary
    after = engine.cache_stats()
    assert after is not None and after.entries == 1  # neither request added a whole sequence


def test_a_segmented_prefill_streams_only_real_tokens(
    tiny_model: Any, engine: EngineCore, make_engine: MakeEngine
) -> None:
    """The end of the prefix segment is reported without a token: no output comes of it, and
    the text is the uncached engine's."""
    _, tokenizer = tiny_model
    system, (question, _, _) = _system_and_questions(tokenizer)

    async def stream(on: EngineCore, boundary: int) -> list[RequestOutput]:
        rid = await on.add_request(system + question, GREEDY, prefix_boundary=boundary)
        outputs = await collect(on, rid)
        await on.stop()
        return outputs

    outputs = run(stream(engine, len(system)))
    engine.close()  # one engine per model at a time
    baseline = run(stream(make_engine(tiny_model, enable_prefix_cache=False), 0))
    # No output without a token; a reader slower than the engine may get two merged into one
    # (the collector aggregates), so not exactly one each.
    assert all(len(o.new_token_ids) >= 1 for o in outputs[:-1])
    assert sum(len(o.new_token_ids) for o in outputs) == outputs[-1].completion_tokens
    assert outputs[-1].output_token_ids == baseline[-1].output_token_ids
    assert outputs[-1].completion_tokens == baseline[-1].completion_tokens


def _kv(tokens: int) -> list[Any]:
    """A one-layer KV cache holding ``tokens`` positions."""
    layer = KVCache()
    data = mx.ones((1, 1, tokens, 2))
    layer.update_and_fetch(data, data)
    return [layer]


def _saved(cache: PrefixCache, directory: Path) -> list[tuple[int, str]]:
    cache.save(directory, "fingerprint")
    manifest = json.loads((directory / "manifest.json").read_text())
    return sorted((entry["num_tokens"], entry["kind"]) for entry in manifest["entries"])


def test_the_index_follows_evictions_and_prefix_drops(tmp_path: Path) -> None:
    cache = PrefixCache(max_entries=3, max_bytes=1 << 30)
    cache.store([1, 2, 3], _kv(3), FULL)
    cache.store([7, 7, 7, 7], _kv(4), SHARED_PREFIX)
    cache.store([4, 5, 6, 8, 9], _kv(5), FULL)
    cache.store([4, 5], _kv(2), FULL)  # the entries are full: the oldest whole sequence goes
    assert _saved(cache, tmp_path / "a") == [(2, FULL), (4, SHARED_PREFIX), (5, FULL)]
    assert cache.stats().evictions == 1 and not cache.holds([1, 2, 3])

    cache.store([4, 5, 6], _kv(3), FULL)  # an entry that extends [4, 5] replaces it
    assert _saved(cache, tmp_path / "b") == [(3, FULL), (4, SHARED_PREFIX), (5, FULL)]
    assert not cache.holds([4, 5]) and cache.stats().entries == 3

    fresh = PrefixCache(max_entries=3, max_bytes=1 << 30)
    assert fresh.load(tmp_path / "b", "fingerprint") == 3
    assert fresh.holds([7, 7, 7, 7]) and fresh.holds([4, 5, 6, 8, 9]) and fresh.holds([4, 5, 6])
    assert fresh.clear()["entries"] == 3
    assert _saved(fresh, tmp_path / "c") == [] and not fresh.holds([4, 5, 6])


def test_a_touched_entry_is_evicted_after_the_others_of_its_kind(tmp_path: Path) -> None:
    cache = PrefixCache(max_entries=2, max_bytes=1 << 30)
    cache.store([1], _kv(1), SHARED_PREFIX)
    cache.store([2], _kv(1), SHARED_PREFIX)
    cache.touch([1])
    cache.store([3], _kv(1), SHARED_PREFIX)
    assert cache.holds([1]) and not cache.holds([2]) and cache.holds([3])
    assert _saved(cache, tmp_path / "a") == [(1, SHARED_PREFIX), (1, SHARED_PREFIX)]
    assert cache.stats().stores == 3  # a touch is no store


def test_the_index_follows_the_byte_bound(tmp_path: Path) -> None:
    entry = _kv(1)[0].nbytes  # mlx-lm's KVCache holds whole blocks: one size for all here
    cache = PrefixCache(max_entries=10, max_bytes=3 * entry)
    cache.store([1] * 4, _kv(4), SHARED_PREFIX)
    for first in (2, 3, 4):
        cache.store([first] * 3, _kv(3), FULL)  # one entry too many: the oldest sequence goes
    assert cache.stats().memory_bytes == 3 * entry
    assert _saved(cache, tmp_path / "a") == [(3, FULL), (3, FULL), (4, SHARED_PREFIX)]
    assert not cache.holds([2, 2, 2]) and cache.holds([4, 4, 4])
