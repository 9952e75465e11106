"""Security: passwords, an ACL user confined to the prefix, TLS, a wrong password, control
commands that try to leave the cache directory or write other keys, prompt and max_tokens caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from unittest import mock

import msgpack  # type: ignore[import-untyped]
import pytest
import redis

from mlx_redis_protocol.cli import main
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, ErrorEvent
from mlx_redis_worker.local_redis import RedisServer, free_port
from tests.reliability.workers import worker_process
from tests.support.acl import documented_minimum_acl
from tests.support.environment import clean_environment
from tests.support.processes import MODEL, mlx_worker
from tests.support.prompts import random_prompts
from tests.support.references import tiny_reference

PASSWORD = "s3cret-pw"
ADMIN = ("--user", "admin", "on", ">admin-pw", "~*", "&*", "+@all")
# The ACL lines docs/redis.md documents: the simple one, and the minimal one (every command the
# worker, the client and the CLI send, inside Lua scripts included, and nothing else), read
# from the page itself (after its user and password).
ACL_SIMPLE = ("~mlxw:*", "&mlxw:*", "+@all", "-@dangerous", "+info")
ACL_MINIMAL = tuple(documented_minimum_acl("mlxw")[2:])


# "Fails fast" means the command gives up at Redis's first refusal instead of riding it out
# like an outage (a retry every second or so for its whole window): counted as the connections
# Redis accepted while it ran, never as seconds (a loaded machine takes that long to start an
# interpreter). The most any of them makes today is two; the 60 s timeout is the bound on a hang.
MOST_CONNECTIONS = 2


def run_mlx_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return mlx_worker(*args, timeout=60)


def in_process(*args: str) -> subprocess.CompletedProcess[str]:
    """``mlx-worker ARGS`` through the CLI's ``main()`` in this process, its output captured:
    for checks about what Redis lets the user do, where a fresh interpreter per command
    (seconds each) proves nothing more."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, clean_environment(), clear=True),  # as mlx_worker's
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        status = main(list(args))
    return subprocess.CompletedProcess(list(args), status, out.getvalue(), err.getvalue())


def counted_mlx_worker(
    admin: redis.Redis, *args: str
) -> tuple[subprocess.CompletedProcess[str], int]:
    """Run ``mlx-worker ARGS``; returns the completed process and how many connections Redis
    accepted meanwhile (``admin``'s own is open before: its pool holds it)."""
    before = _connections(admin)
    completed = run_mlx_worker(*args)
    return completed, _connections(admin) - before


def _connections(admin: redis.Redis) -> int:
    return int(admin.info("stats")["total_connections_received"])


def with_password(url: str, user: str, password: str) -> str:
    return url.replace("redis://", f"redis://{user}:{password}@", 1)


@pytest.fixture
def password_server() -> Iterator[RedisServer]:
    with RedisServer(extra_args=("--requirepass", PASSWORD)) as server:
        yield server


def _serve_one_request(url: str, tmp_path: Path, prefix: str = "mlxw", **client: object) -> None:
    """A worker through ``url``; the async client and the CLI get greedy text through it."""
    prompt = random_prompts(1, seed=3)[0]
    (want,) = tiny_reference().texts([prompt], 12)
    process = worker_process("sec-1", url, prefix, tmp_path).start()
    try:
        process.wait_ready(timeout=90)

        async def main() -> None:
            async with Client(url, prefix=prefix, **client) as c:  # type: ignore[arg-type]
                done = await c.generate(prompt, max_tokens=12, temperature=0.0, timeout=60)
                assert isinstance(done, DoneEvent) and done.output_text == want
                assert [r.ok for r in await c.ping()] == [True]

        asyncio.run(main())
        submitted = run_mlx_worker(
            "submit",
            prompt,
            "--raw",  # compared with a greedy run of the bare prompt
            "--max-tokens",
            "12",
            "--temperature",
            "0",
            "--redis-url",
            url,
            "--prefix",
            prefix,
        )
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout.rstrip("\n") == want
        health = run_mlx_worker(
            "health", "--worker-id", "sec-1", "--redis-url", url, "--prefix", prefix
        )
        assert health.returncode == 0, health.stderr
        assert process.stop() == 0
    finally:
        process.kill()


