"""Stored Responses: ``store: true`` keeps a response for ``previous_response_id``,
``responses.retrieve``, ``responses.input_items.list`` and ``responses.delete``, within the
API key that made it; ``store: false`` keeps nothing. The official openai SDK against a real
gateway and worker (the tiny model), the records in the real Redis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from mlx_redis_protocol.keys import Keys
from tests.gateway.conftest import Fleet
from tests.gateway.test_auth import add_key, key_name
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.processes import mlx_worker
from tests.support.schemas import TOOL_SCHEMAS

MODEL = "tiny"
TOKENS = 8
GREEDY: Any = {"model": MODEL, "max_output_tokens": TOKENS, "temperature": 0}
STORY = "Tell me a story"
FLAT_TOOLS: Any = [
    {"type": "function", "name": name, "description": name, "parameters": schema}
    for name, schema in TOOL_SCHEMAS.items()
]


def keyed(gateway: GatewayProcess, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=secret, max_retries=0, timeout=300)


def stored_sizes(fleet: Fleet, scope: str) -> tuple[list[tuple[int, str]], int]:
    """The scope's index in Redis (size, response id, oldest first) and its total."""
    keys = Keys(fleet.prefix)
    with redis.Redis.from_url(fleet.redis_url) as plain:
        members = plain.zrange(keys.stored_responses(scope), 0, -1)
        total = int(plain.get(keys.stored_responses_bytes(scope)) or 0)
    index = []
    for member in members:
        size, _, response_id = member.decode().partition("/")
        index.append((int(size), response_id))
    return index, total


def test_previous_response_id_continues_from_the_stored_conversation(
    client: openai.OpenAI,
) -> None:
    """The second turn is the stateless request of the whole conversation: the same prompt
    (its token count) and, greedy, the same answer."""
    first = client.responses.create(input=STORY, instructions="Be brief.", **GREEDY)
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(previous_response_id=first.id, input="Go on", **GREEDY)
    assert second.previous_response_id == first.id and second.store is True
    # Instructions are not carried over (as OpenAI): the history is the turns only.
    whole: Any = [
        {"role": "user", "content": STORY},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Go on"},
    ]
    expected = client.responses.create(input=whole, store=False, **GREEDY)
    assert second.usage is not None and expected.usage is not None
    assert second.usage.input_tokens == expected.usage.input_tokens
    assert second.output_text == expected.output_text
    # A third turn chains through both.
    third = client.responses.create(previous_response_id=second.id, input="More", **GREEDY)
    again: Any = [
        *whole,
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "More"},
    ]
    expected = client.responses.create(input=again, store=False, **GREEDY)
    assert third.usage is not None and expected.usage is not None
    assert third.usage.input_tokens == expected.usage.input_tokens
    assert third.output_text == expected.output_text


