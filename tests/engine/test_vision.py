"""Images in the engine: a random-weight SmolVLM (``tiny-vision``) through the real engine.

The image reaches the model (each picture its own greedy text, mlx-vlm's own); image and text
requests share one batch and each gets the tokens it gets alone; the vision encoding is one
request per step, so running streams advance every step and a request parked for encoding can
be aborted; an image's content keys the prefix cache.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_worker.engine import (
    EngineCore,
    Request,
    ResponseFormat,
    SamplingParams,
)
from mlx_redis_worker.engine.config import SchedulerConfig
from mlx_redis_worker.engine.scheduler import Scheduler
from mlx_redis_worker.engine.vision import VisionModel, prepare_vision_prompt, vision_model_of
from tests.support.engines import MakeEngine, collect
from tests.support.images import picture, png_bytes
from tests.support.waiting import run

ASK = "<|im_start|>user\n<image>What is in this picture?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# Three pictures the processor tiles differently: 2 x 2 tiles, 2 x 1, and one.
PICTURES = [picture(1, 64, 64), picture(2, 64, 40), picture(3, 24, 24)]


def vision_of(model_and_tokenizer: tuple[Any, Any]) -> VisionModel:
    vision = vision_model_of(model_and_tokenizer[0])
    assert vision is not None
    return vision


async def generate_all(engine: EngineCore, jobs: list[dict[str, Any]]) -> list[Any]:
    """Every job at once (``prompt``, ``params`` and the add_request keywords), each one's final
    output."""

    async def one(job: dict[str, Any]) -> Any:
        job = dict(job)
        rid = await engine.add_request(job.pop("prompt"), job.pop("params", GREEDY), **job)
        outputs = await collect(engine, rid)
        final = outputs[-1]
        final.logprobs = [lp for o in outputs for lp in (o.logprobs or [])] or None
        return final

    return list(await asyncio.gather(*(one(job) for job in jobs)))


def test_each_picture_gets_its_own_greedy_text_and_it_is_mlx_vlms(
    tiny_vision_model: Any, make_engine: MakeEngine
) -> None:
    from mlx_vlm import stream_generate

    engine = make_engine(tiny_vision_model, enable_prefix_cache=False)
    finals = run(generate_all(engine, [{"prompt": ASK, "images": [p]} for p in PICTURES]))
    tokens = [final.output_token_ids for final in finals]
    assert len(set(map(tuple, tokens))) == len(tokens), tokens
    vision = vision_of(tiny_vision_model)
    for image, ours in zip(PICTURES, tokens, strict=True):
        theirs = stream_generate(
            vision.vlm, vision.processor, ASK, image=[image], max_tokens=8, temperature=0.0
        )
        # Its stream repeats the last token in a closing response (the one with a reason).
        assert ours == [response.token for response in theirs if response.finish_reason is None]


# Requests of every kind: one picture, two, a video's frames, text alone; a stop string,
# log-probabilities and a seeded sample among them.
JOBS: list[dict[str, Any]] = [
    {"prompt": ASK, "images": [PICTURES[0]]},
    {"prompt": "the quick brown fox jumps over the lazy dog"},
    {
        "prompt": "<image> and <image>: which is brighter?",
        "images": [PICTURES[1], PICTURES[2]],
        "params": SamplingParams(max_tokens=8, temperature=0.0, logprobs=2),
    },
    {"prompt": "Describe the clip.", "videos": [[PICTURES[2], PICTURES[0]]]},
    {"prompt": "once upon a time", "params": SamplingParams(max_tokens=8, seed=7)},
    {"prompt": ASK, "images": [PICTURES[1]], "params": SamplingParams(max_tokens=8, seed=3)},
    {
        "prompt": ASK,
        "images": [PICTURES[2]],
        "params": SamplingParams(max_tokens=12, temperature=0.0, stop=["o"]),
    },
    {"prompt": "numbers one two three"},
]


@pytest.fixture(scope="module")
def alone(tiny_vision_model: Any) -> list[Any]:
    """Each job's final output when it runs by itself."""
    from tests.support.engines import make_engine

    engine = make_engine(tiny_vision_model, enable_prefix_cache=False)
    try:
        return [run(generate_all(engine, [job]))[0] for job in JOBS]
    finally:
        engine.close()


