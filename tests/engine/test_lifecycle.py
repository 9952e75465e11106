"""Abort, timeouts, cancellation, stop/close, ownership and failure containment."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from mlx_redis_worker.engine import (
    EngineCore,
    ImagesNotSupportedError,
    ModelOwnershipError,
    QueueFullError,
    SamplingParams,
    get_registry,
)
from tests.support.engines import (
    PROMPTS,
    ClosedAtTeardown,
    MakeEngine,
    collect,
    reference_tokens,
)
from tests.support.waiting import run, until

LONG = SamplingParams(max_tokens=2000, temperature=0.0)


def test_abort_running_and_waiting_requests_end_their_streams(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_model, max_num_seqs=1)

    async def scenario() -> tuple[list[Any], list[Any], dict[str, Any]]:
        running = await engine.add_request(PROMPTS[0], LONG)
        waiting = await engine.add_request(PROMPTS[1], LONG)
        running_stream = asyncio.create_task(collect(engine, running))
        waiting_stream = asyncio.create_task(collect(engine, waiting))
        while engine.get_stats()["num_running"] == 0 or not engine.get_stats()["requests"]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # let the running one produce tokens
        assert engine.get_stats()["num_waiting"] == 1
        assert await engine.abort_request(waiting)
        assert await engine.abort_request(running)
        assert not await engine.abort_request(running)  # already finished
        results = await asyncio.wait_for(asyncio.gather(running_stream, waiting_stream), 30)
        stats = engine.get_stats()
        await engine.stop()
        return results[0], results[1], stats

    running_outputs, waiting_outputs, stats = run(scenario())
    assert running_outputs[-1].finish_reason == "abort"
    assert 0 < running_outputs[-1].completion_tokens < 2000
    assert waiting_outputs == [waiting_outputs[-1]]
    assert waiting_outputs[-1].finish_reason == "abort"
    assert waiting_outputs[-1].completion_tokens == 0
    assert stats["active_requests"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_generate_returns_abort_when_aborted_meanwhile(engine: EngineCore) -> None:
    async def scenario() -> Any:
        task = asyncio.create_task(engine.generate(PROMPTS[2], LONG, request_id="to-abort"))
        while not engine.get_stats()["requests"]:
            await asyncio.sleep(0.01)
        await engine.abort_request("to-abort")
        result = await asyncio.wait_for(task, 30)
        await engine.stop()
        return result

    final = run(scenario())
    assert final.finished and final.finish_reason == "abort"
    assert final.new_text == final.output_text  # generate() hands back the whole text


def test_timeout_aborts_and_yields_a_final_output(tiny_model: Any, make_engine: MakeEngine) -> None:
    engine = make_engine(tiny_model, max_num_seqs=1)

    async def scenario() -> list[Any]:
        await engine.add_request(PROMPTS[0], LONG, request_id="hog")
        starved = await engine.add_request(PROMPTS[1], LONG)  # waits behind "hog"
        outputs = await collect(engine, starved, timeout=0.3)
        await engine.stop()
        return outputs

    outputs = run(scenario())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"


def test_cancelled_consumer_aborts_its_request(engine: EngineCore) -> None:
    async def scenario() -> dict[str, Any]:
        rid = await engine.add_request(PROMPTS[3], LONG)
        consumer = asyncio.create_task(collect(engine, rid))
        while not engine.get_stats()["requests"]:
            await asyncio.sleep(0.01)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer

        async def forgotten() -> bool:
            return not engine.get_stats()["requests"]

        await until(forgotten, 5, "the cancelled request to be forgotten", interval=0.01)
        stats = engine.get_stats()
        await engine.stop()
        return stats

    stats = run(scenario())
    assert stats["requests"] == [] and stats["active_requests"] == 0


def test_stop_and_close_finish_every_open_request(tiny_model: Any, make_engine: MakeEngine) -> None:
    engine = make_engine(tiny_model, max_num_seqs=2)

    async def scenario() -> list[Any]:
        ids = [await engine.add_request(p, LONG) for p in PROMPTS[:5]]
        streams = [asyncio.create_task(collect(engine, rid)) for rid in ids]
        while engine.get_stats()["num_running"] < 2:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.close)  # close from another thread, like a signal handler
        return await asyncio.wait_for(asyncio.gather(*streams), 30)

    streams = run(scenario())
    for outputs in streams:
        assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
        assert [o.finished for o in outputs].count(True) == 1
    with pytest.raises(RuntimeError, match="closed"):
        run(engine.add_request("after close"))


def test_engine_restarts_after_stop(engine: EngineCore) -> None:
    cpu: list[float] = []

    def engine_cpu() -> None:
        cpu.append(engine.get_stats()["engine_thread_cpu_seconds"])

    async def twice() -> list[Any]:
        first = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0))
        engine_cpu()
        await engine.stop()
        engine_cpu()
        assert not engine.is_running()
        await engine.start()
        second = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0))
        engine_cpu()
        await engine.stop()
        engine_cpu()
        return [first, second]

    first, second = run(twice())
    assert first.output_token_ids == second.output_token_ids
    # The engine thread's CPU time counts across restarts and never goes back.
    assert 0 < cpu[0] <= cpu[1] <= cpu[2] <= cpu[3], cpu


def test_images_on_a_text_model_are_a_clear_error(tiny_model: Any, engine: EngineCore) -> None:
    assert not engine.supports_images and engine.image_placeholder is None

    async def scenario() -> Any:
        rid = await engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0))
        # A typed error (a ValueError: the worker's invalid_job), before any image is read.
        with pytest.raises(ImagesNotSupportedError, match="text-only"):
            await engine.add_request(PROMPTS[1], images=["cat.png"])
        with pytest.raises(ImagesNotSupportedError, match="text-only"):
            await engine.add_request(PROMPTS[1], videos=[["cat.png"]])
        final = (await collect(engine, rid))[-1]
        await engine.stop()
        return final

    final = run(scenario())
    assert final.output_token_ids == reference_tokens(tiny_model, PROMPTS[0], 8)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", None, "empty"),
        ([], None, "empty"),
        ([1, 2, 10**9], None, "out of range"),
        ([1, "x"], None, "token ids"),
        (None, None, "prompt must be"),
    ],
)
def test_bad_prompts_are_value_errors(
    engine: EngineCore, prompt: Any, params: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        run(engine.add_request(prompt, params))
    assert engine.get_stats()["active_requests"] == 0


def test_waiting_queue_cap_is_a_clear_error(tiny_model: Any, make_engine: MakeEngine) -> None:
    engine = make_engine(tiny_model, max_num_seqs=1, max_waiting_requests=2)

    async def scenario() -> None:
        ids = [await engine.add_request(PROMPTS[0], LONG) for _ in range(3)]
        with pytest.raises(QueueFullError, match="full"):
            await engine.add_request(PROMPTS[0], LONG)
        for rid in ids:
            await engine.abort_request(rid)
        await engine.stop()

    run(scenario())


def test_a_failing_request_does_not_fail_its_batch(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    calls = {"n": 0}

    def explode_on_third_token(tokens: Any, logits: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("processor exploded")
        return logits

    engine = make_engine(tiny_model, enable_prefix_cache=False)

    async def scenario() -> tuple[Any, list[Any], dict[str, Any]]:
        bad = await engine.add_request(
            PROMPTS[0],
            SamplingParams(
                max_tokens=12, temperature=0.0, logits_processors=[explode_on_third_token]
            ),
        )
        good = [
            await engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0))
            for p in PROMPTS[1:4]
        ]
        bad_final = (await collect(engine, bad))[-1]
        good_finals = [(await collect(engine, rid))[-1] for rid in good]
        stats = engine.get_stats()
        await engine.stop()
        return bad_final, good_finals, stats

    bad_final, good_finals, stats = run(scenario())
    assert bad_final.finish_reason == "error"
    assert bad_final.error is not None and "processor exploded" in bad_final.error
    for prompt, final in zip(PROMPTS[1:4], good_finals, strict=True):
        assert final.finish_reason == "length"
        assert final.output_token_ids == reference_tokens(tiny_model, prompt, 12)
    assert stats["num_requests_failed"] == 1 and stats["health"]["healthy"]


class FlakyModel:
    """The real model, except that its forward pass fails once when armed (fault injection)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.armed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise RuntimeError("device lost")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_failed_batch_step_fails_its_requests_and_the_engine_recovers(
    tiny_model: Any, closed_at_teardown: ClosedAtTeardown
) -> None:
    model, tokenizer = tiny_model
    flaky = FlakyModel(model)
    engine = closed_at_teardown(EngineCore(flaky, tokenizer))

    async def scenario() -> tuple[Any, Any, dict[str, Any]]:
        rid = await engine.add_request(PROMPTS[0], LONG)
        stream = asyncio.create_task(collect(engine, rid))
        while engine.get_stats()["steps_executed"] < 3:
            await asyncio.sleep(0.01)
        flaky.armed = True
        failed = (await asyncio.wait_for(stream, 30))[-1]
        stats = engine.get_stats()
        after = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0))
        await engine.stop()
        return failed, after, stats

    failed, after, stats = run(scenario())
    assert failed.finish_reason == "error" and "device lost" in (failed.error or "")
    assert stats["batch_failures"] == 1
    assert after.finish_reason == "length"
    assert after.output_token_ids == reference_tokens(tiny_model, PROMPTS[0], 6)