def test_a_stored_response_is_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    turns: Any = [
        {"role": "user", "content": STORY},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Once"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        {"role": "user", "content": "on", "id": "msg_mine"},
    ]
    response = client.responses.create(input=turns, **GREEDY)
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()

    oldest_first = client.responses.input_items.list(response.id, order="asc")
    assert not oldest_first.has_more
    items: Any = oldest_first.data
    assert [(item.type, item.role) for item in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
        ("message", "user"),
    ]
    assert [item.content[0].text for item in items] == [STORY, "Once", "go", "on"]
    assert [item.content[0].type for item in items] == [
        "input_text",
        "output_text",
        "input_text",
        "input_text",
    ]
    assert items[-1].id == "msg_mine" and all(item.id.startswith("msg_") for item in items)
    assert len({item.id for item in items}) == 4
    ids = [item.id for item in items]
    # Newest first by default; pages of `limit`, the next one `after` the last id.
    page = client.responses.input_items.list(response.id, limit=3)
    assert [item.id for item in page.data] == ids[::-1][:3] and page.has_more
    raw = client.responses.input_items.with_raw_response.list(response.id, limit=3)
    listed = raw.http_response.json()
    assert (listed["object"], listed["first_id"], listed["last_id"]) == ("list", ids[3], ids[1])
    assert [item.id for item in page] == ids[::-1]  # the SDK follows `after` to the end
    page = client.responses.input_items.list(response.id, limit=2, order="asc", after=ids[0])
    assert [item.id for item in page.data] == ids[1:3] and page.has_more
    # `before` (the older API's): the page nearest it, in the list's order.
    extra: Any = {"before": ids[3], "order": "asc", "limit": 2}
    page = client.responses.input_items.list(response.id, extra_query=extra)
    assert [item.id for item in page.data] == ids[1:3] and page.has_more
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(response.id, after="msg_nowhere")
    assert caught.value.param == "after"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(response.id, limit=101)
    assert caught.value.param == "limit"

    deleted = client.responses.with_raw_response.delete(response.id).http_response.json()
    assert deleted == {"id": response.id, "object": "response", "deleted": True}
    for gone in (
        lambda: client.responses.retrieve(response.id),
        lambda: client.responses.input_items.list(response.id),
        lambda: client.responses.delete(response.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            gone()
        assert missing.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(previous_response_id=response.id, input="hi", **GREEDY)
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.param == "previous_response_id"


def test_store_false_keeps_nothing(client: openai.OpenAI, fleet: Fleet) -> None:
    response = client.responses.create(input=STORY, store=False, **GREEDY)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(previous_response_id=response.id, input="hi", **GREEDY)
    assert refused.value.code == "previous_response_not_found"
    index, _ = stored_sizes(fleet, "anonymous")
    assert response.id not in {response_id for _, response_id in index}
    # A continuation may itself be unstored: it reads its history, keeps nothing.
    kept = client.responses.create(input=STORY, **GREEDY)
    unkept = client.responses.create(
        previous_response_id=kept.id, input="hi", store=False, **GREEDY
    )
    assert unkept.store is False and unkept.previous_response_id == kept.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_a_streamed_response_is_stored_before_its_last_event(client: openai.OpenAI) -> None:
    """A client that continues the moment ``response.incomplete`` arrives finds it stored,
    and the stored response is the one the last event carried."""
    with client.responses.create(input=STORY, stream=True, **GREEDY) as stream:
        events = list(stream)
    last: Any = events[-1]
    assert last.type == "response.incomplete" and last.response.store is True
    stored = client.responses.retrieve(last.response.id)
    assert stored.model_dump() == last.response.model_dump()
    second = client.responses.create(
        previous_response_id=last.response.id, input="Go on", stream=True, **GREEDY
    )
    final: Any = list(second)[-1]
    whole: Any = [
        {"role": "user", "content": STORY},
        {"role": "assistant", "content": last.response.output_text},
        {"role": "user", "content": "Go on"},
    ]
    expected = client.responses.create(input=whole, store=False, **GREEDY)
    assert final.response.output_text == expected.output_text
    assert final.response.usage.input_tokens == expected.usage.input_tokens


@pytest.mark.timeout(600)
def test_a_function_call_and_its_output_continue_by_previous_response_id(
    client: openai.OpenAI,
) -> None:
    """An agent's tool loop: the stored call, then only its output sent; the prompt is the
    one of the whole history sent statelessly."""
    asked = "Turn the kitchen light on."
    calling = client.responses.create(
        model=MODEL,
        input=asked,
        tools=FLAT_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=96,
        temperature=0.7,
    )
    outputs: Any = calling.output
    [call] = outputs
    assert call.type == "function_call" and calling.status == "completed", calling
    result: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}]
    answer = client.responses.create(
        previous_response_id=calling.id, input=result, tools=FLAT_TOOLS, **GREEDY
    )
    whole: Any = [
        {"role": "user", "content": asked},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        *result,
    ]
    expected = client.responses.create(input=whole, tools=FLAT_TOOLS, store=False, **GREEDY)
    assert answer.usage is not None and expected.usage is not None
    assert answer.usage.input_tokens == expected.usage.input_tokens
    assert answer.output_text == expected.output_text
    listing: Any = client.responses.input_items.list(answer.id).data
    [listed] = listing
    assert listed.type == "function_call_output" and listed.call_id == call.call_id
    assert listed.output == "ok" and listed.id.startswith("fco_")