@pytest.mark.parametrize(("batch", "prefill_step_size"), [(1, 2048), (4, 2048), (8, 16)])
def test_a_mixed_batch_gives_each_request_the_tokens_it_gets_alone(
    tiny_vision_model: Any,
    make_engine: MakeEngine,
    alone: list[Any],
    batch: int,
    prefill_step_size: int,
) -> None:
    # Chunks of 16 tokens cut the pictures' tokens apart and put image rows beside text rows
    # in one prefill pass.
    engine = make_engine(
        tiny_vision_model, enable_prefix_cache=False, prefill_step_size=prefill_step_size
    )
    finals = run(generate_all(engine, JOBS[:batch]))
    for job, final, solo in zip(JOBS, finals, alone, strict=False):
        assert final.output_token_ids == solo.output_token_ids, job["prompt"]
        assert final.output_text == solo.output_text
        assert final.prompt_tokens == solo.prompt_tokens
        if solo.logprobs:
            assert final.logprobs is not None
            ours = [(t, v) for lp in final.logprobs for t, v in lp.top_logprobs]
            theirs = [(t, v) for lp in solo.logprobs for t, v in lp.top_logprobs]
            assert [t for t, _ in ours] == [t for t, _ in theirs]
            assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=1e-4)
    assert engine.scheduler.vision_queue is not None
    assert engine.scheduler.vision_queue.images_encoded == sum(
        len(job.get("images", [])) + sum(map(len, job.get("videos", []))) for job in JOBS[:batch]
    )


def _scheduler(tiny_vision_model: Any, stream: Any, **config: Any) -> Scheduler:
    model, tokenizer = tiny_vision_model
    config.setdefault("max_prefill_wait", 3600.0)
    scheduler = Scheduler(model, tokenizer, SchedulerConfig(enable_prefix_cache=False, **config))
    scheduler.attach_stream(stream)
    return scheduler


def _image_request(tiny_vision_model: Any, rid: str, image: Any, max_tokens: int = 4) -> Request:
    model, _ = tiny_vision_model
    vision = prepare_vision_prompt(
        vision_of(tiny_vision_model),
        ASK,
        [image],
        [],
        vocab_size=model.args.vocab_size,
        max_tokens=4096,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, vision.token_ids, params, vision=vision)


def test_a_request_aborted_during_its_encoding_frees_its_slot(
    tiny_vision_model: Any, on_a_stream: Any
) -> None:
    # A budget of 8 image tokens a step: two tiles (4 tokens each) of a picture's five.
    scheduler = _scheduler(tiny_vision_model, on_a_stream, max_num_seqs=2, prefill_step_size=8)
    queue = scheduler.vision_queue
    assert queue is not None
    for rid, image in (("a", PICTURES[0]), ("b", PICTURES[1])):
        scheduler.add_request(_image_request(tiny_vision_model, rid, image))
    scheduler.step()  # admits both (two slots) and encodes two tiles of the first
    head = queue.head()
    assert head is not None
    first, tiles_done, tiles = head
    assert (tiles_done, len(queue), scheduler.num_running) == (2, 2, 2) and tiles > 2
    text = tiny_vision_model[1].encode("the quick brown fox")
    scheduler.add_request(Request("text", text, SamplingParams(max_tokens=4, temperature=0.0)))
    assert scheduler.abort_request(first)  # part-way through its tiles
    finals = {o.request_id: o for o in scheduler.step().outputs if o.finished}
    assert finals[first].finish_reason == "abort" and finals[first].completion_tokens == 0
    other = "b" if first == "a" else "a"
    head = queue.head()
    assert head is not None and head[:2] == (other, 2)  # the next step went on with the other
    while scheduler.num_waiting:  # the text request takes the freed slot
        finals |= {o.request_id: o for o in scheduler.step().outputs if o.finished}
    while scheduler.has_requests():
        finals |= {o.request_id: o for o in scheduler.step().outputs if o.finished}
    scheduler.close()
    assert finals[other].completion_tokens == finals["text"].completion_tokens == 4
    assert queue.stats().requests_encoded == 1  # the aborted request's merge never ran