def test_requirepass_worker_client_and_cli_work_through_the_url(
    password_server: RedisServer, tmp_path: Path
) -> None:
    _serve_one_request(with_password(password_server.url, "", PASSWORD), tmp_path)


@pytest.mark.parametrize("password", ["wrong", None])
def test_wrong_password_fails_fast_with_one_clear_line(
    password_server: RedisServer, tmp_path: Path, password: str | None
) -> None:
    """``run``, ``submit``, ``ctl`` and ``health`` exit non-zero at Redis's first refusal (no
    retries) with one line on stderr that says what is wrong and never shows the password."""
    url = with_password(password_server.url, "", password) if password else password_server.url
    cache = str(tmp_path / "caches")
    commands: list[Sequence[str]] = [
        # A model that does not exist: the answer is still about the password, since the
        # worker asks Redis before it loads a model (which can take minutes).
        (
            "run",
            "--model",
            str(tmp_path / "no-such-model"),
            "--worker-id",
            "w",
            "--cache-dir",
            cache,
        ),
        ("submit", "hello", "--max-tokens", "4"),
        ("ctl", "ping"),
        ("health", "--worker-id", "w"),
    ]
    with redis.Redis.from_url(with_password(password_server.url, "", PASSWORD)) as admin:
        for command in commands:
            completed, connections = counted_mlx_worker(admin, *command, "--redis-url", url)
            where = f"{command[0]}: rc={completed.returncode} stderr={completed.stderr!r}"
            assert completed.returncode != 0, where
            assert 1 <= connections <= MOST_CONNECTIONS, (connections, where)
            lines = [line for line in completed.stderr.splitlines() if line.strip()]
            assert len(lines) == 1, where
            assert any(
                word in lines[0].lower()
                for word in ("authentication", "password", "auth", "noauth")
            ), where
            if password:
                assert password not in completed.stderr + completed.stdout, where


