"""Streams that lose their connection: resumed on another gateway without a gap or a repeat,
or aborted when the client did not ask to resume; and a stream that outlives its worker."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from mlx_redis_protocol.client import Client
from mlx_redis_protocol.messages import DoneEvent, Event, ResetEvent, TerminalEvent
from tests.gateway.conftest import Fleet
from tests.support.gateway import GatewayFactory, GatewayProcess
from tests.support.processes import WorkerFactory, mlx_worker
from tests.support.sse import RawRequest, SseMessage, stream_chat
from tests.support.waiting import run, wait_until

STORY: list[Any] = [{"role": "user", "content": "Tell me a story"}]
RESUMABLE = {"X-Resumable": "true"}
# Far more than a test waits for (the tiny model makes ~30-100 tokens/s on a busy machine):
# a job that ends before it on its own was not aborted.
LONG = 2000


def until_content(messages: Iterator[SseMessage], count: int) -> list[SseMessage]:
    """The messages up to and including the ``count``-th that carries text."""
    read: list[SseMessage] = []
    for message in messages:
        assert not message.is_done and message.finish_reason is None, f"ended: {message}"
        read.append(message)
        if sum(1 for each in read if each.content) == count:
            return read
    raise AssertionError(f"the connection ended after {read}")


def text_of(messages: list[SseMessage]) -> str:
    return "".join(message.content for message in messages)


def ending(redis_url: str, prefix: str, request_id: str, within: float) -> TerminalEvent:
    """How the request ended; it must end within ``within`` seconds."""

    async def main() -> TerminalEvent:
        async with Client(redis_url, prefix=prefix) as client:
            try:
                return await asyncio.wait_for(client.wait(request_id), within)
            except TimeoutError:
                raise AssertionError(f"{request_id} did not end within {within} s") from None

    return run(main())


def all_events(redis_url: str, prefix: str, request_id: str) -> list[Event]:
    """Every event of a finished request, from its log."""

    async def main() -> list[Event]:
        async with Client(redis_url, prefix=prefix) as client:
            return [event async for event in client.stream(request_id, timeout=10)]

    return run(main())


def gateway_request_ids(gateway: GatewayProcess) -> list[str]:
    """The ids of the requests the gateway accepted, from its log."""
    ids = []
    for line in gateway.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            if entry.get("event") == "gateway_request":
                ids.append(entry["request_id"])
    return ids


def aborts_logged(gateway: GatewayProcess) -> int:
    return gateway.log_path.read_text(errors="replace").count('"client_left_aborting"')


def test_a_dropped_stream_resumes_on_another_gateway_without_gap_or_repeat(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    first, second = gateways.start(), gateways.start()
    body = {"model": "tiny", "messages": STORY, "max_tokens": 80, "temperature": 0}
    greedy = openai.OpenAI(base_url=first.base_url, api_key="none", max_retries=0)
    answer = greedy.chat.completions.create(
        model="tiny", messages=STORY, max_tokens=80, temperature=0
    )
    reference = answer.choices[0].message.content
    assert reference

    request = stream_chat(first.url, body, headers=RESUMABLE)
    request_id = request.response().headers["x-request-id"]
    before = until_content(request.messages(), 5)
    request.drop()
    last_id = before[-1].id
    assert last_id is not None and before[0].id == 0  # the role chunk, then the deltas

    with RawRequest(
        second.url,
        "GET",
        f"/v1/requests/{request_id}/stream",
        headers={"Last-Event-ID": str(last_id)},
    ) as resumed:
        assert resumed.response().status == 200
        # Resumed while the job runs: the replayed part and the live part meet somewhere.
        assert not _finished(fleet, request_id)
        after = list(resumed.messages())
    assert after[-1].is_done
    ids = [message.id if message.id is not None else -1 for message in after[:-1]]
    assert all(each > last_id for each in ids), (last_id, ids)  # nothing already sent
    assert ids == sorted(ids)
    assert text_of(before) + text_of(after) == reference
    assert after[-2].finish_reason == "length"

    with RawRequest(second.url, "GET", f"/v1/requests/{request_id}/stream") as replayed:
        whole = list(replayed.messages())
    assert whole[0].id == 0 and whole[0].json()["choices"][0]["delta"]["role"] == "assistant"
    assert whole[-1].is_done and text_of(whole) == reference
    assert [m.data for m in whole if m.id is not None and m.id > last_id] == [
        m.data for m in after[:-1]
    ]

    with RawRequest(first.url, "GET", f"/v1/requests/{request_id}") as result:
        assert result.response().status == 200
        completion = result.json()
    assert completion["id"] == request_id and completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"] == reference
    assert completion["choices"][0]["finish_reason"] == "length"
    assert completion["usage"]["completion_tokens"] == 80
    done = ending(fleet.redis_url, fleet.prefix, request_id, within=10)
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    assert aborts_logged(first) == 0


def test_a_dropped_stream_not_marked_resumable_aborts_its_job_at_once(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    gateway = gateways.start()
    body = {"model": "tiny", "messages": STORY, "max_tokens": LONG, "temperature": 0}
    request = stream_chat(gateway.url, body)
    request_id = request.response().headers["x-request-id"]
    until_content(request.messages(), 3)
    request.drop()

    done = ending(fleet.redis_url, fleet.prefix, request_id, within=5)
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort"
    assert 3 <= done.usage.completion_tokens < LONG // 4


def test_a_client_that_leaves_before_a_non_streamed_answer_aborts_its_job(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    gateway = gateways.start()
    body = {"model": "tiny", "messages": STORY, "max_tokens": LONG, "temperature": 0}
    request = RawRequest(gateway.url, "POST", "/v1/chat/completions", body=body).send()
    (request_id,) = wait_until(lambda: gateway_request_ids(gateway), 10, "the request's id")
    wait_until(lambda: _started(fleet, request_id), 10, f"{request_id} to start on the worker")
    request.drop()

    done = ending(fleet.redis_url, fleet.prefix, request_id, within=5)
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort"
    assert done.usage.completion_tokens < LONG // 4


def test_a_stream_left_before_its_first_byte_is_aborted_and_gives_its_lease_back(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    name = f"single-{uuid.uuid4().hex[:8]}"  # quotas are per name, under the module's prefix
    added = mlx_worker("api-key", "add", name, "--file", str(keys), "--max-concurrent", "1")
    secret = added.stdout.strip()
    assert added.returncode == 0 and secret.startswith("mlxw-"), added.stderr
    gateway = gateways.start("--api-keys", str(keys))
    body = {"model": "tiny", "messages": STORY, "max_tokens": LONG, "temperature": 0}
    request = RawRequest(
        gateway.url,
        "POST",
        "/v1/chat/completions",
        body={**body, "stream": True},
        headers={"Authorization": f"Bearer {secret}"},
    )
    request.send().drop()  # gone before the gateway answers

    (request_id,) = wait_until(lambda: gateway_request_ids(gateway), 10, "the request's id")
    done = ending(fleet.redis_url, fleet.prefix, request_id, within=5)
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort"
    single = openai.OpenAI(base_url=gateway.base_url, api_key=secret, max_retries=0)
    wait_until(lambda: _admitted(single), 3, "the key's one slot to be free again")


def _admitted(openai_client: openai.OpenAI) -> bool:
    try:
        openai_client.chat.completions.create(model="tiny", messages=STORY, max_tokens=1)
    except openai.RateLimitError:
        return False
    return True


def _started(fleet: Fleet, request_id: str) -> bool:
    return _logged(fleet, "job_started", request_id)


def _finished(fleet: Fleet, request_id: str) -> bool:
    return _logged(fleet, "job_finished", request_id)


def _logged(fleet: Fleet, name: str, request_id: str) -> bool:
    return any(
        event.get("event") == name and event.get("request_id") == request_id
        for event in fleet.worker.log_events()
    )


def dropped_stream(
    gateway: GatewayProcess, body: dict[str, Any], headers: dict[str, str] | None = None
) -> str:
    """The id of a streaming request whose client read three chunks of text and left."""
    request = stream_chat(gateway.url, body, headers=headers)
    request_id = request.response().headers["x-request-id"]
    until_content(request.messages(), 3)
    request.drop()
    return request_id


def test_keep_on_disconnect_leaves_a_dropped_stream_to_finish(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    gateway = gateways.start("--keep-on-disconnect")
    body = {"model": "tiny", "messages": STORY, "max_tokens": 100, "temperature": 0}
    request_id = dropped_stream(gateway, body)

    done = ending(fleet.redis_url, fleet.prefix, request_id, within=30)
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    assert done.usage.completion_tokens == 100
    assert aborts_logged(gateway) == 0


def test_a_stream_resumable_by_its_body_or_by_default_runs_on_unless_it_opts_out(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    plain, by_default = gateways.start(), gateways.start("--resumable-by-default")
    body = {"model": "tiny", "messages": STORY, "max_tokens": 100, "temperature": 0}
    marked = dropped_stream(plain, {**body, "resumable": True})
    unmarked = dropped_stream(by_default, body)
    opted_out = dropped_stream(by_default, body, headers={"X-Resumable": "false"})

    endings = {
        request_id: ending(fleet.redis_url, fleet.prefix, request_id, within=30)
        for request_id in (marked, unmarked, opted_out)
    }
    reasons = {
        request_id: (event.finish_reason, event.usage.completion_tokens)
        for request_id, event in endings.items()
        if isinstance(event, DoneEvent)
    }
    assert reasons[marked] == ("length", 100) and reasons[unmarked] == ("length", 100)
    assert reasons[opted_out][0] == "abort" and reasons[opted_out][1] < 100


def test_a_stopping_gateway_ends_its_streams_without_aborting_their_jobs(
    fleet: Fleet, gateways: GatewayFactory
) -> None:
    stopping, other = gateways.start(), gateways.start()
    body = {"model": "tiny", "messages": STORY, "max_tokens": LONG, "temperature": 0}
    request = stream_chat(stopping.url, body)  # not marked resumable
    request_id = request.response().headers["x-request-id"]
    messages = request.messages()
    before = until_content(messages, 3)
    stopping.stop()
    before += list(messages)  # what it sent until it stopped
    request.drop()
    assert not any(message.is_done for message in before)
    assert aborts_logged(stopping) == 0

    # The job runs on: its stream, resumed on another gateway, goes on past the stop.
    last_id = before[-1].id
    assert last_id is not None
    with RawRequest(
        other.url,
        "GET",
        f"/v1/requests/{request_id}/stream",
        headers={"Last-Event-ID": str(last_id)},
    ) as resumed:
        after = until_content(resumed.messages(), 20)
    run(_abort(fleet, request_id))  # it has shown what it had to; LONG would take a while
    done = ending(fleet.redis_url, fleet.prefix, request_id, within=10)
    assert isinstance(done, DoneEvent) and done.finish_reason == "abort"
    assert done.output_text.startswith(text_of(before) + text_of(after))


async def _abort(fleet: Fleet, request_id: str) -> None:
    async with Client(fleet.redis_url, prefix=fleet.prefix) as client:
        await client.abort(request_id, timeout=1.0)


def test_another_key_cannot_read_or_resume_a_request(
    fleet: Fleet, gateways: GatewayFactory, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    owner, stranger = (
        mlx_worker("api-key", "add", name, "--file", str(keys)).stdout.strip()
        for name in ("owner", "stranger")
    )
    assert owner.startswith("mlxw-") and stranger.startswith("mlxw-")
    gateway = gateways.start("--api-keys", str(keys))
    mine = openai.OpenAI(base_url=gateway.base_url, api_key=owner, max_retries=0)
    chunks = list(
        mine.chat.completions.create(
            model="tiny",
            messages=STORY,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_headers=RESUMABLE,
        )
    )
    request_id = chunks[0].id
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)

    def get(path: str, secret: str) -> tuple[int, bytes]:
        with RawRequest(
            gateway.url, "GET", path, headers={"Authorization": f"Bearer {secret}"}
        ) as request:
            response = request.response()
            return response.status, response.read()

    for path in (f"/v1/requests/{request_id}", f"/v1/requests/{request_id}/stream"):
        status, raw = get(path, stranger)
        assert status == 404, raw
        assert json.loads(raw)["error"]["code"] == "request_not_found"
        unknown = path.replace(request_id, "chatcmpl-" + "0" * 32)
        assert get(unknown, stranger)[0] == 404
    status, raw = get(f"/v1/requests/{request_id}", owner)
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == text


@pytest.fixture
def own_gateways(tmp_path: Path, redis_url: str, prefix: str) -> Iterator[GatewayFactory]:
    """Gateways in front of this test's own workers (the ``workers`` fixture's prefix)."""
    factory = GatewayFactory(tmp_path, redis_url, prefix)
    try:
        yield factory
    finally:
        factory.stop_all()
        print(factory.report())


def test_a_stream_outlives_a_worker_crash_without_repeating_text(
    workers: WorkerFactory, own_gateways: GatewayFactory, redis_url: str, prefix: str
) -> None:
    worker = workers.start("crashing", max_concurrency=2)
    gateway = own_gateways.start()
    # Sampled, not greedy, and no seed of the client's: the gateway's own seed makes the rerun
    # sample the same tokens. A sampled run may end (EOS) within its first chunks: then again.
    body = {"model": "tiny", "messages": STORY, "max_tokens": 150, "temperature": 1.0}
    for _ in range(3):
        request = stream_chat(gateway.url, body)
        request_id = request.response().headers["x-request-id"]
        messages = request.messages()
        before = _first_chunks_of_a_running_job(messages, 10)
        if before is not None:
            break
        request.drop()
    else:
        raise AssertionError("three sampled runs in a row ended within 10 chunks")
    worker.kill()
    worker.start().wait_ready()  # the same id: it takes its own pending job back first

    after = list(messages)
    request.drop()
    assert after and after[-1].is_done, after[-3:]
    done = ending(redis_url, prefix, request_id, within=10)
    assert isinstance(done, DoneEvent), done
    assert text_of(before) + text_of(after) == done.output_text
    assert after[-2].finish_reason == done.finish_reason
    events = all_events(redis_url, prefix, request_id)
    assert any(isinstance(event, ResetEvent) for event in events), "the job was not rerun"


def _first_chunks_of_a_running_job(
    messages: Iterator[SseMessage], count: int
) -> list[SseMessage] | None:
    """The messages up to the ``count``-th with text; None when the job ended before."""
    read: list[SseMessage] = []
    for message in messages:
        if message.is_done or message.finish_reason is not None:
            return None
        read.append(message)
        if sum(1 for each in read if each.content) == count:
            return read
    raise AssertionError(f"the connection ended after {read}")
