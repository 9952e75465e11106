"""The gateway's OpenAI API as OpenAI's own client sees it: a real gateway process in front of
a real worker (the tiny random model) and a real redis-server.

Greedy answers (temperature 0) are deterministic, so they are compared exactly: streamed with
non-streamed, and the gateway's with the protocol client's for the same prompt.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, QueuedEvent
from tests.gateway.conftest import Fleet
from tests.support.gateway import GatewayProcess
from tests.support.schemas import SMALL_SCHEMA

MODEL = "tiny"
TOKENS = 12  # of every greedy answer: the tiny model makes about 100 per second
CHAT: Any = [{"role": "user", "content": "Tell me a story"}]
PROMPT = "Tell me a story"


# -- the protocol client's answers, to compare with ----------------------------------------


@dataclass(frozen=True)
class Greedy:
    chat: DoneEvent  # CHAT, TOKENS tokens, temperature 0
    text: DoneEvent  # PROMPT, the same


@pytest.fixture(scope="module")
def greedy(fleet: Fleet) -> Greedy:
    return Greedy(
        chat=fleet.generate(messages=CHAT, max_tokens=TOKENS, temperature=0),
        text=fleet.generate(prompt=PROMPT, max_tokens=TOKENS, temperature=0),
    )


def chat(client: openai.OpenAI, **fields: Any) -> ChatCompletion:
    answer: ChatCompletion = client.chat.completions.create(
        **{"model": MODEL, "messages": CHAT, "max_tokens": TOKENS, "temperature": 0, **fields}
    )
    return answer


def complete(client: openai.OpenAI, **fields: Any) -> Completion:
    answer: Completion = client.completions.create(
        **{"model": MODEL, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, **fields}
    )
    return answer


def chat_chunks(client: openai.OpenAI, **fields: Any) -> list[ChatCompletionChunk]:
    return list(
        client.chat.completions.create(
            **{
                "model": MODEL,
                "messages": CHAT,
                "max_tokens": TOKENS,
                "temperature": 0,
                "stream": True,
                **fields,
            }
        )
    )


def text_chunks(client: openai.OpenAI, **fields: Any) -> list[Completion]:
    return list(
        client.completions.create(
            **{
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": TOKENS,
                "temperature": 0,
                "stream": True,
                **fields,
            }
        )
    )


def chat_text(chunks: list[ChatCompletionChunk]) -> str:
    return "".join(choice.delta.content or "" for chunk in chunks for choice in chunk.choices)


def completion_text(chunks: list[Completion]) -> str:
    return "".join(choice.text for chunk in chunks for choice in chunk.choices)


def finish_reasons(chunks: list[ChatCompletionChunk] | list[Completion]) -> list[str]:
    return [
        choice.finish_reason
        for chunk in chunks
        for choice in chunk.choices
        if choice.finish_reason is not None
    ]


def stop_string_in(text: str) -> tuple[str, str]:
    """A stop string from a greedy text (one that first occurs past its start), and the text
    that then comes out: everything before it."""
    for start in range(len(text) // 2, len(text) - 2):
        candidate = text[start : start + 3]
        if text.find(candidate) > 0:
            return candidate, text[: text.find(candidate)]
    raise AssertionError(f"no stop string found in {text!r}")


# -- the greedy answer: non-streamed, streamed, and as the protocol gives it ----------------


def test_a_greedy_chat_answer_is_the_protocol_clients(
    client: openai.OpenAI, greedy: Greedy
) -> None:
    answer = chat(client)
    assert answer.object == "chat.completion" and answer.model == MODEL
    assert answer.id.startswith("chatcmpl-")
    [choice] = answer.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy.chat.output_text != ""
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == greedy.chat.usage.prompt_tokens
    assert answer.usage.completion_tokens == TOKENS
    assert answer.usage.total_tokens == greedy.chat.usage.prompt_tokens + TOKENS


def test_a_greedy_completion_is_the_protocol_clients(client: openai.OpenAI, greedy: Greedy) -> None:
    answer = complete(client)
    assert answer.object == "text_completion" and answer.id.startswith("cmpl-")
    [choice] = answer.choices
    assert choice.text == greedy.text.output_text != ""
    assert choice.finish_reason == "length"
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == greedy.text.usage.prompt_tokens
    assert answer.usage.completion_tokens == TOKENS


def test_a_streamed_chat_is_the_non_streamed_text_under_one_id(
    client: openai.OpenAI, greedy: Greedy
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=TOKENS, temperature=0, stream=True
    )
    chunks = list(raw.parse())
    assert chat_text(chunks) == greedy.chat.output_text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert finish_reasons(chunks) == ["length"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {chunk.id for chunk in chunks} == {raw.headers["x-request-id"]}
    assert raw.headers["x-request-id"].startswith("chatcmpl-")
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)  # not asked for


def test_a_streamed_completion_is_the_non_streamed_text_under_one_id(
    client: openai.OpenAI, greedy: Greedy
) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True
    )
    chunks = list(raw.parse())
    assert completion_text(chunks) == greedy.text.output_text
    assert finish_reasons(chunks) == ["length"]
    assert {chunk.id for chunk in chunks} == {raw.headers["x-request-id"]}
    assert raw.headers["x-request-id"].startswith("cmpl-")
    assert all(chunk.usage is None for chunk in chunks)


def test_a_non_streamed_answer_carries_its_id_in_x_request_id(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0
    )
    assert raw.parse().id == raw.headers["x-request-id"]


def test_usage_comes_in_a_last_chunk_of_its_own_when_asked_for(
    client: openai.OpenAI, greedy: Greedy
) -> None:
    include = {"stream_options": {"include_usage": True}}
    for chunks, done in (
        (chat_chunks(client, **include), greedy.chat),
        (text_chunks(client, **include), greedy.text),
    ):
        *rest, last = chunks
        assert last.choices == []
        assert last.usage is not None
        assert last.usage.prompt_tokens == done.usage.prompt_tokens
        assert last.usage.completion_tokens == TOKENS
        assert last.usage.total_tokens == done.usage.prompt_tokens + TOKENS
        assert all(chunk.usage is None for chunk in rest)
        assert finish_reasons(rest) == ["length"]
        assert len({chunk.id for chunk in chunks}) == 1


def test_the_raw_stream_is_server_sent_events_numbered_by_seq_ending_with_done(
    gateway: GatewayProcess, fleet: Fleet
) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{gateway.base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        request_id = answer.headers["x-request-id"]
        raw = answer.read().decode()

    messages = [block for block in raw.replace("\r\n", "\n").split("\n\n") if block.strip()]
    fields = [dict(line.split(": ", 1) for line in block.split("\n")) for block in messages]
    assert fields[-1] == {"data": "[DONE]"}
    chunks = [json.loads(message["data"]) for message in fields[:-1]]
    assert {chunk["id"] for chunk in chunks} == {request_id}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert raw.count("[DONE]") == 1
    # Each chunk's SSE id is the seq of the event it came from (the role chunk: the queued
    # marker's), so a client can resume after the last id it got.
    shown = [
        event.seq
        for event in fleet.logged_events(request_id)
        if isinstance(event, QueuedEvent | DoneEvent)
        or (isinstance(event, DeltaEvent) and event.new_text)
    ]
    assert [int(message["id"]) for message in fields[:-1]] == shown


# -- sampling parameters --------------------------------------------------------------------


def test_max_completion_tokens_bounds_the_answer(client: openai.OpenAI, greedy: Greedy) -> None:
    answer = chat(client, max_tokens=TOKENS, max_completion_tokens=4)
    assert answer.usage is not None and answer.usage.completion_tokens == 4
    assert answer.choices[0].finish_reason == "length"
    text = answer.choices[0].message.content
    assert text and greedy.chat.output_text.startswith(text) and text != greedy.chat.output_text


def test_max_tokens_bounds_a_completion(client: openai.OpenAI, greedy: Greedy) -> None:
    answer = complete(client, max_tokens=3)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert answer.choices[0].finish_reason == "length"
    assert greedy.text.output_text.startswith(answer.choices[0].text)


def test_a_stop_string_ends_a_chat_before_it(client: openai.OpenAI, greedy: Greedy) -> None:
    stop, before = stop_string_in(greedy.chat.output_text)
    answer = chat(client, stop=stop)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == before
    assert stop not in before
    streamed = chat_chunks(client, stop=stop)
    assert chat_text(streamed) == before and finish_reasons(streamed) == ["stop"]


def test_a_list_of_stop_strings_ends_a_completion_at_the_first_found(
    client: openai.OpenAI, greedy: Greedy
) -> None:
    stop, before = stop_string_in(greedy.text.output_text)
    answer = complete(client, stop=["never in the text \x07", stop])
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == before
    assert stop not in before
    streamed = text_chunks(client, stop=[stop, "never in the text \x07"])
    assert completion_text(streamed) == before and finish_reasons(streamed) == ["stop"]


def test_a_seed_makes_sampling_repeatable(client: openai.OpenAI, greedy: Greedy) -> None:
    first = chat(client, temperature=1.0, seed=1234).choices[0].message.content
    streamed = chat_text(chat_chunks(client, temperature=1.0, seed=1234))
    other_seed = chat(client, temperature=1.0, seed=4321).choices[0].message.content
    assert first == streamed
    assert first != other_seed  # the seed is what makes them equal
    assert first != greedy.chat.output_text  # and it was sampled, not greedy
    negative = complete(client, temperature=1.0, seed=-7).choices[0].text
    assert complete(client, temperature=1.0, seed=-7).choices[0].text == negative


def test_chat_logprobs_name_each_token_with_its_top_alternatives(
    client: openai.OpenAI,
) -> None:
    answer = chat(client, logprobs=True, top_logprobs=3)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert answer.usage is not None
    assert len(logprobs.content) == answer.usage.completion_tokens == TOKENS
    for entry in logprobs.content:
        # A token is its text, with its bytes (a part of a character shows as U+FFFD).
        assert entry.bytes is not None
        assert entry.token == bytes(entry.bytes).decode("utf-8", "replace")
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        tops = [top.logprob for top in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        for top in entry.top_logprobs:
            assert top.bytes is not None
            assert top.token == bytes(top.bytes).decode("utf-8", "replace")
        # Greedy: the chosen token is the likeliest one.
        assert (entry.bytes, entry.logprob) == (entry.top_logprobs[0].bytes, tops[0])
    # The tokens' bytes are the answer (the detokenizer drops a first token's leading space).
    joined = bytes(byte for entry in logprobs.content for byte in entry.bytes or ())
    content = answer.choices[0].message.content
    text = joined.decode("utf-8", "replace")
    assert content in (text, text.removeprefix(" "))

    streamed = chat_chunks(client, logprobs=True, top_logprobs=3)
    streamed_entries = [
        entry
        for chunk in streamed
        for choice in chunk.choices
        if choice.logprobs is not None and choice.logprobs.content is not None
        for entry in choice.logprobs.content
    ]
    assert [(e.token, e.bytes) for e in streamed_entries] == [
        (e.token, e.bytes) for e in logprobs.content
    ]


def test_chat_logprobs_without_top_logprobs_give_the_sampled_tokens_only(
    client: openai.OpenAI,
) -> None:
    logprobs = chat(client, max_tokens=3, logprobs=True).choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 3
    assert all(entry.top_logprobs == [] for entry in logprobs.content)
    assert chat(client, max_tokens=3).choices[0].logprobs is None


def test_completion_logprobs_n_are_the_logged_tokens_with_n_alternatives(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    answer = complete(client, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert logprobs.tokens is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == TOKENS
    assert len(logprobs.top_logprobs) == TOKENS
    assert all(len(alternatives) == 2 for alternatives in logprobs.top_logprobs)
    for token, chosen, alternatives in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert max(alternatives.values()) == chosen and alternatives[token] == chosen
    # The names are the texts of the tokens the worker generated, which start where the text
    # offsets say.
    generated = [
        item
        for event in fleet.logged_events(answer.id)
        if isinstance(event, DeltaEvent)
        for item in event.logprobs or ()
    ]
    assert [item.token_id for item in generated] == answer_token_ids(fleet, answer.id)
    texts = [(item.token_bytes or b"").decode("utf-8", "replace") for item in generated]
    assert logprobs.tokens == texts
    assert logprobs.text_offset is not None and logprobs.text_offset[0] == 0
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def answer_token_ids(fleet: Fleet, request_id: str) -> list[int]:
    return [
        token
        for event in fleet.logged_events(request_id)
        if isinstance(event, DeltaEvent)
        for token in event.new_token_ids
    ]


# -- chat messages --------------------------------------------------------------------------


def test_content_as_text_parts_is_the_joined_text(client: openai.OpenAI, greedy: Greedy) -> None:
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}]
    answer = chat(client, messages=[{"role": "user", "content": parts}])
    assert answer.choices[0].message.content == greedy.chat.output_text
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == greedy.chat.usage.prompt_tokens


def test_a_developer_message_is_a_system_message(client: openai.OpenAI, fleet: Fleet) -> None:
    instruction = "You are a pirate. Speak like one, always."

    def through_protocol(role: str) -> DoneEvent:
        messages = [{"role": role, "content": instruction}, *CHAT]
        return fleet.generate(messages=messages, max_tokens=TOKENS, temperature=0)

    as_system, as_user = through_protocol("system"), through_protocol("user")
    assert as_system.output_text != as_user.output_text  # the role shows in the answer
    answer = chat(client, messages=[{"role": "developer", "content": instruction}, *CHAT])
    assert answer.choices[0].message.content == as_system.output_text
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_a_conversation_with_an_assistant_turn_is_the_protocol_clients(
    client: openai.OpenAI, fleet: Fleet
) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Once"}, {"role": "user", "content": "go"}]
    expected = fleet.generate(messages=messages, max_tokens=6, temperature=0)
    answer = chat(client, messages=messages, max_tokens=6)
    assert answer.choices[0].message.content == expected.output_text
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens


def test_user_is_recorded_in_the_jobs_metadata(client: openai.OpenAI, fleet: Fleet) -> None:
    answer = chat(client, max_tokens=2, user="alice")
    assert answer.choices[0].finish_reason == "length"
    done = fleet.logged_done(answer.id)
    assert done.metadata == {"user": "alice"}


# -- models and health ----------------------------------------------------------------------


def test_the_models_list_is_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_health_names_the_served_models(gateway: GatewayProcess) -> None:
    with urllib.request.urlopen(f"{gateway.url}/health", timeout=10) as answer:
        assert answer.status == 200
        health = json.loads(answer.read())
    assert health["status"] == "ok" and health["models"] == [MODEL]
    # How busy its Redis commands are, told beside (not a failure): idle here.
    assert health["redis"]["saturated"] is False and health["redis"]["max_in_flight"] == 256


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_an_unknown_model_is_a_404_model_not_found(client: openai.OpenAI, stream: bool) -> None:
    with pytest.raises(openai.NotFoundError) as chat_error:
        chat(client, model="no-such-model", stream=stream)
    with pytest.raises(openai.NotFoundError) as text_error:
        complete(client, model="no-such-model", stream=stream)
    for error in (chat_error.value, text_error.value):
        assert error.status_code == 404
        assert error.code == "model_not_found" and error.param == "model"
        assert error.type == "invalid_request_error"
        assert "no-such-model" in error.message


# -- structured output ---------------------------------------------------------------------

JSON_SCHEMA: Any = {"type": "json_schema", "json_schema": {"name": "p", "schema": SMALL_SCHEMA}}
STRUCTURED_TOKENS = 48


def raw_chunks(gateway: GatewayProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed chat, as sent (this gateway's extensions included)."""
    request = urllib.request.Request(
        f"{gateway.base_url}/chat/completions",
        data=json.dumps({"model": MODEL, "stream": True, **body}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        raw = answer.read().decode()
    blocks = [block for block in raw.replace("\r\n", "\n").split("\n\n") if block.strip()]
    data = [
        line.removeprefix("data: ")
        for block in blocks
        for line in block.split("\n")
        if line.startswith("data: ")
    ]
    assert data[-1] == "[DONE]"
    return [json.loads(line) for line in data[:-1]]


def test_a_json_schema_answer_validates_streamed_or_not(
    client: openai.OpenAI, gateway: GatewayProcess
) -> None:
    fields = {"max_tokens": STRUCTURED_TOKENS, "response_format": JSON_SCHEMA}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, temperature=0, **fields
    )
    answer = raw.parse()
    content = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert content is not None
    jsonschema.validate(json.loads(content), SMALL_SCHEMA)
    assert raw.http_response.json()["choices"][0]["output_valid"] is True

    chunks = chat_chunks(client, **fields)
    assert chat_text(chunks) == content  # greedy: the same answer
    assert finish_reasons(chunks) == ["stop"]

    sent = raw_chunks(gateway, {"messages": CHAT, "temperature": 0, **fields})
    closing = sent[-1]["choices"][0]
    assert closing["finish_reason"] == "stop"
    assert closing["output_valid"] is True
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in sent)
    assert streamed == content
    assert all("output_valid" not in c["choices"][0] for c in sent[:-1])