def _acl_server(rules: Sequence[str]) -> RedisServer:
    return RedisServer(
        extra_args=("--user", "default", "off", "--user", "mlxw", "on", ">acl-pw", *rules, *ADMIN)
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rules", [ACL_SIMPLE, ACL_MINIMAL], ids=["simple", "minimal"])
def test_acl_user_confined_to_the_prefix_runs_everything_and_nothing_else(
    tmp_path: Path, rules: Sequence[str]
) -> None:
    """An ACL user limited to ``mlxw:*`` keys and channels (the README's two ACL lines):
    the worker, the client and the CLI do all their work (jobs, control commands, a dead
    letter, a SIGKILLed worker's job reclaimed by another, health) and Redis denies nothing
    (ACL LOG stays empty); a worker or a client pointed at another prefix fails fast with a
    clear message."""
    server = _acl_server(rules)
    server.start()
    url = with_password(server.url, "mlxw", "acl-pw")
    admin = redis.Redis.from_url(with_password(server.url, "admin", "admin-pw"))
    keys = Keys("mlxw")
    first = worker_process("acl-1", url, "mlxw", tmp_path).start()
    second = worker_process("acl-2", url, "mlxw", tmp_path)
    try:
        first.wait_ready(timeout=90)
        for command, status in (
            (("stats",), 0),
            (("ping",), 0),
            (("cache-save", "c1"), 0),
            (("cache-load", "c1"), 0),
            (("cache-clear",), 0),
            (("abort", "nobody"), 1),  # answered: not_found (the command ran)
        ):
            completed = in_process("ctl", *command, "--redis-url", url)
            assert completed.returncode == status, (command, completed.stdout, completed.stderr)
        submitted = in_process("submit", "hello", "--max-tokens", "4", "--redis-url", url)
        assert submitted.returncode == 0, submitted.stderr
        for command in (
            ("submit", "hi", "--max-tokens", "2", "--model", MODEL),
            ("ctl", "stats", "--model", MODEL),
            ("models",),
            ("group", "list"),
        ):
            completed = in_process(*command, "--redis-url", url)
            assert completed.returncode == 0, (command, completed.stdout, completed.stderr)

        async def main() -> None:
            async with Client(url) as client:
                bad = msgpack.packb({"v": 1, "request_id": "acl-bad", "max_tokens": 0})
                await client.redis.xadd(keys.jobs, {"job": bad})
                end = (
                    await client.wait("acl-bad", timeout=30)
                    if await _log_exists(client, "acl-bad")
                    else None
                )
                # Killed once it has 5 events: 100 tokens leave it mid-run, and the second
                # worker generates them all again (attempt 2).
                long_id = await client.submit("a long one", max_tokens=100, temperature=0.0)
                while admin.xlen(keys.log(long_id)) < 5:
                    await asyncio.sleep(0.05)
                first.kill()
                second.start()
                done = await client.wait(long_id, timeout=120)
                assert isinstance(done, DoneEvent) and done.attempt >= 2, done
                assert end is None or isinstance(end, ErrorEvent)

        asyncio.run(main())
        second.wait_ready()
        health = in_process("health", "--worker-id", "acl-2", "--redis-url", url)
        assert health.returncode == 0, health.stderr
        assert second.stop() == 0
        # Forwarded from the default stream to the model's, and dead-lettered there.
        assert admin.xlen(keys.model_stream(MODEL).dead) == 1
        assert admin.xlen(keys.dead) == 0
        denied = admin.acl_log()
        assert denied == [], denied

        # Outside the prefix: refused at once, with a clear line.
        for command in (
            (
                "run",
                "--model",
                "tiny",
                "--prefix",
                "other",
                "--worker-id",
                "o",
                "--cache-dir",
                str(tmp_path / "c"),
            ),
            ("submit", "hello", "--prefix", "other"),
        ):
            completed, connections = counted_mlx_worker(admin, *command, "--redis-url", url)
            lines = completed.stderr.strip().splitlines()
            where = f"{command[0]}: rc={completed.returncode} {completed.stderr!r}"
            assert completed.returncode != 0 and len(lines) == 1, where
            assert 1 <= connections <= MOST_CONNECTIONS, (connections, where)
            assert "permission" in lines[0].lower(), where
            assert "acl-pw" not in completed.stderr, where
    finally:
        first.kill()
        second.kill()
        admin.close()
        server.close()


async def _log_exists(client: Client, request_id: str) -> bool:
    for _ in range(200):
        if await client.redis.exists(client.keys.log(request_id)):
            return True
        await asyncio.sleep(0.05)
    return False


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certificates(directory: Path) -> None:
    """A private CA, a server certificate for 127.0.0.1 and a client certificate."""
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=mlxw-test-ca",
        cwd=directory,
    )
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ("-extfile", "san.cnf")), ("client", ())):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=mlxw-{name}",
            cwd=directory,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            *extra,
            cwd=directory,
        )


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_client_certificates_through_rediss_url(tmp_path: Path) -> None:
    """``rediss://`` with redis-py's TLS options as URL query parameters (CA, client
    certificate and key): the worker, the client and the CLI all work over TLS with mutual
    authentication; without the CA the CLI fails fast with one line."""
    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certificates(certs)
    tls_port = free_port()
    server = RedisServer(
        extra_args=(
            "--requirepass",
            PASSWORD,
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            str(certs / "server.crt"),
            "--tls-key-file",
            str(certs / "server.key"),
            "--tls-ca-cert-file",
            str(certs / "ca.crt"),
            "--tls-auth-clients",
            "yes",
        )
    )
    try:
        server.start()
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server has no TLS: {exc}")
        raise
    try:
        query = (
            f"ssl_ca_certs={certs / 'ca.crt'}&ssl_certfile={certs / 'client.crt'}"
            f"&ssl_keyfile={certs / 'client.key'}"
        )
        url = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0?{query}"
        _serve_one_request(url, tmp_path)
        no_ca = f"rediss://:{PASSWORD}@127.0.0.1:{tls_port}/0"
        # A handshake the client refuses is not counted by Redis (it counts connections once
        # their TLS is up): here run_mlx_worker's 60 s timeout is the bound on a hang, and the
        # one line naming the certificate is the answer that the client gave up at once.
        completed = run_mlx_worker("submit", "hi", "--redis-url", no_ca)
        lines = completed.stderr.strip().splitlines()
        assert completed.returncode == 2 and len(lines) == 1, completed.stderr
        assert "certificate" in lines[0].lower() and PASSWORD not in lines[0], lines
    finally:
        server.close()


