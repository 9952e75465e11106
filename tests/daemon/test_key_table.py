"""The spec's key table is complete: every key and channel the worker and its clients touch on
a real Redis is a row of protocol/README.md's table, and an ACL built from the table suffices.

Redis' MONITOR shows every command, those the worker's Lua scripts call included, while a
worker starts, forwards default-stream jobs, runs jobs named by model, dead-letters garbage,
answers control commands, aborts a job and stops. Before, the table lacked the forwarded
marker ``mlxw:forwarded:{MODEL}:ID``, which an operator writing an ACL from it could not know.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
from pathlib import Path

import pytest
import redis
import redis.asyncio

from mlx_redis_gateway.permissions import gateway_probes
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.constants import JOB_FIELD
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent
from mlx_redis_protocol.permissions import refusal
from mlx_redis_worker.daemon.permissions import fair_share_probes, probes
from tests.daemon.helpers import collect, settled
from tests.support.processes import MODEL, WorkerFactory
from tests.support.waiting import run, until

SPEC = Path(__file__).resolve().parents[2] / "protocol" / "README.md"
PLACEHOLDER = re.compile(r"\{(request_id|MODEL|worker_id|token|key_name)\}|:ID$|:RESPONSE_ID$")


def table_patterns(prefix: str) -> dict[str, re.Pattern[str]]:
    """The names of the Keys table (its first column's code spans), as regular expressions
    for the test's prefix: ``{request_id}`` and the like stand for one hash tag, ``ID`` for a
    stream entry id; other braces are literal."""
    text = SPEC.read_text()
    table = text[text.index("## Keys") : text.index("*Request ids, worker ids")]
    patterns = {}
    for row in table.splitlines():
        if not row.startswith("| `"):
            continue
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            if ":" not in name:
                continue  # the consumer group's name, not a key
            # Every occurrence: the registry's hash tag is the default stream's name.
            local = re.sub(r"\bmlxw:", f"{prefix}:", name)
            pieces, at = [], 0
            for found in PLACEHOLDER.finditer(local):
                pieces.append(re.escape(local[at : found.start()]))
                if found.group(1):
                    pieces.append(r"\{[^{}]+\}")
                else:
                    entry = found.group(0) == ":ID"
                    pieces.append(r":\d+-\d+" if entry else r":resp_[A-Za-z0-9_.:-]+")
                at = found.end()
            pieces.append(re.escape(local[at:]))
            patterns[name] = re.compile("".join(pieces) + "$")
    return patterns


def test_the_table_names_the_forwarded_and_finished_markers() -> None:
    patterns = table_patterns("p")
    assert patterns["mlxw:forwarded:{MODEL}:ID"].match("p:forwarded:{tiny}:1712-0")
    assert patterns["mlxw:done:{request_id}"].match("p:done:{r-1}")
    assert not patterns["mlxw:jobs:{MODEL}"].match("p:jobs:{a}:b")
    assert patterns["mlxw:workers:{mlxw:jobs}"].match("p:workers:{p:jobs}")
    assert patterns["mlxw:models:{mlxw:jobs}"].match("p:models:{p:jobs}")


class Monitor:
    """Every name under the prefix in the commands Redis executes (MONITOR), on a thread."""

    def __init__(self, url: str, prefix: str) -> None:
        # No socket timeout: a read that times out drops the connection, and MONITOR with it.
        self.client = redis.Redis.from_url(url, socket_timeout=None)
        self.prefix = prefix
        self.names: set[str] = set()
        self._done = threading.Event()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Monitor:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.client.echo("monitor-stop")  # wakes the reader
        self._thread.join(10)
        self.client.close()

    def _watch(self) -> None:
        with self.client.monitor() as monitor:
            self._started.set()
            while not self._done.is_set():
                command = monitor.next_command()["command"]
                for token in command.split(" "):
                    if token.startswith(self.prefix + ":") and "*" not in token:
                        self.names.add(token)


@pytest.mark.timeout(240)
def test_every_key_a_worker_and_its_clients_touch_is_in_the_spec_key_table(
    workers: WorkerFactory, redis_url: str, prefix: str
) -> None:
    patterns = table_patterns(prefix)

    async def flow() -> None:
        async with Client(redis_url, prefix=prefix) as client:
            plain = await client.submit("forwarded", max_tokens=4, temperature=0.0)
            named = await client.submit("by model", model=MODEL, max_tokens=4, temperature=0.0)
            long = await client.submit("to abort", model=MODEL, max_tokens=2000)
            await client.redis.xadd(client.keys.jobs, {JOB_FIELD: b"\x81\xa1v\x02 garbage"})
            for rid in (plain, named):
                assert isinstance((await collect(client, rid))[-1], DoneEvent)
            await client.abort(long)
            await collect(client, long)
            await client.stats()
            await client.ping()
            await until(lambda: settled(client), 20, "every entry settled")

    with Monitor(redis_url, prefix) as monitor:
        worker = workers.start("keys")
        run(flow())
        worker.signal(signal.SIGTERM)
        assert worker.wait(30) == 0, worker.log_tail()
    names = monitor.names
    assert any(":forwarded:" in name for name in names)  # the flow reached every kind
    assert any(":done:" in name for name in names)
    assert any(":workers:" in name for name in names)
    unlisted = sorted(n for n in names if not any(p.match(n) for p in patterns.values()))
    assert not unlisted, f"keys or channels missing from the spec's key table: {unlisted}"


def test_every_name_the_keys_build_and_the_probes_touch_is_a_row_of_the_table() -> None:
    """``Keys.pattern_of``, which a refused probe names, maps each kind of name to its row of
    the spec's table, word for word: the table, the key builders and the probes cannot drift
    apart without this failing."""
    keys = Keys()
    rows = set(table_patterns("mlxw"))
    fair = keys.fair("m")
    built = [
        keys.jobs,
        keys.dead,
        keys.workers,
        keys.models,
        keys.tenant_weights,
        keys.control,
        keys.model_stream("m").stream,
        keys.model_stream("m").dead,
        keys.forwarded("m", "1712-0"),
        fair.backlogged,
        fair.queue("tenant"),
        fair.served(60),
        *(build("r-1") for build in (keys.out, keys.log, keys.attempt, keys.finished)),
        *(build("r-1") for build in (keys.abort, keys.gateway_request)),
        *(build("w-1") for build in (keys.control_for, keys.worker, keys.activity)),
        keys.reply("t-1"),
        keys.quota("k-1"),
        keys.quota_in_flight("k-1"),
        keys.quota_tokens("k-1"),
        keys.stored_responses("k-1"),
        keys.stored_responses_bytes("k-1"),
        keys.stored_response("k-1", "resp_1"),
    ]

    async def probed() -> list[str]:
        client = redis.asyncio.Redis()
        try:
            found = probes(client, keys, "me", 10, [MODEL]) + fair_share_probes(client, keys, "m")
            found += gateway_probes(client, keys, status_page=True, limits=True)
        finally:
            await client.aclose()
        # Script and TIME probes touch no key; the subscribe probe names its channels at once.
        return [p.subject for p in found if p.subject and ", " not in p.subject]

    for name in built + asyncio.run(probed()):
        assert keys.pattern_of(name) in rows, (name, keys.pattern_of(name))
    assert keys.pattern_of("elsewhere:log:{r}") == "elsewhere:log:{r}"


def test_a_refused_probe_names_the_key_pattern_and_the_fix(prefix: str) -> None:
    """A probe of a key whose name is not its pattern (the forwarded marker, a model's stream)
    names the table's pattern in the refusal line, and the documented grant."""
    keys = Keys(prefix)

    async def main() -> None:
        client = redis.asyncio.Redis()
        try:
            found = probes(client, keys, "mine", 10, [MODEL])
        finally:
            await client.aclose()
        forwarded = next(p for p in found if ":forwarded:" in p.subject)
        denied = redis.exceptions.NoPermissionError("No permissions to access a key")
        line = refusal("bob", keys, forwarded, denied)
        assert line == (
            f"Redis user 'bob' has no permission for the key '{prefix}:forwarded:{{{MODEL}}}:0-1' "
            f"(pattern {prefix}:forwarded:{{MODEL}}:ID; SET, needed to forward jobs of the "
            f"default stream to a model's stream); grant ~{prefix}:* "
            "(see docs/redis.md: minimum ACL)"
        )
        streams = {p.subject for p in found if p.command == "XREADGROUP"}
        assert streams == {keys.jobs, keys.model_stream(MODEL).stream}

    asyncio.run(main())