def test_model_ownership(tiny_model: Any, closed_at_teardown: ClosedAtTeardown) -> None:
    model, tokenizer = tiny_model
    first = closed_at_teardown(EngineCore(model, tokenizer, engine_id="first"))
    with pytest.raises(ModelOwnershipError, match="first"):
        EngineCore(model, tokenizer, engine_id="second", force_model_ownership=False)
    assert get_registry().owner_of(model) == "first"
    # Without force_model_ownership=False, a new engine takes the model over.
    second = closed_at_teardown(EngineCore(model, tokenizer, engine_id="second"))
    assert get_registry().owner_of(model) == "second"
    with pytest.raises(ModelOwnershipError, match="taken by engine second"):
        run(first.add_request("hello"))
    with pytest.raises(ModelOwnershipError):
        first.generate_batch_sync(["hello"])
    output = second.generate_batch_sync(["hello"], SamplingParams(max_tokens=3))[0]
    assert output.completion_tokens == 3
    second.close()
    assert get_registry().owner_of(model) is None


def test_ownership_registry_is_thread_safe() -> None:
    registry = type(get_registry())()

    class Owner:
        def __init__(self) -> None:
            self.revoked = 0

        def _on_ownership_revoked(self, new_engine_id: str) -> None:
            self.revoked += 1

    model = object()
    owners = [Owner() for _ in range(16)]
    winners: list[int] = []
    barrier = threading.Barrier(len(owners))

    def claim(index: int) -> None:
        barrier.wait()
        try:
            registry.acquire(model, owners[index], f"engine-{index}", force=False)
            winners.append(index)
        except ModelOwnershipError:
            pass

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(owners))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(winners) == 1
    assert registry.owner_of(model) == f"engine-{winners[0]}"
    assert sum(o.revoked for o in owners) == 0