def _command(prefix: str, kind: str, reply_to: str | None = None, **fields: object) -> bytes:
    token = f"t{time.monotonic_ns()}"
    keys = Keys(prefix)
    message = {"v": 1, "kind": kind, "id": token, "reply_to": reply_to or keys.reply(token)}
    packed: bytes = msgpack.packb({**message, **fields})
    return packed


@pytest.mark.timeout(120)
def test_control_commands_stay_inside_the_cache_dir_and_the_reply_lists(
    tmp_path: Path, password_server: RedisServer
) -> None:
    """Cache names that climb out (``..``, slashes, absolute paths) are refused by the
    decoder; a symlink planted in the cache directory that points outside is refused by the
    worker; nothing is written outside. A command whose ``reply_to`` names any key but one of
    the prefix's reply lists runs nothing and writes nothing (before the fix it appended to
    that key and set a 60 s TTL on it: the job stream itself could be made to expire)."""
    url = with_password(password_server.url, "", PASSWORD)
    prefix = "ctl"
    keys = Keys(prefix)
    caches, outside = tmp_path / "caches", tmp_path / "outside"
    caches.mkdir()
    outside.mkdir()
    (caches / "evil").symlink_to(outside, target_is_directory=True)
    process = worker_process("ctl-1", url, prefix, tmp_path).start()
    admin = redis.Redis.from_url(url)
    try:
        process.wait_ready(timeout=90)
        admin.set("victim", "keep me")

        async def main() -> None:
            async with Client(url, prefix=prefix) as client:
                await client.generate("fill the cache", max_tokens=4)
                refused = await client.cache_save("../outside")
                assert [(r.ok, r.error and r.error.code) for r in refused] == [
                    (False, "invalid_field")
                ], refused
                for kind, name in (
                    ("cache_save", "../outside"),
                    ("cache_save", "/tmp/x"),
                    ("cache_load", ".."),
                    ("cache_save", "a/b"),
                    ("cache_save", "evil"),
                    ("cache_load", "evil"),
                ):
                    data = _command(prefix, kind, name=name)
                    await client.redis.publish(keys.control, data)
                    reply = await client.redis.blpop(
                        [msgpack.unpackb(data)["reply_to"]], timeout=10
                    )
                    assert reply is not None, (kind, name)
                    answer = msgpack.unpackb(reply[1])
                    assert answer["ok"] is False, (kind, name, answer)
                    assert answer["error"]["code"] == "invalid_field", answer
                replies = await client.cache_save("inside-ok")
                assert [r.ok for r in replies] == [True], replies
                for reply_to in (*streams, "victim", "other:reply:{x}", f"{prefix}:reply:x"):
                    await client.redis.publish(keys.control, _command(prefix, "ping", reply_to))
                assert [r.ok for r in await client.ping()] == [True]

        streams = (keys.jobs, keys.model_stream(MODEL).stream)
        asyncio.run(main())
        assert list(outside.iterdir()) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            ["caches", "outside", "worker-ctl-1.log"]
        )
        assert (caches / "inside-ok").is_dir()
        for stream in streams:  # the default stream, and the model's the job ran on
            assert admin.ttl(stream) == -1 and admin.type(stream) == b"stream", stream
        assert admin.get("victim") == b"keep me" and admin.ttl("victim") == -1
        assert not admin.exists("other:reply:{x}", f"{prefix}:reply:x")
        refused = [e for e in process.log_events() if e["event"].startswith("control_command")]
        assert len(refused) >= 4, refused
        assert process.stop() == 0
    finally:
        process.kill()
        admin.close()


