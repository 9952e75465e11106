"""The abusive HTTP clients of ``mlx-worker bench isolation``, each run as a process of its own.

``python -m mlx_redis_worker.bench.attackers NAME --port P --key K`` attacks the gateway on
port P until SIGTERM: it prints ``{"ready": true}`` once its attack is under way (what it
sends built), and at the end one JSON line: what the attacker got back (statuses or
connection errors, counted), how many exchanges it made, and its own CPU seconds. A process
of its own, at the lowest CPU priority (Linux's ``SCHED_IDLE``, elsewhere niceness 19): the
victim's client is not slowed by the attacker's coroutines in its event loop, and the
attacker stands for a client on another host, so on a machine of a few cores it takes only
the CPU the gateway, the worker and Redis leave idle. What its requests cost the gateway
and Redis is what the bench measures.

Attackers: ``huge-header`` (heads of 16 MB, one connection after another), ``huge-body``
(bodies that say 500 MB, sent until refused), ``read-flood`` (200 connections reading random
request ids with the attacker's key), ``resume-flood`` (200 connections resuming the
attacker's own finished request, ``--own-request``), ``hostile-schema`` (4 connections
asking ``--model`` for chat completions in a new deep ``anyOf`` schema each time, as large as
the worker's default ``max_schema_bytes`` lets through: a compile each), ``idle-sockets``
(``--idle-sockets`` connections that send nothing, reopened when closed), ``nested-anyof``
(4 connections asking ``--model`` for 32 tokens under a new ``anyOf`` schema nested 4 deep and
6 wide each time, about 110 KiB: a compile each, and 4 grammar rows in the victim's batch),
``logprobs-fanout`` (chat completions of ``n`` 4 with ``top_logprobs`` 20, 64 tokens: 4 jobs
each, 20 alternatives a token), and the image attackers, 4 connections each (the attacker
key's cap) asking ``--model`` for chat completions with images: ``image-bomb`` (a 65,535 x
65,535 PNG header over 4 KB), ``image-50mb`` (a 50 MB image: its data URL, 67 MB),
``image-flood`` (a new real 512 x 512 picture every time, about 1 MB as a data URL),
``keep-alive-sockets`` (21 sockets from each of 500 addresses, 127.64.x.y: 10,500, each asking
once without a key and kept open, reopened when closed), ``big-bodies`` (4 connections sending
chat bodies just under 4 MiB with the attacker's key) and ``many-tools`` (4 connections asking
for chat completions with 48 salted agent tools, 30.5k prompt tokens each on tiny), and the
long-prompt attackers of ``long_prompts`` inside the key's quota: ``long-prompts`` (about
2,300-token prompts that never hit the prefix cache, 4 at once) and ``long-prompt-26k`` (one
prompt of about 26k tokens at a time), whose text the bench hands over in ``--prompt-file``.

Each attacker connects from ``--source`` (Linux routes all of 127.0.0.0/8 to the loopback
interface), so that the gateway sees it as a client of its own, as a client on another host
would be, not as the victim's 127.0.0.1; where that address cannot be bound (macOS has only
127.0.0.1 by default) it connects from 127.0.0.1, and the report says so.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import functools
import json
import os
import resource
import signal
import socket
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from mlx_redis_worker.bench.hostile_images import data_url, huge_image, picture, png_bomb
from mlx_redis_worker.bench.hostile_schemas import Schema, deep_anyof, nested_anyof
from mlx_redis_worker.bench.long_prompts import (
    ATTACK_MAX_TOKENS,
    LONG_PROMPT_ATTACKS,
    QUOTA_PER_MINUTE,
    QuotaBucket,
    streamed_completion,
)

FLOOD_CONNECTIONS = 200
ATTACKER_MAX_CONCURRENT = 4  # the attacker key's concurrency cap (bench isolation's key)
SCHEMA_CONNECTIONS = ATTACKER_MAX_CONCURRENT
# 8 branches, 3 levels: 512 leaves, about 124 KiB (the default max_schema_bytes is 128 KiB).
SCHEMA_WIDTH = 8
HUGE_HEADER = 16 * 1024 * 1024
HUGE_BODY = 500 * 1024 * 1024
PIECE = b"a" * 65536
# The nested-anyof attacker's tokens per request: its grammar rows stay in the batch.
NESTED_MAX_TOKENS = 32
FANOUT_CHOICES = 4
FANOUT_TOP_LOGPROBS = 20
FANOUT_MAX_TOKENS = 64
IMAGE_CONNECTIONS = 4  # the attacker key's concurrency cap
FLOOD_IMAGE_SIZE = (512, 512)  # random pixels: about 770 KB as a PNG
FLOOD_IMAGES = 8  # in turn, each after new text: no prefix-cache hit
# The first attacker's address; the bench gives each attack phase the next one (``source``).
FIRST_SOURCE = 2
# The keep-alive attacker: sockets from many addresses (127.64.x.y, none the victim's or another
# phase's), each making one request without a key and keeping its connection open.
KEEP_ALIVE_ADDRESSES = 500
KEEP_ALIVE_PER_ADDRESS = 21
# The big-bodies attacker: bodies just under the gateway's old fixed 4 MiB limit, with a key.
BIG_BODY = 4 * 1024 * 1024 - 64 * 1024
BIG_BODY_CONNECTIONS = 4  # the attacker key's concurrency cap
# The many-tools attacker: a coding agent's tool list, each tool's description and parameters
# a few hundred tokens, salted so that no prompt is a prefix-cache hit.
MANY_TOOLS = 48
TOOL_CONNECTIONS = ATTACKER_MAX_CONCURRENT


class Target:
    """The gateway under attack: its port and the attacker's key."""

    def __init__(
        self,
        port: int,
        key: str,
        own_request: str = "",
        model: str = "",
        source: str | None = None,
        filler: str = "",
    ) -> None:
        self.port = port
        self.local_addr = (source, 0) if source else None  # None: the OS's choice
        self.auth = f"Authorization: Bearer {key}\r\n"
        self.statuses: Counter[str] = Counter()
        self.own_request = own_request  # the attacker's finished request, for the resume flood
        self.model = model  # the model the hostile schemas are sent to
        self.filler = filler  # the long-prompt attackers' text (after a salt of their own)
        self.finished = 0  # streams the attacker read to their end ([DONE])

    async def connect(
        self, pause: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        """A connection to the gateway, or None (counted, after ``pause`` seconds) when it
        could not be made."""
        try:
            return await asyncio.open_connection("127.0.0.1", self.port, local_addr=self.local_addr)
        except OSError as exc:
            self.statuses[f"connect failed: {type(exc).__name__}"] += 1
            await asyncio.sleep(pause)
            return None

    def answered(self, status_line: bytes) -> None:
        """Count an answer by its status (``closed``: the connection closed unanswered)."""
        self.statuses[status_line.split(b" ", 2)[1].decode() if status_line else "closed"] += 1

    async def chat(self, fields: dict[str, Any]) -> None:
        """One chat completion of ``--model`` with ``fields``, on a connection of its own."""
        body = json.dumps({"model": self.model, **fields}, separators=(",", ":")).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{self.auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        await self.exchange(head, body=body)

    async def exchange(self, head: str, body_pieces: int = 0, body: bytes = b"") -> bytes:
        """One request on a connection of its own (its ``body``, or ``body_pieces`` of
        ``PIECE``); its status (or failure) is counted. Returns the answer after its status
        line (b"" where none came)."""
        connection = await self.connect(pause=0.05)
        if connection is None:
            return b""
        reader, writer = connection
        try:
            # The gateway may refuse (and close) before it all arrived: then the answer is
            # read all the same.
            with contextlib.suppress(OSError):
                writer.write(head.encode() + body)
                for _ in range(body_pieces):
                    writer.write(PIECE)
                    await writer.drain()
            self.answered(await reader.readline())
            return await reader.read()
        except (OSError, IndexError) as exc:
            self.statuses[type(exc).__name__] += 1
            return b""
        finally:
            writer.close()


Attack = Callable[[Target], Coroutine[Any, Any, None]]


async def huge_header(target: Target) -> None:
    head = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    while True:
        await target.exchange(head, HUGE_HEADER // len(PIECE))


async def huge_body(target: Target) -> None:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{target.auth}"
        f"Content-Type: application/json\r\nContent-Length: {HUGE_BODY}\r\n\r\n"
    )
    while True:
        await target.exchange(head, HUGE_BODY // len(PIECE))


async def read_flood(target: Target) -> None:
    async def reader() -> None:
        while True:
            path = f"/v1/requests/cmpl-{uuid.uuid4().hex}"
            await target.exchange(get(path, target.auth))

    await asyncio.gather(*(reader() for _ in range(FLOOD_CONNECTIONS)))


async def resume_flood(target: Target) -> None:
    async def resumer() -> None:
        while True:
            await target.exchange(get(f"/v1/requests/{target.own_request}/stream", target.auth))

    await asyncio.gather(*(resumer() for _ in range(FLOOD_CONNECTIONS)))


async def hostile_schema(target: Target) -> None:
    schema = functools.partial(deep_anyof, width=SCHEMA_WIDTH, depth=3)
    await _schema_senders(target, schema, max_tokens=8, salt_hex=8)


async def nested_anyof_schema(target: Target) -> None:
    await _schema_senders(target, nested_anyof, max_tokens=NESTED_MAX_TOKENS, salt_hex=14)


async def _schema_senders(
    target: Target, schema_of: Callable[[str], Schema], *, max_tokens: int, salt_hex: int
) -> None:
    """``SCHEMA_CONNECTIONS`` senders of chat completions, each under a new schema (its salt:
    the sender's number and ``salt_hex`` random hex digits)."""

    async def sender(number: int) -> None:
        while True:
            salt = f"{number}{uuid.uuid4().hex[:salt_hex]}"
            await target.chat(
                {
                    "messages": [{"role": "user", "content": "fill it in"}],
                    "max_tokens": max_tokens,
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "hostile", "schema": schema_of(salt)},
                    },
                }
            )

    await asyncio.gather(*(sender(number) for number in range(SCHEMA_CONNECTIONS)))


async def logprobs_fanout(target: Target) -> None:
    while True:  # n jobs of one request take the key's n slots: one request at a time
        await target.chat(
            {
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": FANOUT_MAX_TOKENS,
                "n": FANOUT_CHOICES,
                "logprobs": True,
                "top_logprobs": FANOUT_TOP_LOGPROBS,
                "temperature": 1.0,
            }
        )


def _chat_with_image(target: Target, url: str, text: str) -> tuple[str, bytes]:
    """A chat completion request (head, body) with text, then one image part (so a repeated
    image after new text is no prefix-cache hit), closing its connection."""
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": ""}}]
    before, after = json.dumps(
        {
            "model": target.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
        },
        separators=(",", ":"),
    ).split('"url":""', 1)
    # The URL spliced in as bytes: json.dumps of a 67 MB string costs seconds.
    body = f'{before}"url":"'.encode() + url.encode() + f'"{after}'.encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{target.auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head, body


def _image_sender(images: Callable[[], list[str]]) -> Attack:
    """IMAGE_CONNECTIONS connections sending chat requests with the image URLs ``images()``
    makes (once, as the attack starts), in turn."""

    async def attack(target: Target) -> None:
        urls = images()
        requests = [
            _chat_with_image(target, url, f"describe picture {index}")
            for index, url in enumerate(urls)
        ]

        async def sender(number: int) -> None:
            index = number
            while True:
                head, body = requests[index % len(requests)]
                index += IMAGE_CONNECTIONS
                await target.exchange(head, body=body)

        await asyncio.gather(*(sender(number) for number in range(IMAGE_CONNECTIONS)))

    return attack


def image_attacks() -> dict[str, Attack]:
    return {
        "image-bomb": _image_sender(lambda: [data_url(png_bomb())]),
        "image-50mb": _image_sender(lambda: [data_url(huge_image())]),
        "image-flood": _image_sender(
            lambda: [data_url(picture(seed, FLOOD_IMAGE_SIZE)) for seed in range(FLOOD_IMAGES)]
        ),
    }


def idle_sockets(count: int) -> Attack:
    async def attack(target: Target) -> None:
        async def hold() -> None:
            while True:  # the gateway closes it after its header timeout: open another
                connection = await target.connect(pause=0.5)
                if connection is None:
                    continue
                reader, writer = connection
                with contextlib.suppress(OSError):
                    target.answered(await reader.readline())
                writer.close()

        await asyncio.gather(*(hold() for _ in range(count)))

    return attack


async def keep_alive_sockets(target: Target) -> None:
    """``KEEP_ALIVE_ADDRESSES`` addresses holding ``KEEP_ALIVE_PER_ADDRESS`` sockets each,
    every one making a request without a key and keeping its connection open, reopened (and
    asking again) whenever the gateway closes it."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    async def hold(address: tuple[str, int] | None) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", target.port, local_addr=address
                )
            except OSError as exc:
                reason = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                target.statuses[f"connect failed: {reason}"] += 1
                await asyncio.sleep(0.5)
                continue
            try:
                writer.write(request)
                target.answered(await reader.readline())
                while await reader.read(65536):  # the answer, then until the gateway closes
                    pass
            except OSError as exc:
                target.statuses[type(exc).__name__] += 1
            finally:
                writer.close()

    # None: only 127.0.0.1 can be bound here (the report says so).
    addresses: list[tuple[str, int] | None] = [
        (f"127.64.{index // 250}.{1 + index % 250}", 0) if target.local_addr else None
        for index in range(KEEP_ALIVE_ADDRESSES)
    ]
    await asyncio.gather(
        *(hold(address) for address in addresses for _ in range(KEEP_ALIVE_PER_ADDRESS))
    )


async def big_bodies(target: Target) -> None:
    """``BIG_BODY_CONNECTIONS`` connections sending chat bodies of ``BIG_BODY`` bytes with the
    attacker's key, one after another."""
    filler = "a" * (BIG_BODY - 200)
    body = json.dumps(
        {"model": target.model, "max_tokens": 1, "messages": [{"role": "user", "content": filler}]}
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{target.auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )

    async def sender() -> None:
        while True:
            await target.exchange(head, body=body)

    await asyncio.gather(*(sender() for _ in range(BIG_BODY_CONNECTIONS)))


def agent_tools(salt: str) -> list[dict[str, Any]]:
    """``MANY_TOOLS`` function tools as a coding agent declares them: a paragraph of
    description and five described parameters each (as the worker describes them to a model
    whose template has no tools: 30.5k prompt tokens on tiny's tokenizer, 15.6k on SmolLM2's),
    ``salt`` in the first one's name."""
    words = str.split("read the file at the path and return its lines with numbers for the agent")
    tools = []
    for index in range(MANY_TOOLS):
        description = " ".join(words[(index + i) % len(words)] for i in range(120))
        properties = {
            f"arg{n}_{index}": {"type": "string", "description": " ".join(words[n:] + words[:n])}
            for n in range(5)
        }
        name = f"tool_{salt}_{index}" if index == 0 else f"tool_{index}"
        parameters = {
            "type": "object",
            "properties": properties,
            "required": ["arg0_" + str(index)],
        }
        tools.append(
            {
                "type": "function",
                "function": {"name": name, "description": description, "parameters": parameters},
            }
        )
    return tools


async def many_tools(target: Target) -> None:
    async def sender() -> None:
        while True:
            await target.chat(
                {
                    "messages": [{"role": "user", "content": "list the files"}],
                    "max_tokens": 8,
                    "tools": agent_tools(uuid.uuid4().hex[:8]),
                }
            )

    await asyncio.gather(*(sender() for _ in range(TOOL_CONNECTIONS)))


def long_prompts(concurrency: int) -> Attack:
    """``concurrency`` senders of streamed completions of ``target.filler`` after a fresh
    salt each, spending the key's quota no faster than the gateway refills it."""

    async def attack(target: Target) -> None:
        bucket = QuotaBucket(QUOTA_PER_MINUTE)

        async def sender() -> None:
            while True:
                await bucket.take()
                head, body = streamed_completion(
                    target.model, target.auth, target.filler, ATTACK_MAX_TOKENS
                )
                if b"data: [DONE]" in await target.exchange(head, body=body):
                    target.finished += 1

        await asyncio.gather(*(sender() for _ in range(concurrency)))

    return attack


def get(path: str, auth: str) -> str:
    """A GET request's head that closes its connection."""
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n"


def attacks(idle: int) -> dict[str, Attack]:
    return {
        "huge-header": huge_header,
        "huge-body": huge_body,
        "read-flood": read_flood,
        "resume-flood": resume_flood,
        "hostile-schema": hostile_schema,
        "idle-sockets": idle_sockets(idle),
        "nested-anyof": nested_anyof_schema,
        "logprobs-fanout": logprobs_fanout,
        "keep-alive-sockets": keep_alive_sockets,
        "big-bodies": big_bodies,
        "many-tools": many_tools,
        **image_attacks(),
        **{name: long_prompts(at_once) for name, (_, at_once) in LONG_PROMPT_ATTACKS.items()},
    }


async def _run(attack: Attack, target: Target) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(attack(target))
    # The attack's first step runs to its first wait: what it builds (the image attackers'
    # files) is built. Then the bench starts the victim.
    await asyncio.sleep(0)
    print(json.dumps({"ready": True}), flush=True)
    await stop.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _lowest_priority() -> None:
    """Run only on CPU nobody else wants (as far as the OS allows)."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


def source(number: int) -> str:
    """The address attack phase ``number`` connects from: a client of its own, so that one
    attacker's standing with the gateway (an address cooling down) is not the next one's."""
    return f"127.0.0.{FIRST_SOURCE + number % 250}"


def bindable(address: str) -> str | None:
    """``address`` where a socket can be bound to it, else None."""
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return None
    return address


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_redis_worker.bench.attackers")
    parser.add_argument("attack", choices=sorted(attacks(0)))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True, help="the attacker's API key")
    parser.add_argument("--own-request", default="", help="the resume flood's request id")
    parser.add_argument("--model", default="", help="the hostile schemas' model")
    parser.add_argument("--idle-sockets", type=int, default=1000)
    parser.add_argument("--source", default=source(0), help="the address to connect from")
    parser.add_argument("--prompt-file", default="", help="the long-prompt attackers' text")
    args = parser.parse_args(argv)
    _lowest_priority()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the idle sockets need room
    address = bindable(args.source)
    filler = Path(args.prompt_file).read_text() if args.prompt_file else ""
    target = Target(args.port, args.key, args.own_request, args.model, address, filler)
    asyncio.run(_run(attacks(args.idle_sockets)[args.attack], target))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report = {
        "statuses": dict(target.statuses),
        "exchanges": sum(target.statuses.values()),
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "finished": target.finished,
        "source": address or "127.0.0.1",
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