class ThreadRecordingModel:
    """The real model, recording which thread runs each forward pass."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.threads: set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_all_model_work_runs_on_the_engine_thread(
    tiny_model: Any, tmp_path: Any, closed_at_teardown: ClosedAtTeardown
) -> None:
    model, tokenizer = tiny_model
    recording = ThreadRecordingModel(model)
    engine = closed_at_teardown(EngineCore(recording, tokenizer))

    async def scenario() -> None:
        ids = [
            await engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.7))
            for p in PROMPTS[:4]
        ]
        await asyncio.gather(*(collect(engine, rid) for rid in ids))
        # Cache work called from the loop thread still runs on the engine thread.
        assert engine.save_cache_to_disk(str(tmp_path / "c"))
        assert engine.load_cache_from_disk(str(tmp_path / "c")) == 0
        engine.clear_runtime_caches()
        await engine.stop()

    run(scenario())
    engine.generate_batch_sync(PROMPTS[:2], SamplingParams(max_tokens=3))
    engine.close()  # closing too: its cache work must run on the engine thread
    assert recording.threads == {"mlx-engine"}


def test_step_listener_sees_each_step_once_and_uncollected_requests_leave_no_state(
    engine: EngineCore,
) -> None:
    batches: list[list[Any]] = []
    engine.set_step_listener(batches.append)

    async def scenario() -> dict[str, Any]:
        ids = [
            await engine.add_request(
                p, SamplingParams(max_tokens=5, temperature=0.0), collect=False
            )
            for p in PROMPTS[:3]
        ]

        async def all_finished() -> bool:
            return {o.request_id for batch in batches for o in batch if o.finished} == set(ids)

        await until(all_finished, 5, "every request's final output", interval=0.01)
        stats = engine.get_stats()
        await engine.stop()
        return stats

    stats = run(scenario())
    assert stats["active_requests"] == 0
    per_request: dict[str, list[int]] = {}
    for batch in batches:
        assert len({o.request_id for o in batch}) == len(batch)  # one output per request a step
        for output in batch:
            per_request.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert sorted(len(tokens) for tokens in per_request.values()) == [5, 5, 5]
    assert max(len(batch) for batch in batches) == 3  # the three decode in one step


EXIT_AFTER_CLOSE = """
import mlx_redis_worker.blas
mlx_redis_worker.blas.ensure_openblas()
from mlx_redis_worker.engine import EngineConfig, EngineCore, SamplingParams
from mlx_redis_worker.models import load_model

model, tokenizer = load_model("tiny")
engine = EngineCore(model, tokenizer, EngineConfig())
for params in (SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=0.0)):
    engine.generate_batch_sync([[5, 6, 7]], params)
engine.close()
print("closed")
"""


def test_a_program_exits_cleanly_after_closing_its_engine(tiny_model: Any) -> None:
    """MLX frees a thread's compile cache in thread-exit destructors that need the GIL; left to
    interpreter exit they abort the process (exit 134, "terminate called without an active
    exception"), so the engine thread frees them before it ends."""
    import subprocess
    import sys

    for _ in range(2):  # the abort was every time; twice guards against luck
        result = subprocess.run(
            [sys.executable, "-c", EXIT_AFTER_CLOSE], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "closed" in result.stdout and "terminate" not in result.stderr