@pytest.mark.timeout(120)
def test_prompt_and_max_tokens_caps_hold(tmp_path: Path, password_server: RedisServer) -> None:
    """At the caps a job is accepted (shown without running it: its deadline has passed, so it
    ends ``expired``); one over is refused and dead-lettered with the decoder's code, with an
    ``error`` event since its request id is readable (also past a string or array over the
    msgpack-level limits). A text prompt within the string limit but over 32768 tokens is
    refused by the engine's cap (``invalid_field``). The client refuses over-cap jobs before
    touching Redis."""
    url = with_password(password_server.url, "", PASSWORD)
    prefix = "caps"
    keys = Keys(prefix)
    process = worker_process("caps-1", url, prefix, tmp_path).start()
    long_text = " ".join(["ab", "cd", "ef", "1", "2"] * 14_000)  # ~70k tokens, < 256 KiB
    # request id -> (job fields, the dead-letter code or None, whether an event is expected)
    cases: dict[str, tuple[dict[str, object], str | None, bool]] = {
        "at-max-tokens": ({"prompt": "x", "max_tokens": 32768, "deadline": 1.0}, None, True),
        "over-max-tokens": ({"prompt": "x", "max_tokens": 32769}, "limit_exceeded", True),
        "at-prompt-ids": ({"prompt_token_ids": [1] * 32768, "deadline": 1.0}, None, True),
        "over-prompt-ids": ({"prompt_token_ids": [1] * 32769}, "limit_exceeded", True),
        "over-prompt-string": ({"prompt": "x" * (256 * 1024 + 1)}, "limit_exceeded", True),
        "over-prompt-tokens": ({"prompt": long_text, "max_tokens": 1}, "invalid_field", True),
    }
    jobs = {
        rid: msgpack.packb({"v": 1, "request_id": rid, **fields})
        for rid, (fields, _, _) in cases.items()
    }
    admin = redis.Redis.from_url(url)
    try:
        process.wait_ready(timeout=90)

        async def main() -> dict[str, object]:
            async with Client(url, prefix=prefix) as client:
                with pytest.raises(ProtocolError):
                    await client.submit("x", max_tokens=32769)
                with pytest.raises(ProtocolError):
                    await client.submit(prompt_token_ids=[1] * 32769)
                for data in jobs.values():
                    await client.redis.xadd(keys.jobs, {"job": data})
                # Forwarded to the model's stream, then worked off there.
                while await client.redis.xlen(keys.jobs) + await client.redis.xlen(stream) > 0:
                    await asyncio.sleep(0.05)
                return {rid: await _ending(client, rid) for rid in cases}

        stream = keys.model_stream(MODEL).stream
        endings = asyncio.run(main())
        assert admin.xlen(keys.dead) == 0
        dead = {fields[b"job"]: fields for _, fields in admin.xrange(keys.model_stream(MODEL).dead)}
        for rid, (_, code, event) in cases.items():
            end = endings[rid]
            if code is None:
                assert isinstance(end, DoneEvent) and end.finish_reason == "expired", (rid, end)
                assert jobs[rid] not in dead
                continue
            assert dead[jobs[rid]][b"code"].decode() == code, (rid, dead[jobs[rid]])
            if not event:
                assert end is None, (rid, end)
                continue
            assert isinstance(end, ErrorEvent) and end.code == "invalid_job", (rid, end)
            assert end.message.startswith(f"{code}: "), end.message
            if rid == "over-prompt-tokens":
                assert "over the limit of 32768" in end.message, end.message
        assert len(dead) == 4
        assert process.stop() == 0
    finally:
        process.kill()
        admin.close()


async def _ending(client: Client, request_id: str) -> object:
    """The terminal event in a request's log (no queued marker was written for these), once
    the worker has worked the queue off; None when there is none."""
    for _ in range(20):
        for entry in await client.redis.xrange(client.keys.log(request_id)):
            event = decode_event(entry[1][b"e"])
            if event.terminal:
                return event
        await asyncio.sleep(0.05)
    return None