def test_another_keys_response_is_a_404_and_cannot_be_continued(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    path = tmp_path / "keys.toml"
    names = {who: key_name(who) for who in ("alice", "bob")}
    secrets = {who: add_key(path, name) for who, name in names.items()}
    gateway = gateways.start("--api-keys", str(path), "--store-ttl", "3600")
    alice, bob = keyed(gateway, secrets["alice"]), keyed(gateway, secrets["bob"])
    response = alice.responses.create(input=STORY, **GREEDY)
    for attempt in (
        lambda: bob.responses.retrieve(response.id),
        lambda: bob.responses.input_items.list(response.id),
        lambda: bob.responses.delete(response.id),
    ):
        with pytest.raises(openai.NotFoundError):
            attempt()
    with pytest.raises(openai.BadRequestError) as refused:
        bob.responses.create(previous_response_id=response.id, input="hi", **GREEDY)
    assert refused.value.code == "previous_response_not_found"
    # Bob's attempts changed nothing of Alice's: she reads and continues it.
    assert alice.responses.retrieve(response.id).id == response.id
    alice.responses.create(previous_response_id=response.id, input="hi", **GREEDY)
    # Kept in Alice's scope (her key's slot), for the gateway's --store-ttl.
    keys = Keys(fleet.prefix)
    with redis.Redis.from_url(fleet.redis_url) as plain:
        ttl = plain.pttl(keys.stored_response(names["alice"], response.id))
        assert 0 < ttl <= 3600 * 1000
        assert not plain.exists(keys.stored_response(names["bob"], response.id))


def test_a_keys_stored_responses_stay_within_its_bound_oldest_dropped_first(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    """Past ``--store-max-key-bytes`` a key's oldest responses go (the newest is always
    kept), the index's total stays within the bound; a conversation over
    ``--store-max-response-bytes`` is refused before it runs."""
    gateway = gateways.start("--store-max-response-bytes", "6000", "--store-max-key-bytes", "9000")
    client = keyed(gateway, "none")
    made = [client.responses.create(input=f"{n} " + "x" * 1500, **GREEDY).id for n in range(5)]
    index, total = stored_sizes(fleet, "anonymous")
    kept = [response_id for _, response_id in index]
    assert 1 <= len(kept) < len(made) and kept == made[-len(kept) :]
    assert total == sum(size for size, _ in index) <= 9000
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0])
    assert client.responses.retrieve(made[-1]).id == made[-1]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(input="x" * 7000, **GREEDY)
    assert refused.value.code == "conversation_too_large" and refused.value.param == "input"


def test_a_record_that_is_not_one_reads_as_missing(client: openai.OpenAI, fleet: Fleet) -> None:
    response = client.responses.create(input=STORY, **GREEDY)
    key = Keys(fleet.prefix).stored_response("anonymous", response.id)
    with redis.Redis.from_url(fleet.redis_url) as plain:
        plain.set(key, b"\xff not json", keepttl=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(previous_response_id=response.id, input="hi", **GREEDY)
    assert client.responses.create(input=STORY, **GREEDY).store is True  # still serving


def test_store_ttl_0_keeps_nothing_and_bad_bounds_stop_the_gateway_at_start(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    gateway = gateways.start("--store-ttl", "0")
    client = keyed(gateway, "none")
    response = client.responses.create(input=STORY, **GREEDY)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    events: Any = list(client.responses.create(input=STORY, stream=True, **GREEDY))
    assert events[0].response.store is False and events[-1].response.store is False
    connection = ["--redis-url", fleet.redis_url, "--prefix", fleet.prefix]
    for flags, said in (
        (["--store-max-response-bytes", "10", "--store-max-key-bytes", "5"], "at most"),
        (["--store-ttl", "-1"], "--store-ttl"),
    ):
        result = mlx_worker("gateway", *flags, *connection, timeout=15)
        assert result.returncode == 2 and said in result.stderr, result.stderr
