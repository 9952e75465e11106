"""Structured output through the real engine on real models: constrained requests (JSON
schemas, a regex, a Lark grammar) share a batch with unconstrained ones without changing them,
their outputs match, and what cannot be enforced is refused up front."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

from mlx_redis_worker.engine import EngineCore, RequestOutput, ResponseFormat, SamplingParams
from tests.support.engines import PROMPTS, MakeEngine
from tests.support.waiting import run

# Small schemas whose every match is a handful of tokens (enums, booleans, bounded integers,
# bounded arrays, no free strings): even the tiny random model, greedy or sampling, ends each
# by the grammar's own end well within MAX_TOKENS.
SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["color", "n"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"enum": ["yes", "no"]},
]
REGEX = r"[a-c]{2,4}-[0-9]{1,2}"
# A Lark grammar (llguidance's dialect) and the regular expression of the same language.
LARK = "\n".join(
    [
        'start: pair ("," pair)?',
        'pair: KEY "=" VALUE',
        'KEY: "a" | "b"',
        "VALUE: /[0-9]{1,2}/",
    ]
)
LARK_LANGUAGE = r"[ab]=[0-9]{1,2}(,[ab]=[0-9]{1,2})?"
MAX_TOKENS = 48
UNCONSTRAINED_TOKENS = 48  # streaming until every request has begun


@dataclass(frozen=True)
class Constrained:
    response_format: ResponseFormat
    temperature: float
    seed: int | None = None


def constrained_requests() -> list[Constrained]:
    """Every format twice: greedy, and sampled hot with a seed."""
    formats = [ResponseFormat("json_schema", schema=schema) for schema in SCHEMAS]
    formats += [ResponseFormat("regex", pattern=REGEX), ResponseFormat("grammar", lark=LARK)]
    greedy = [Constrained(f, 0.0) for f in formats]
    return greedy + [Constrained(f, 1.0, seed) for seed, f in enumerate(formats)]


def assert_matches(response_format: ResponseFormat, output: RequestOutput) -> None:
    """The output matches its format by an independent check (jsonschema, re), and the engine
    says so."""
    text = output.output_text
    assert output.finish_reason == "stop", (response_format, text)
    assert output.output_valid is True, (response_format, text)
    if response_format.type == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif response_format.type == "json_schema":
        jsonschema.validate(json.loads(text), dict(response_format.schema or {}))
    elif response_format.type == "regex":
        assert re.fullmatch(response_format.pattern or "", text), text
    else:
        assert re.fullmatch(LARK_LANGUAGE, text), text


@dataclass
class Timed:
    outputs: list[RequestOutput]
    first: float  # when its first output arrived (monotonic)
    last: float

    @property
    def final(self) -> RequestOutput:
        return self.outputs[-1]


async def timed(engine: EngineCore, request_id: str) -> Timed:
    outputs: list[RequestOutput] = []
    first = 0.0
    async for output in engine.stream_outputs(request_id):
        if not outputs:
            first = time.monotonic()
        outputs.append(output)
    return Timed(outputs, first, time.monotonic())


async def run_all(
    engine: EngineCore, requests: list[tuple[str | list[int], SamplingParams]]
) -> list[Timed]:
    """Add every request at once (nothing awaited in between), then follow them all."""
    ids = [await engine.add_request(prompt, params) for prompt, params in requests]
    return list(await asyncio.gather(*(timed(engine, rid) for rid in ids)))


def assert_overlapped(runs: list[Timed]) -> None:
    """Every request had begun before any ended: they ran in one batch."""
    assert max(r.first for r in runs) < min(r.last for r in runs)


def assert_ran_beside(steps: list[list[str]], these: list[str], others: list[str]) -> None:
    """Each of ``these`` was still streaming when every one of ``others`` had begun: they
    shared the decode batch (counted in engine steps; the clock would order two requests'
    outputs of one step by when their readers woke)."""

    def first(r: str) -> int:
        return min(i for i, ids in enumerate(steps) if r in ids)

    def last(r: str) -> int:
        return max(i for i, ids in enumerate(steps) if r in ids)

    assert max(first(r) for r in others) < min(last(r) for r in these)


def test_constrained_requests_share_a_batch_without_changing_the_others(
    tiny_model: Any, make_engine: MakeEngine
) -> None:
    # Whole chunks beside decoding: the constrained requests whose format compiles in
    # add_request arrive while the plain ones stream, and at the default stall bound (0.2 of a
    # step) their prefill could end after the plain ones (seen once in a loaded suite run).
    engine = make_engine(
        tiny_model,
        max_num_seqs=32,
        prefill_batch_size=32,
        enable_prefix_cache=False,
        max_prefill_stall=math.inf,
    )
    plain_prompts = PROMPTS[:4]
    plain = SamplingParams(max_tokens=UNCONSTRAINED_TOKENS, temperature=0.0)
    constrained = constrained_requests()
    mixed_requests: list[tuple[str | list[int], SamplingParams]] = [
        (p, plain) for p in plain_prompts
    ]
    for index, c in enumerate(constrained):
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=c.temperature,
            seed=c.seed,
            response_format=c.response_format,
        )
        mixed_requests.append((PROMPTS[4 + index], params))

    async def scenario() -> tuple[list[Timed], list[Timed]]:
        await engine.start()
        # Compiled before the requests go in: add_request waits for a new format's compile
        # (the first one builds the tokenizer's index, seconds on a loaded machine), and the
        # plain requests added before it could finish meanwhile, never sharing a batch.
        for c in constrained[: len(constrained) // 2]:
            await engine.scheduler.grammars.compile_async(c.response_format)
        mixed = await run_all(engine, mixed_requests)
        alone = await run_all(engine, [(p, plain) for p in plain_prompts])
        await engine.stop()
        return mixed, alone

    steps: list[list[str]] = []  # the request ids of each engine step's outputs
    engine.set_step_listener(lambda outputs: steps.append([o.request_id for o in outputs]))
    mixed, alone = run(scenario())
    plain_ids = [r.final.request_id for r in mixed[: len(plain_prompts)]]
    assert_ran_beside(steps, plain_ids, [r.final.request_id for r in mixed])
    for with_others, by_themselves in zip(mixed[: len(plain_prompts)], alone, strict=True):
        assert with_others.final.output_token_ids == by_themselves.final.output_token_ids
        assert with_others.final.output_text == by_themselves.final.output_text
        assert with_others.final.output_valid is None  # unconstrained: no verdict
    for c, result in zip(constrained, mixed[len(plain_prompts) :], strict=True):
        assert_matches(c.response_format, result.final)
        assert result.final.completion_tokens < MAX_TOKENS
    # Each distinct format compiled once; every request found its format compiled.
    stats = engine.scheduler.grammars.stats
    assert stats.compiled == len(SCHEMAS) + 2
    assert stats.cache_hits == len(constrained)
    # Every mask's token came from its sequence's own sampler, none from a context read.
    assert stats.context_reads == 0


# A response one might ask a small model for, with bounded strings and arrays.
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {
            "type": "array",
            "items": {"enum": ["reading", "hiking", "chess", "cooking", "music"]},
            "maxItems": 3,
        },
        "student": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "student"],
    "additionalProperties": False,
}


def _chat(tokenizer: Any, question: str) -> str:
    prompt: str = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return prompt


@pytest.mark.smollm2
def test_smollm2_sampled_json_matches_a_realistic_schema_beside_greedy_chats(
    smollm2_model: Any, make_engine: MakeEngine
) -> None:
    _, tokenizer = smollm2_model
    engine = make_engine(smollm2_model, enable_prefix_cache=False)
    questions = ["What is the capital of France?", "Name a primary color."]
    plain_requests: list[tuple[str | list[int], SamplingParams]] = [
        (_chat(tokenizer, q), SamplingParams(max_tokens=24, temperature=0.0)) for q in questions
    ]
    person = ResponseFormat("json_schema", schema=PERSON)
    ask = _chat(tokenizer, "Describe a person as JSON: name, age, city, hobbies, student.")
    constrained_requests_: list[tuple[str | list[int], SamplingParams]] = [
        (ask, SamplingParams(max_tokens=160, temperature=0.7, seed=seed, response_format=person))
        for seed in range(3)
    ]

    async def scenario() -> tuple[list[Timed], list[Timed]]:
        await engine.start()
        mixed = await run_all(engine, plain_requests + constrained_requests_)
        alone = await run_all(engine, plain_requests)
        await engine.stop()
        return mixed, alone

    mixed, alone = run(scenario())
    # The sampled requests share one compiled grammar and run together. The short greedy
    # chats may end before that compile does on a loaded machine (the compile thread runs
    # at a low priority), so their overlap with them is not asserted, only their texts.
    assert_overlapped(mixed[2:])
    for with_others, by_themselves in zip(mixed[:2], alone, strict=True):
        assert with_others.final.output_text == by_themselves.final.output_text
    assert "Paris" in alone[0].final.output_text
    answers = []
    for result in mixed[2:]:
        assert_matches(person, result.final)
        answers.append(json.loads(result.final.output_text))
    assert len({json.dumps(a) for a in answers}) > 1  # sampled, and the seeds differ
    assert engine.scheduler.grammars.stats.compiled == 1


# Schemas (and other formats) llguidance cannot enforce, and what the refusal names.
UNENFORCEABLE: list[tuple[ResponseFormat, str]] = [
    (
        ResponseFormat(
            "json_schema",
            schema={"type": "object", "properties": {"x": {"type": "string", "format": "zip"}}},
        ),
        "Unknown format",
    ),
    (
        ResponseFormat(
            "json_schema",
            schema={"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        ),
        "uniqueItems",
    ),
    (ResponseFormat("json_schema", schema={"not": {"type": "string"}}), "not"),
    (ResponseFormat("json_schema", schema={"type": "integer", "$ref": "#/$defs/gone"}), "gone"),
    (ResponseFormat("json_schema", schema={"type": "nonsense"}), "nonsense"),
    (ResponseFormat("regex", pattern="(unclosed"), "unclosed"),
    (ResponseFormat("grammar", lark="start: undefined_rule"), "undefined_rule"),
]


def test_a_format_that_cannot_be_enforced_is_refused_and_the_engine_keeps_serving(
    engine: EngineCore,
) -> None:
    flag = ResponseFormat("json_schema", schema=SCHEMAS[0])

    async def scenario() -> tuple[RequestOutput, RequestOutput]:
        await engine.start()
        for response_format, named in UNENFORCEABLE:
            params = SamplingParams(max_tokens=MAX_TOKENS, response_format=response_format)
            with pytest.raises(ValueError, match="cannot be enforced") as caught:
                await engine.add_request("hello", params)
            assert named in str(caught.value), caught.value
        plain = await engine.generate("hello", SamplingParams(max_tokens=8, temperature=0.0))
        constrained = await engine.generate(
            "hello", SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, response_format=flag)
        )
        await engine.stop()
        return plain, constrained

    plain, constrained = run(scenario())
    assert plain.finished and plain.completion_tokens == 8
    assert_matches(flag, constrained)
    stats = engine.scheduler.grammars.stats
    assert stats.refused == len(UNENFORCEABLE)
    assert stats.compiled == 1  # nothing refused was cached
    assert engine.scheduler.num_requests_failed == 0


def test_a_constrained_request_cut_by_max_tokens_is_not_valid(engine: EngineCore) -> None:
    fifty = ResponseFormat(
        "json_schema", schema={"type": "array", "items": {"type": "boolean"}, "minItems": 50}
    )
    output = engine.generate_batch_sync(
        ["hello"], SamplingParams(max_tokens=8, temperature=0.0, response_format=fifty)
    )[0]
    assert output.finish_reason == "length"
    assert output.completion_tokens == 8
    assert output.output_valid is False
    assert output.output_text.startswith("[")  # constrained all the same: a prefix of a match
    with pytest.raises(json.JSONDecodeError):
        json.loads(output.output_text)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_an_output_cut_exactly_where_its_match_is_complete_is_valid(
    engine: EngineCore, index: int
) -> None:
    """Greedy, so the same tokens each time: max_tokens equal to the length of the output that
    ended by the grammar's own end cuts it before its EOS (length), yet it matches; one token
    fewer does not."""
    schema = ResponseFormat("json_schema", schema=SCHEMAS[index])

    def generate(max_tokens: int) -> RequestOutput:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, response_format=schema)
        return engine.generate_batch_sync(["hello"], params)[0]

    whole = generate(MAX_TOKENS)
    assert_matches(schema, whole)
    exact = generate(whole.completion_tokens)
    assert (exact.finish_reason, exact.output_text) == ("length", whole.output_text)
    assert exact.output_valid is True
    jsonschema.validate(json.loads(exact.output_text), SCHEMAS[index])
    short = generate(whole.completion_tokens - 1)
    assert (short.finish_reason, short.output_valid) == ("length", False), short.output_text


def test_the_same_schema_compiles_once(engine: EngineCore) -> None:
    schema = SCHEMAS[1]
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format=ResponseFormat("json_schema", schema=schema),
    )
    first = engine.generate_batch_sync(["hello"], params)[0]
    # An equal schema, another dict: the same key.
    again = ResponseFormat("json_schema", schema=json.loads(json.dumps(schema)))
    second = engine.generate_batch_sync(
        ["hello"], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, response_format=again)
    )[0]
    stats = engine.scheduler.grammars.stats
    assert (stats.compiled, stats.cache_hits) == (1, 1)
    assert len(stats.compile_seconds) == 1
    assert first.output_text == second.output_text
    assert_matches(again, second)


def test_a_schemas_property_order_is_part_of_its_key(engine: EngineCore) -> None:
    """llguidance writes an object's properties in the schema's order: the same properties in
    another order are another grammar, not a cache hit that would hand the request the order
    of whichever schema was compiled first."""
    flag = {"type": "boolean"}
    forward = {"a": flag, "b": flag}
    backward = {"b": flag, "a": flag}

    def person(properties: dict[str, Any]) -> ResponseFormat:
        schema = {
            "type": "object",
            "properties": properties,
            "required": ["a", "b"],
            "additionalProperties": False,
        }
        return ResponseFormat("json_schema", schema=schema)

    assert person(forward).key() != person(backward).key()
    assert person(forward).key() == person(dict(forward)).key()
    texts = [
        engine.generate_batch_sync(
            ["hello"],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, response_format=person(p)),
        )[0].output_text
        for p in (forward, backward, forward)
    ]
    assert list(json.loads(texts[0])) == ["a", "b"]
    assert list(json.loads(texts[1])) == ["b", "a"]
    assert texts[2] == texts[0]
    stats = engine.scheduler.grammars.stats
    assert (stats.compiled, stats.cache_hits) == (2, 1)


def test_stop_strings_with_a_response_format_are_refused(engine: EngineCore) -> None:
    params = SamplingParams(
        max_tokens=MAX_TOKENS, stop=["}"], response_format=ResponseFormat("json_object")
    )
    with pytest.raises(ValueError, match="stop strings"):
        engine.generate_batch_sync(["hello"], params)

    async def added() -> None:
        await engine.add_request("hello", params)

    with pytest.raises(ValueError, match="stop strings"):
        run(added())
    assert engine.scheduler.grammars.stats.compiled == 0  # refused before compiling


def test_json_object_gives_an_object(engine: EngineCore) -> None:
    json_object = ResponseFormat("json_object")
    output = engine.generate_batch_sync(
        [PROMPTS[3]],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, response_format=json_object),
    )[0]
    assert_matches(json_object, output)
