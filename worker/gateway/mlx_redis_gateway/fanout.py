"""One request, several jobs: ``n`` > 1, and a list of prompts on ``/v1/completions``.

Each choice is a job of its own (``{id}.{index}``: any worker takes any of them, and each
survives a worker crash as any job does). Copies of one prompt share its prefix cache: the
first copy is queued first with ``prefix_boundary: "prompt"`` (its worker stores the prompt's
KV state as soon as it is prefilled), and the other copies once it has its first token, so a
worker that takes them prefills only the prompt's last token. The answer is OpenAI's: one
choice per job, ``index`` in order (prompt i's copy j is choice i * n + j), usage summed with
each prompt's tokens counted once (OpenAI counts a prompt once however many copies it has).

A fanned-out stream carries no SSE ids: it cannot be resumed by ``Last-Event-ID`` (each
choice's own stream can, under its job's id), and a client that leaves aborts its jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.shaping import DONE_MESSAGE, ResponseShape, Shaper, sse_data, usage_body
from mlx_redis_protocol.messages import DeltaEvent, DoneEvent, Event, Job, TerminalEvent, Usage

Follow = Callable[[str], AsyncIterator[Event]]  # a job's events, failures as ApiError


@dataclass(frozen=True, slots=True)
class ChoiceJob:
    """The job behind one choice of a fanned-out request."""

    index: int
    job: Job
    prompt: int  # which of the request's prompts it answers
    # The first copy of its prompt: queued before the others, and the copy whose prompt
    # tokens the usage counts.
    leads: bool


@dataclass(frozen=True, slots=True)
class Choice:
    """A choice as the gateway follows it: its job's id and how its chunks are shaped."""

    index: int
    request_id: str
    shape: ResponseShape
    leads: bool


async def queue_choices(
    choices: Sequence[ChoiceJob],
    submit: Callable[[Job], Awaitable[None]],
    follow: Follow,
    *,
    leaders_queued: asyncio.Event | None = None,
) -> None:
    """Queue every choice's job: each prompt's leading copy first, the other copies once
    the leader has its first token (or has ended). ``leaders_queued`` is set once every leader
    is queued (a submission error before then is the request's error)."""
    leaders = [choice for choice in choices if choice.leads]
    await asyncio.gather(*(submit(choice.job) for choice in leaders))
    if leaders_queued is not None:
        leaders_queued.set()

    async def copies_of(leader: ChoiceJob) -> None:
        copies = [c for c in choices if not c.leads and c.prompt == leader.prompt]
        if not copies:
            return
        async for event in follow(leader.job.request_id):
            if isinstance(event, DeltaEvent | TerminalEvent):
                break
        await asyncio.gather(*(submit(copy.job) for copy in copies))

    await asyncio.gather(*(copies_of(leader) for leader in leaders))


def summed_usage(choices: Sequence[Choice], dones: Sequence[DoneEvent]) -> Usage:
    """The request's usage: every choice's completion tokens, each prompt's tokens once."""
    leading = [done.usage for choice, done in zip(choices, dones, strict=True) if choice.leads]
    return Usage(
        prompt_tokens=sum(usage.prompt_tokens for usage in leading),
        completion_tokens=sum(done.usage.completion_tokens for done in dones),
        cached_tokens=sum(usage.cached_tokens for usage in leading),
    )


def merged_completion(request_id: str, choices: Sequence[Choice], shapers: Sequence[Shaper]) -> Any:
    """The non-streamed answer of finished choices: one body, a choice per job."""
    for shaper in shapers:
        if shaper.error is not None:
            raise shaper.error
    bodies = [shaper.completion() for shaper in shapers]
    entries = []
    for choice, answer in zip(choices, bodies, strict=True):
        [entry] = answer["choices"]
        entries.append({**entry, "index": choice.index})
    body = bodies[0]
    body["id"] = request_id
    body["choices"] = entries
    dones = [shaper.done for shaper in shapers]
    assert all(done is not None for done in dones)
    body["usage"] = usage_body(summed_usage(choices, [d for d in dones if d is not None]))
    return body


async def merged_stream(
    request_id: str,
    choices: Sequence[Choice],
    follow: Follow,
    *,
    include_usage: bool,
    queued: Callable[[Choice], Awaitable[None]],
    left: Callable[[list[str]], None],
) -> AsyncIterator[bytes]:
    """The SSE messages of a fanned-out request: each choice's opening chunk, then the
    choices' chunks as they come (each under the request's id, with its own ``index``), then
    the summed usage when asked for, and ``[DONE]``; an error in any choice ends the stream
    with its error chunk. ``queued(choice)`` returns once the choice's job is queued;
    ``left(request_ids)`` is told the jobs that had not ended when the stream did (its client
    left, or another choice failed)."""
    shapers = [Shaper(choice.request_id, choice.shape) for choice in choices]
    # Each choice's chunks as they come, then None once it has ended (or an ApiError).
    outbox: asyncio.Queue[tuple[int, list[dict[str, Any]] | None] | ApiError] = asyncio.Queue()

    async def run(position: int) -> None:
        choice, shaper = choices[position], shapers[position]
        try:
            await queued(choice)
            async for event in follow(choice.request_id):
                await outbox.put((position, [chunk.data for chunk in shaper.feed(event)]))
                if shaper.finished:
                    break
            await outbox.put((position, None))
        except ApiError as error:
            await outbox.put(error)

    opening = [
        _as_choice(request_id, choice, s.opening().data)
        for choice, s in zip(choices, shapers, strict=True)
    ]
    yield b"".join(sse_data(data) for data in opening)
    tasks = [asyncio.create_task(run(position)) for position in range(len(choices))]
    try:
        running = len(choices)
        while running:
            item = await outbox.get()
            if isinstance(item, ApiError):
                yield sse_data(item.body())
                return
            position, chunks = item
            error = shapers[position].error
            if error is not None:
                yield sse_data(error.body())
                return
            if chunks is None:
                if shapers[position].done is None:  # its log ended without an end
                    yield sse_data(_cut_short(choices[position]).body())
                    return
                running -= 1
                continue
            yield b"".join(sse_data(_as_choice(request_id, choices[position], c)) for c in chunks)
        closing = b""
        if include_usage:
            dones = [shaper.done for shaper in shapers]
            usage = summed_usage(choices, [done for done in dones if done is not None])
            envelope = dict(_as_choice(request_id, choices[0], shapers[0].opening().data))
            envelope["choices"] = []
            envelope["usage"] = usage_body(usage)
            closing = sse_data(envelope)
        yield closing + DONE_MESSAGE
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        left([c.request_id for c, s in zip(choices, shapers, strict=True) if s.done is None])


def _cut_short(choice: Choice) -> ApiError:
    return ApiError(
        500, f"the stream of {choice.request_id} ended before its job did", "server_error"
    )


def _as_choice(request_id: str, choice: Choice, data: dict[str, Any]) -> dict[str, Any]:
    """A choice's chunk as the request's: the request's id, the choice's index."""
    data = {**data, "id": request_id}
    data["choices"] = [{**entry, "index": choice.index} for entry in data.get("choices", [])]
    return data


def child_shape(shape: ResponseShape) -> ResponseShape:
    """A choice's own shape: its usage is part of the request's, sent once at the end."""
    return replace(shape, include_usage=False)