def test_a_json_schema_completion_validates(client: openai.OpenAI) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=STRUCTURED_TOKENS,
        temperature=0,
        extra_body={"response_format": JSON_SCHEMA},
    )
    choice = raw.http_response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["output_valid"] is True
    jsonschema.validate(json.loads(choice["text"]), SMALL_SCHEMA)
    assert raw.parse().choices[0].text == choice["text"]


def test_a_plain_answer_has_no_output_valid(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=CHAT, max_tokens=2, temperature=0
    )
    assert "output_valid" not in raw.http_response.json()["choices"][0]


def test_json_object_gives_a_json_object(client: openai.OpenAI) -> None:
    answer = chat(client, max_tokens=STRUCTURED_TOKENS, response_format={"type": "json_object"})
    content = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert content is not None and isinstance(json.loads(content), dict)


UNENFORCEABLE: Any = {
    "type": "json_schema",
    "json_schema": {
        "name": "p",
        "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    },
}


def test_a_schema_the_worker_cannot_enforce_is_a_400_invalid_job(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=STRUCTURED_TOKENS, response_format=UNENFORCEABLE)
    error = caught.value
    assert error.status_code == 400
    assert error.code == "invalid_job"
    assert error.type == "invalid_request_error"
    assert "uniqueItems" in error.message
    # Streamed, the refusal comes as the stream's error (its head was already sent).
    with pytest.raises(openai.APIError) as streamed:
        chat_chunks(client, max_tokens=STRUCTURED_TOKENS, response_format=UNENFORCEABLE)
    assert streamed.value.code == "invalid_job"
    assert "uniqueItems" in streamed.value.message


# -- refusals -------------------------------------------------------------------------------

IMAGE_PARTS: Any = [
    {"type": "text", "text": "what is this?"},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
]
FUNCTION: Any = {"type": "function", "function": {"name": "f", "parameters": {}}}
# (endpoint, fields over the defaults, the parameter the 400 names)
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"n": 17}, "n"),
    ("chat", {"n": 17, "stream": True}, "n"),
    ("chat", {"temperature": 3}, "temperature"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": DEFAULT_LIMITS.max_tokens + 1}, "max_tokens"),
    ("chat", {"max_completion_tokens": DEFAULT_LIMITS.max_tokens + 1}, "max_completion_tokens"),
    ("chat", {"tools": [{**FUNCTION, "type": "retrieval"}]}, "tools[0]"),
    ("chat", {"logit_bias": {"42": 5}}, "logit_bias"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"messages": []}, "messages"),
    (
        "chat",
        {"messages": [{"role": "tool", "content": "1"}]},
        "messages[0].tool_call_id",
    ),
    # An image part whose file is no image of an allowed format (3 bytes of base64).
    ("chat", {"messages": [{"role": "user", "content": IMAGE_PARTS}]}, "messages[0].content[1]"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("text", {"prompt": [[1, 2]]}, "prompt"),
    ("text", {"max_tokens": DEFAULT_LIMITS.max_tokens + 1}, "max_tokens"),
    ("text", {"logprobs": 6}, "logprobs"),
    ("text", {"echo": True}, "echo"),
]


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    BAD_REQUESTS,
    ids=[f"{endpoint}-{param}" for endpoint, _, param in BAD_REQUESTS],
)
def test_a_request_that_cannot_be_honoured_is_a_400_naming_the_parameter(
    client: openai.OpenAI, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            chat(client, **fields)
        else:
            complete(client, **fields)
    error = caught.value
    assert error.status_code == 400
    body = error.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_a_body_that_is_not_json_is_a_400(gateway: GatewayProcess) -> None:
    request = urllib.request.Request(
        f"{gateway.base_url}/chat/completions",
        data=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400
    body = json.loads(caught.value.read())
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] is None and body["error"]["message"]


def test_unknown_fields_are_ignored(client: openai.OpenAI, greedy: Greedy) -> None:
    answer = chat(client, extra_body={"foo": 1, "bar": {"baz": [1, 2]}})
    assert answer.choices[0].message.content == greedy.chat.output_text


def test_the_gateway_still_serves_after_the_refusals(
    client: openai.OpenAI, gateway: GatewayProcess, greedy: Greedy
) -> None:
    # Runs after the refusals above, on the same gateway.
    assert gateway.process is not None and gateway.process.poll() is None
    assert complete(client).choices[0].text == greedy.text.output_text
    assert chat_text(chat_chunks(client)) == greedy.chat.output_text