def test_an_abort_while_the_pictures_are_processed_ends_the_request_unencoded(
    tiny_vision_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_vision_model)

    async def scenario() -> Any:
        adding = asyncio.create_task(
            engine.add_request(ASK, GREEDY, request_id="early", images=[PICTURES[0]])
        )
        await asyncio.sleep(0)  # add_request is now waiting on the processing thread
        assert await engine.abort_request("early")
        rid = await adding
        final = (await collect(engine, rid))[-1]
        after = await engine.generate(ASK, GREEDY, images=[PICTURES[1]])  # still serving
        await engine.stop()
        return final, after

    final, after = run(scenario())
    assert final.finish_reason == "abort" and final.completion_tokens == 0
    assert after.finish_reason == "length"
    vision = engine.stats().scheduler.vision
    assert vision is not None and (vision.requests_encoded, vision.images_encoded) == (1, 1)


@pytest.mark.parametrize("budget", [8, 2048])
def test_running_streams_advance_every_step_while_images_are_encoded(
    tiny_vision_model: Any, on_a_stream: Any, budget: int
) -> None:
    # The step's budget of image tokens is the prefill chunk: 8 lets two tiles (4 image
    # tokens each) a step through, 2048 all three pictures at once.
    scheduler = _scheduler(
        tiny_vision_model,
        on_a_stream,
        prefill_step_size=budget,
        min_prefill_tokens=budget,
        max_prefill_stall=math.inf,
    )
    queue = scheduler.vision_queue
    assert queue is not None
    tokenizer = tiny_vision_model[1]
    text = tokenizer.encode("the quick brown fox")
    scheduler.add_request(Request("text", text, SamplingParams(max_tokens=40, temperature=0.0)))
    streamed = 0
    while streamed < 2:  # past the step that feeds its first token back (it streams nothing)
        streamed += sum(len(o.new_token_ids) for o in scheduler.step().outputs)
    requests = [_image_request(tiny_vision_model, f"image{i}", p) for i, p in enumerate(PICTURES)]
    sizes = [r.vision.image_tokens for r in requests if r.vision is not None]
    assert min(sizes) > 8 and all(r.vision.tile_tokens == 4 for r in requests if r.vision)
    for request in requests:
        scheduler.add_request(request)
    encoded = []
    for _ in range(sum(sizes) // 8 + 2):
        outputs = {o.request_id: o for o in scheduler.step().outputs}
        assert len(outputs["text"].new_token_ids) == 1  # a token in every step
        encoded.append(queue.stats().image_tokens_encoded)
    for sequence in list(scheduler.running.values()):
        scheduler.abort_request(sequence.request.request_id)
    scheduler.close()
    if budget == 8:  # two tiles a step, spanning pictures
        assert encoded == [min(8 * step, sum(sizes)) for step in range(1, len(encoded) + 1)]
    else:
        assert encoded == [sum(sizes)] * len(encoded)


def test_a_repeated_picture_is_a_prefix_cache_hit_and_another_picture_is_not(
    tiny_vision_model: Any, make_engine: MakeEngine
) -> None:
    engine = make_engine(tiny_vision_model)
    first = run(generate_all(engine, [{"prompt": ASK, "images": [PICTURES[0]]}]))[0]
    again = run(generate_all(engine, [{"prompt": ASK, "images": [picture(1, 64, 64)]}]))[0]
    other = run(generate_all(engine, [{"prompt": ASK, "images": [PICTURES[1]]}]))[0]
    assert first.cached_tokens == 0
    # The same pixels (a new image object): all but the token that makes the first logits,
    # and no second encoding.
    assert again.cached_tokens == again.prompt_tokens - 1
    assert again.output_token_ids == first.output_token_ids
    # Another picture, the same prompt: only the tokens before its first image token.
    image_token = vision_of(tiny_vision_model).image_token_id
    other_prompt = _image_request(tiny_vision_model, "other", PICTURES[1]).prompt_token_ids
    assert other.cached_tokens == other_prompt.index(image_token) > 0
    vision = engine.stats().scheduler.vision
    assert vision is not None and vision.requests_encoded == 2
    assert vision.waiting_for_encoding == 0 and vision.encode_seconds > 0


def test_a_shared_system_prompt_before_pictures_is_stored_once_and_reused(
    tiny_vision_model: Any, make_engine: MakeEngine
) -> None:
    system = "<|im_start|>system\nYou read pages and answer briefly.<|im_end|>\n"
    boundary = len(tiny_vision_model[1].encode(system))
    jobs = [
        {"prompt": system + ASK, "images": [picture], "prefix_boundary": boundary}
        for picture in PICTURES[:2]
    ]
    engine = make_engine(tiny_vision_model)
    first, second = (run(generate_all(engine, [job]))[0] for job in jobs)
    engine.close()
    assert first.cached_tokens == 0 and second.cached_tokens >= boundary
    uncached = make_engine(tiny_vision_model, enable_prefix_cache=False)
    plain = run(generate_all(uncached, [dict(job, prefix_boundary=0) for job in jobs]))
    assert [first.output_token_ids, second.output_token_ids] == [
        final.output_token_ids for final in plain
    ]


def test_image_entries_are_saved_and_loaded_with_the_cache(
    tiny_vision_model: Any, make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = make_engine(tiny_vision_model)
    first = run(generate_all(engine, [{"prompt": ASK, "images": [PICTURES[2]]}]))[0]
    assert engine.save_cache_to_disk(str(tmp_path / "cache"))
    engine.close()
    fresh = make_engine(tiny_vision_model)
    assert fresh.load_cache_from_disk(str(tmp_path / "cache")) >= 1
    again = run(generate_all(fresh, [{"prompt": ASK, "images": [PICTURES[2]]}]))[0]
    assert again.cached_tokens == again.prompt_tokens - 1
    assert again.output_token_ids == first.output_token_ids
    assert fresh.scheduler.vision_queue is not None
    assert fresh.scheduler.vision_queue.requests_encoded == 0


def test_a_json_schema_over_a_picture(tiny_vision_model: Any, make_engine: MakeEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["cat", "dog"]}, "alone": {"type": "boolean"}},
        "required": ["kind", "alone"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        response_format=ResponseFormat("json_schema", schema=schema),
    )
    engine = make_engine(tiny_vision_model)
    final = run(generate_all(engine, [{"prompt": ASK, "images": [PICTURES[0]], "params": params}]))[
        0
    ]
    assert final.output_valid, final.output_text
    assert set(json.loads(final.output_text)) == {"kind", "alone"}


def test_a_chats_picture_and_video_parts_take_their_places(
    tiny_vision_model: Any, make_engine: MakeEngine
) -> None:
    from mlx_redis_worker.engine.prompt import chat_prompt

    parts = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What happens?"}]
    ids, _ = chat_prompt(
        tiny_vision_model[1], [{"role": "user", "content": parts}], system_prefix=False
    )
    text = "<|im_start|>user\n<image><video>What happens?<|im_end|>\n<|im_start|>assistant\n"
    media = {"images": [PICTURES[0]], "videos": [[PICTURES[1], PICTURES[2]]]}
    engine = make_engine(tiny_vision_model, enable_prefix_cache=False)
    chat, plain = run(generate_all(engine, [{"prompt": ids, **media}, {"prompt": text, **media}]))
    assert chat.output_token_ids == plain.output_token_ids
    assert chat.prompt_tokens == plain.prompt_tokens


def test_images_as_bytes_or_files_and_their_placeholders(
    tiny_vision_model: Any, make_engine: MakeEngine, tmp_path: Path
) -> None:
    path = tmp_path / "picture.png"
    path.write_bytes(png_bytes(1))
    engine = make_engine(tiny_vision_model, enable_prefix_cache=False)
    jobs = [
        {"prompt": ASK, "images": [picture(1)]},
        {"prompt": ASK, "images": [png_bytes(1)]},
        {"prompt": ASK, "images": [str(path)]},
        # A prompt of token ids (a rendered chat) is read back as its text.
        {"prompt": engine.tokenizer.encode(ASK), "images": [picture(1)]},
        # No placeholder: the picture goes before the text.
        {"prompt": "What is in this picture?", "images": [picture(1)]},
        {"prompt": "<image>What is in this picture?", "images": [picture(1)]},
    ]
    finals = run(generate_all(engine, jobs))
    assert len({tuple(f.output_token_ids) for f in finals[:4]}) == 1
    assert finals[4].output_token_ids == finals[5].output_token_ids
    bad = [
        ({"images": [picture(1), picture(2)]}, "marks 1 image"),  # two pictures, one placeholder
        ({"images": [b"not an image"]}, "not an image of an allowed format"),
        ({"images": [3]}, "PIL image, bytes or a file path"),
        ({"videos": [[]]}, "non-empty list of frames"),
    ]
    for keywords, message in bad:
        with pytest.raises(ValueError, match=message):
            run(engine.add_request(ASK, GREEDY, **keywords))
    with pytest.raises(ValueError, match="token ids in"):
        run(engine.add_request([1, 2, 10**6], GREEDY, images=[picture(1)]))
