"""Prefix-cache reuse, statistics, bounds, and save/load round trips."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_redis_worker.engine import EngineCore, SamplingParams
from mlx_redis_worker.models import load_model
from tests.support.engines import PROMPTS, MakeEngine, collect
from tests.support.waiting import run

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SYSTEM = " ".join(PROMPTS)  # a long shared prefix


def test_identical_prompt_reuses_the_cache_and_gives_the_same_text(engine: EngineCore) -> None:
    cold = engine.generate_batch_sync([PROMPTS[5]], GREEDY)[0]
    warm = engine.generate_batch_sync([PROMPTS[5]], GREEDY)[0]
    stats = engine.get_cache_stats()
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == warm.prompt_tokens - 1  # all but the token that makes logits
    assert warm.output_token_ids == cold.output_token_ids
    assert stats is not None
    assert stats["hits"] == 1 and stats["misses"] == 1
    assert stats["tokens_saved"] == warm.cached_tokens
    assert stats["entries"] >= 1 and stats["memory_bytes"] > 0


def test_shared_prefix_prefills_only_the_rest(
    tiny_model: Any, engine: EngineCore, make_engine: MakeEngine
) -> None:
    engine.generate_batch_sync([SYSTEM + " first question"], GREEDY)
    second = engine.generate_batch_sync([SYSTEM + " second question"], GREEDY)[0]
    engine.close()  # one engine per model at a time
    uncached = make_engine(tiny_model, enable_prefix_cache=False)
    baseline = uncached.generate_batch_sync([SYSTEM + " second question"], GREEDY)[0]
    _, tokenizer = tiny_model
    shared = len(tokenizer.encode(SYSTEM))
    assert shared - 2 <= second.cached_tokens < second.prompt_tokens
    assert second.output_token_ids == baseline.output_token_ids
    assert uncached.get_cache_stats() is None


def _run_one(engine: Any, prompt: list[int], boundary: int) -> Any:
    async def one() -> Any:
        rid = await engine.add_request(prompt, GREEDY, prefix_boundary=boundary)
        return (await collect(engine, rid))[-1]

    return run(one())


def test_prefix_boundary_keeps_one_compact_entry_for_the_shared_prefix(
    tiny_model: Any, tmp_path: Path, make_engine: MakeEngine
) -> None:
    _, tokenizer = tiny_model
    system = tokenizer.encode(SYSTEM)
    questions = [tokenizer.encode(f" question {q}", add_special_tokens=False) for q in "abc"]
    prompts = [system + q for q in questions]

    def serve(boundary: int, save: bool = False, **scheduler: Any) -> tuple[list[Any], Any]:
        engine = make_engine(tiny_model, **scheduler)
        outputs = [_run_one(engine, p, boundary) for p in prompts]
        if save:
            assert engine.save_cache_to_disk(str(tmp_path / "cache"))
        stats = engine.get_cache_stats()
        engine.close()  # one engine per model at a time
        return outputs, stats

    shared, shared_stats = serve(len(system), save=True)
    full, full_stats = serve(0)
    baseline, _ = serve(0, enable_prefix_cache=False)
    assert [o.cached_tokens for o in shared] == [0, len(system), len(system)]
    for output, reference in zip(shared + full, baseline + baseline, strict=True):
        assert output.output_token_ids == reference.output_token_ids
    assert shared_stats is not None and full_stats is not None
    # One entry of the system prompt alone, against one per request of prompt and output.
    assert shared_stats["entries"] == 1 and full_stats["entries"] == 3
    per_token = shared_stats["memory_bytes"] / len(system)
    assert full_stats["memory_bytes"] >= 3 * per_token * (len(prompts[0]) + 1)
    manifest = (tmp_path / "cache" / "manifest.json").read_text()
    assert '"kind": "system"' in manifest

    restored = make_engine(tiny_model)
    assert restored.load_cache_from_disk(str(tmp_path / "cache")) == 1
    again = _run_one(restored, prompts[2], len(system))
    assert again.cached_tokens == len(system)
    assert again.output_token_ids == baseline[2].output_token_ids


def test_cache_is_bounded_with_lru_eviction(tiny_model: Any, make_engine: MakeEngine) -> None:
    engine = make_engine(tiny_model, prefix_cache_max_entries=3)
    for prompt in PROMPTS[:6]:
        engine.generate_batch_sync([prompt], GREEDY)
    stats = engine.get_cache_stats()
    newest = engine.generate_batch_sync([PROMPTS[5]], GREEDY)[0]
    oldest = engine.generate_batch_sync([PROMPTS[0]], GREEDY)[0]
    assert stats is not None and stats["entries"] == 3 and stats["evictions"] == 3
    assert newest.cached_tokens > 0
    assert oldest.cached_tokens == 0


def test_byte_bound_holds(tiny_model: Any, make_engine: MakeEngine) -> None:
    engine = make_engine(tiny_model, prefix_cache_max_bytes=600_000)
    for prompt in PROMPTS[:8]:
        engine.generate_batch_sync([prompt], GREEDY)
    stats = engine.get_cache_stats()
    assert stats is not None
    assert 0 < stats["memory_bytes"] <= 600_000
    assert stats["evictions"] > 0


def test_save_then_load_into_a_fresh_engine(
    tiny_model: Any, tmp_path: Path, engine: EngineCore, make_engine: MakeEngine
) -> None:
    target = tmp_path / "prefix-cache"
    cold = engine.generate_batch_sync([PROMPTS[8], PROMPTS[12]], GREEDY)
    assert engine.save_cache_to_disk(str(target))
    saved_entries = engine.get_cache_stats()["entries"]  # type: ignore[index]
    engine.close()  # one engine per model at a time
    assert (target / "manifest.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left

    fresh = make_engine(tiny_model)
    assert fresh.load_cache_from_disk(str(target)) == saved_entries
    assert fresh.load_cache_from_disk(str(target)) == 0  # duplicates are skipped
    warm = fresh.generate_batch_sync([PROMPTS[8], PROMPTS[12]], GREEDY)
    for before, after in zip(cold, warm, strict=True):
        assert after.cached_tokens == after.prompt_tokens - 1
        assert after.output_token_ids == before.output_token_ids


def test_save_replaces_an_older_cache_atomically(engine: EngineCore, tmp_path: Path) -> None:
    target = tmp_path / "cache"
    engine.generate_batch_sync([PROMPTS[0]], GREEDY)
    assert engine.save_cache_to_disk(str(target))
    engine.generate_batch_sync([PROMPTS[1]], GREEDY)
    assert engine.save_cache_to_disk(str(target))
    entries = engine.get_cache_stats()["entries"]  # type: ignore[index]
    assert len(list(target.glob("entry-*.safetensors"))) == entries == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_another_models_cache_is_refused(
    engine: EngineCore,
    make_engine: MakeEngine,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = tmp_path / "llama-cache"
    engine.generate_batch_sync([PROMPTS[0]], GREEDY)
    assert engine.save_cache_to_disk(str(target))
    engine.close()  # saved and gone, as a worker before a restart with another model
    other = make_engine(load_model("tiny-qwen3"))
    assert other.load_cache_from_disk(str(target)) == 0
    assert other.get_cache_stats()["entries"] == 0  # type: ignore[index]
    assert other.load_cache_from_disk(str(tmp_path / "missing")) == 0


def test_clear_runtime_caches_reports_what_it_freed(engine: EngineCore) -> None:
    engine.generate_batch_sync(PROMPTS[:3], GREEDY)
    before = engine.get_cache_stats()
    cleared = engine.clear_runtime_caches()
    after = engine.get_cache_stats()
    engine.generate_batch_sync(PROMPTS[:1], GREEDY)
    engine.clear_prefix_cache()
    emptied = engine.get_cache_stats()
    assert before is not None and after is not None and cleared is not None and emptied is not None
    assert cleared["prefix_cache_entries"] == before["entries"] > 0
    assert cleared["prefix_cache_bytes"] == before["memory_bytes"] > 0
    assert after["entries"] == 0 and after["memory_bytes"] == 0
    assert emptied["entries"] == 0
