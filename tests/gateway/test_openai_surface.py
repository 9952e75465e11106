"""The rest of the OpenAI surface, as OpenAI's own client (and langchain-openai) sees it: routes
that do not exist, ``models.retrieve``, several choices (``n``, lists of prompts) and
``/v1/responses``. A real gateway process in front of a real worker (the tiny random model)
and a real redis-server.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from langchain_openai import OpenAI

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent
from tests.gateway.conftest import Fleet
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.processes import mlx_worker
from tests.support.schemas import SMALL_SCHEMA

MODEL = "tiny"


def http_error(url: str, method: str = "GET", body: bytes | None = None) -> urllib.error.HTTPError:
    request = urllib.request.Request(url, data=body, method=method)
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    return caught.value


def openai_error(error: urllib.error.HTTPError) -> dict[str, Any]:
    assert error.headers["content-type"] == "application/json"
    body = json.loads(error.read())
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    fields: dict[str, Any] = body["error"]
    return fields


# -- routes that are not there ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/nothing", "/v2/chat/completions", "/favicon.ico", "/v1"])
def test_an_unknown_route_is_a_404_in_openais_shape(gateway: GatewayProcess, path: str) -> None:
    error = http_error(gateway.url + path)
    assert error.code == 404
    fields = openai_error(error)
    assert fields["type"] == "invalid_request_error"
    assert fields["code"] == "not_found"
    assert path in fields["message"]


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("PUT", "/health", "GET"),
    ],
)
def test_a_method_a_route_does_not_take_is_a_405_in_openais_shape(
    gateway: GatewayProcess, method: str, path: str, allowed: str
) -> None:
    error = http_error(gateway.url + path, method=method, body=b"{}" if method != "GET" else None)
    assert error.code == 405
    assert allowed in error.headers["allow"]
    fields = openai_error(error)
    assert fields["type"] == "invalid_request_error"
    assert fields["code"] == "method_not_allowed"
    assert method in fields["message"] and allowed in fields["message"]


def test_the_sdk_reads_a_missing_route_as_not_found(gateway: GatewayProcess) -> None:
    wrong = openai.OpenAI(base_url=gateway.url + "/v9", api_key="none", max_retries=0)
    with wrong, pytest.raises(openai.NotFoundError) as caught:
        wrong.models.list()
    assert caught.value.code == "not_found"


# -- models.retrieve --------------------------------------------------------------------------


def test_a_served_model_is_retrieved(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object, model.owned_by) == (MODEL, "model", "mlx-redis-worker")
    assert model.model_dump() == client.models.list().data[0].model_dump()


@pytest.mark.parametrize("name", ["no-such-model", "org/no-such-model"])
def test_an_unknown_model_is_retrieved_as_a_404_model_not_found(
    client: openai.OpenAI, name: str
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(name)
    body = caught.value.response.json()
    assert body["error"]["code"] == "model_not_found"
    assert body["error"]["param"] == "model"
    assert name in body["error"]["message"]


# -- several choices: a list of prompts, n > 1 --------------------------------------------------

TOKENS = 8
PROMPTS = ["Tell me a story", "Once upon a time", "The weather today"]
# Long enough that sharing its prefill shows: copies of it find all but its last token cached.
LONG_PROMPT = "Here is a long preamble that the copies of a request share. " * 6


def prefix_cache_stats(fleet: Fleet) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        async with Client(fleet.redis_url, prefix=fleet.prefix) as protocol_client:
            (reply,) = await protocol_client.stats()
            assert reply.ok, reply.error
            stats: dict[str, Any] = reply.result["prefix_cache"]
            return stats

    return asyncio.run(read())


@pytest.fixture(scope="module")
def greedy_texts(fleet: Fleet) -> list[DoneEvent]:
    """Each of PROMPTS answered greedily through the protocol client."""
    return [fleet.generate(prompt=p, max_tokens=TOKENS, temperature=0) for p in PROMPTS]


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(
    client: openai.OpenAI, greedy_texts: list[DoneEvent]
) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=TOKENS, temperature=0
    )
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert [choice.text for choice in answer.choices] == [d.output_text for d in greedy_texts]
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(d.usage.prompt_tokens for d in greedy_texts)
    assert answer.usage.completion_tokens == sum(d.usage.completion_tokens for d in greedy_texts)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.id.startswith("cmpl-")


def test_a_streamed_list_of_prompts_interleaves_its_choices_by_index(
    client: openai.OpenAI, greedy_texts: list[DoneEvent]
) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    texts = ["", "", ""]
    finished: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert texts == [d.output_text for d in greedy_texts]
    assert finished == {i: d.finish_reason for i, d in enumerate(greedy_texts)}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == sum(d.usage.completion_tokens for d in greedy_texts)
    assert usage.prompt_tokens == sum(d.usage.prompt_tokens for d in greedy_texts)


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_n_chat_choices_share_the_prompts_prefill(
    client: openai.OpenAI, fleet: Fleet, stream: bool
) -> None:
    # A prompt of its own, not cached before.
    messages: Any = [{"role": "user", "content": f"{stream}: {LONG_PROMPT}"}]
    before = prefix_cache_stats(fleet)
    fields: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": TOKENS}
    fields |= {"temperature": 1.0, "seed": 5, "n": 3}
    if stream:
        chunks = list(
            client.chat.completions.create(
                **fields, stream=True, stream_options={"include_usage": True}
            )
        )
        response_id = chunks[0].id
        texts = ["", "", ""]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        usage = chunks[-1].usage
    else:
        answer = client.chat.completions.create(**fields)
        response_id = answer.id
        assert [choice.index for choice in answer.choices] == [0, 1, 2]
        texts = [choice.message.content or "" for choice in answer.choices]
        usage = answer.usage
    assert len(set(texts)) == 3  # each copy samples with a seed of its own
    # Each choice is a job of its own, its usage in its log: the copies found the prompt's
    # prefill (all but its last token) in the prefix cache the first copy stored.
    dones = [fleet.logged_done(f"{response_id}.{index}") for index in range(3)]
    assert [done.output_text for done in dones] == texts
    prompt_tokens = dones[0].usage.prompt_tokens
    cached = [done.usage.cached_tokens for done in dones]
    # The first copy finds at most what earlier prompts share with it (a chat template's
    # opening), the others all of it but the last token.
    assert cached[0] < prompt_tokens // 2 and cached[1:] == [prompt_tokens - 1] * 2
    assert usage is not None
    assert usage.prompt_tokens == prompt_tokens  # the prompt, counted once
    assert usage.completion_tokens == sum(done.usage.completion_tokens for done in dones)
    after = prefix_cache_stats(fleet)
    assert after["hits"] - before["hits"] == 2 + (cached[0] > 0)
    assert after["tokens_saved"] - before["tokens_saved"] == sum(cached)


def test_n_with_a_list_of_prompts_orders_choices_prompt_by_prompt(
    client: openai.OpenAI, greedy_texts: list[DoneEvent]
) -> None:
    answer = client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=TOKENS, temperature=0
    )
    # Greedy: both copies of a prompt are its greedy answer; prompt i's copy j is i * n + j.
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    expected = [greedy_texts[0].output_text] * 2 + [greedy_texts[1].output_text] * 2
    assert [choice.text for choice in answer.choices] == expected
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == sum(d.usage.prompt_tokens for d in greedy_texts[:2])


# Over the worker's 32768 prompt tokens: its job ends with an invalid_job error.
TOO_LONG = " x" * 40000


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_choice_that_fails_fails_the_request(client: openai.OpenAI, stream: bool) -> None:
    fields: Any = {"model": MODEL, "prompt": [PROMPTS[0], TOO_LONG], "max_tokens": TOKENS}
    if not stream:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**fields)
        assert "tokens" in caught.value.response.json()["error"]["message"]
        return
    received: list[Any] = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in client.completions.create(**fields, stream=True):
            received.append(chunk)
    assert "tokens" in str(failed.value)
    assert received  # the opening chunks came first


def test_a_client_that_leaves_a_fan_out_aborts_its_jobs(
    gateway: GatewayProcess, fleet: Fleet
) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[0], "n": 3, "max_tokens": 4000, "stream": True}
    request = urllib.request.Request(
        f"{gateway.base_url}/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        response_id = answer.headers["x-request-id"]
        seen: set[int] = set()
        # Read until every choice has text: all three jobs are queued and running.
        while len(seen) < 3:
            line = answer.readline().decode()
            if line.startswith("data: ") and '"text":""' not in line:
                seen |= {choice["index"] for choice in json.loads(line[6:])["choices"]}
    dones = [fleet.logged_done(f"{response_id}.{index}") for index in range(3)]
    assert [done.finish_reason for done in dones] == ["abort"] * 3
    assert all(done.usage.completion_tokens < 4000 for done in dones)


def test_each_choice_counts_against_the_keys_concurrency_cap(
    gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    added = mlx_worker(
        "api-key",
        "add",
        f"fan-{uuid.uuid4().hex[:8]}",
        "--file",
        str(keys),
        "--max-concurrent",
        "2",
    )
    assert added.returncode == 0, added.stderr
    keyed = gateways.start("--api-keys", str(keys))
    with openai.OpenAI(
        base_url=keyed.base_url, api_key=added.stdout.strip(), max_retries=0
    ) as limited:
        fields: Any = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
        with pytest.raises(openai.RateLimitError) as caught:
            limited.completions.create(**fields, n=3)
        assert caught.value.code == "concurrency_limit_exceeded"
        # Two fit, and their slots are free again once they end.
        for _ in range(2):
            assert len(limited.completions.create(**fields, n=2).choices) == 2
        assert len(limited.completions.create(**{**fields, "prompt": PROMPTS[:2]}).choices) == 2


def test_langchains_openai_llm_batches_prompts_as_one_request(
    gateway: GatewayProcess, greedy_texts: list[DoneEvent]
) -> None:
    llm = OpenAI(
        base_url=gateway.base_url,
        api_key="none",
        model=MODEL,
        max_tokens=TOKENS,
        temperature=0,
        max_retries=0,
    )
    result = llm.generate(PROMPTS)
    assert [[g.text for g in gens] for gens in result.generations] == [
        [d.output_text] for d in greedy_texts
    ]
    assert llm.batch(PROMPTS[:2]) == [d.output_text for d in greedy_texts[:2]]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 17}, "n"),
        ({"prompt": PROMPTS, "n": 6}, "n"),
        ({"prompt": ["p"] * 17}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ["p", 3]}, "prompt"),
        ({"n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_too_many_choices_or_prompts_that_are_not_strings_are_a_400(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**{"model": MODEL, "prompt": "p", "max_tokens": 2, **fields})
    assert caught.value.response.json()["error"]["param"] == param


# -- /v1/responses -----------------------------------------------------------------------------

STORY: Any = [{"role": "user", "content": "Tell me a story"}]


def test_a_response_is_the_chat_answer_for_its_input(client: openai.OpenAI, fleet: Fleet) -> None:
    expected = fleet.generate(messages=STORY, max_tokens=TOKENS, temperature=0)
    response = client.responses.create(
        model=MODEL, input="Tell me a story", max_output_tokens=TOKENS, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == expected.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    # Cut by max_output_tokens: incomplete, and says why.
    assert expected.finish_reason == "length"
    assert response.status == "incomplete" and message.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens == TOKENS
    assert response.max_output_tokens == TOKENS and response.temperature == 0


def test_instructions_and_a_message_list_are_the_chats_turns(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    turns: Any = [
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Once"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story"},
        {"role": "assistant", "content": "Once"},
        {"role": "user", "content": "go"},
    ]
    expected = fleet.generate(messages=messages, max_tokens=TOKENS, temperature=0)
    response = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input=turns,
        max_output_tokens=TOKENS,
        temperature=0,
    )
    assert response.output_text == expected.output_text
    assert response.instructions == "Be brief."
    assert response.usage is not None
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_a_streamed_response_is_openais_event_sequence(client: openai.OpenAI, fleet: Fleet) -> None:
    expected = fleet.generate(messages=STORY, max_tokens=TOKENS, temperature=0)
    events = list(
        client.responses.create(
            model=MODEL,
            input="Tell me a story",
            max_output_tokens=TOKENS,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(delta.delta for delta in deltas)
    assert text == expected.output_text
    created, last = events[0], events[-1]
    assert created.type == "response.created" and created.response.status == "in_progress"
    assert last.type == "response.incomplete"
    assert last.response.id == created.response.id
    assert last.response.output_text == text
    assert last.response.usage is not None and last.response.usage.output_tokens == TOKENS
    done = [e for e in events if e.type == "response.output_text.done"]
    assert done[0].text == text  # type: ignore[union-attr]


def test_a_response_carries_its_tokens_logprobs_when_asked(client: openai.OpenAI) -> None:
    fields: Any = {
        "model": MODEL,
        "input": "Tell me a story",
        "max_output_tokens": TOKENS,
        "temperature": 0,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    response = client.responses.create(**fields)
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert len(part.logprobs) == TOKENS
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    # Greedy: each token is its likeliest alternative.
    assert all(entry.top_logprobs[0].token == entry.token for entry in part.logprobs)
    # The tokens' bytes (this gateway's extra field, as chat's) are the text.
    joined = bytes(b for entry in part.logprobs for b in getattr(entry, "bytes", None) or ())
    text = joined.decode("utf-8", "replace")
    assert part.text in (text, text.removeprefix(" "))

    events = list(client.responses.create(**fields, stream=True))
    streamed = [
        entry.token
        for event in events
        if event.type == "response.output_text.delta"
        for entry in event.logprobs
    ]
    assert streamed == [entry.token for entry in part.logprobs]
    assert client.responses.create(**{**fields, "include": [], "top_logprobs": None}).output[
        0
    ].content[0].logprobs in ([], None)  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_a_response_in_a_json_schema_validates(client: openai.OpenAI, stream: bool) -> None:
    fields: Any = {
        "model": MODEL,
        "input": "Tell me a story",
        "max_output_tokens": 64,
        "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "small", "schema": SMALL_SCHEMA}},
    }
    if stream:
        events = list(client.responses.create(**fields, stream=True))
        assert events[-1].type == "response.completed"
        text = events[-1].response.output_text
    else:
        response = client.responses.create(**fields)
        assert response.status == "completed"
        text = response.output_text
    jsonschema.validate(json.loads(text), SMALL_SCHEMA)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "file_search_call", "id": "f"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"extra_body": {"priority": 101}}, "priority"),  # the extension, checked as in chat
    ],
)
def test_a_response_that_cannot_be_honoured_is_a_400_naming_the_parameter(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": MODEL, "input": "hi", **fields})
    assert caught.value.response.json()["error"]["param"] == param


def test_a_response_for_an_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="no-such-model", input="hi")
    assert caught.value.response.json()["error"]["code"] == "model_not_found"
