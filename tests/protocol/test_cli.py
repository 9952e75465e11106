"""The command line: what it prints and how it exits, against stand-in and real workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis

from mlx_redis_protocol.cli import main
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.codec_job import decode_job
from mlx_redis_protocol.heartbeat import Heartbeat, ServedModel
from mlx_redis_protocol.keys import Keys
from mlx_redis_protocol.messages import DoneEvent, Event, Job
from mlx_redis_worker.local_redis import RedisServer, free_port
from tests.protocol.background import Background
from tests.protocol.fake_responder import FakeResponder
from tests.protocol.helpers import delta, done, emit, error, reset, text_events, wait_for_job
from tests.support.environment import clean_environment
from tests.support.fleet import write_heartbeat_sync
from tests.support.processes import WORKER_COMMAND, WorkerFactory
from tests.support.waiting import wait_until

Script = Callable[[Job], list[Event]]
REPO_ROOT = Path(__file__).resolve().parents[2]


def fake_worker(redis_url: str, keys: Keys, script: Script) -> Background:
    """Takes the first job off the stream and writes the events ``script`` makes for it. Its
    heartbeat (a worker of the tiny model) is there before it returns: ``submit`` finds a
    live worker to take jobs naming no model."""
    beat = Heartbeat(
        worker_id="fake",
        pid=1,
        started_at=1.0,
        in_flight=0,
        default_model="tiny",
        models={"tiny": ServedModel(max_concurrency=1, free_slots=1, in_flight=0)},
    )
    with redis.Redis.from_url(redis_url) as sync:
        write_heartbeat_sync(sync, keys, "fake", beat.encode())

    async def work(stop: asyncio.Event) -> None:
        redis = Redis.from_url(redis_url)
        try:
            job = decode_job(await wait_for_job(redis, keys))
            await emit(redis, keys, *script(job))
            await stop.wait()
        finally:
            await redis.aclose()

    return Background(work)


@contextlib.contextmanager
def control_responder(redis_url: str, keys: Keys) -> Iterator[Background]:
    """A fake worker answering control commands; subscribed and heartbeating on entry."""
    ready = threading.Event()

    async def serve(stop: asyncio.Event) -> None:
        redis = Redis.from_url(redis_url)
        try:
            async with FakeResponder(redis, keys, "w-1"):
                ready.set()
                await stop.wait()
        finally:
            await redis.aclose()

    with Background(serve) as background:
        # Background only waits for its loop; a command sent before the responder subscribed
        # and wrote its heartbeat would find no worker and time out at once.
        assert ready.wait(10), "the fake responder did not start"
        yield background


def cli(redis_url: str, prefix: str, *args: str) -> int:
    command, *rest = args
    if command == "ctl":
        return main([command, rest[0], "--redis-url", redis_url, "--prefix", prefix, *rest[1:]])
    return main([command, "--redis-url", redis_url, "--prefix", prefix, *rest])


def hello(job: Job) -> list[Event]:
    return text_events(job.request_id, ["Hello", ", ", "world"])


def test_submit_streams_text_and_exits_0_on_done(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_worker(redis_url, keys, hello):
        code = cli(redis_url, keys.prefix, "submit", "Say hello", "--timeout", "5")
    assert code == 0
    assert capsys.readouterr().out == "Hello, world\n"


def test_submit_json_prints_one_object_per_event(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_worker(redis_url, keys, hello):
        code = cli(redis_url, keys.prefix, "submit", "hi", "--json", "--request-id", "r-json")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert [line["type"] for line in lines] == ["queued", "delta", "delta", "delta", "done"]
    assert [line["seq"] for line in lines] == [0, 1, 2, 3, 4]
    assert all(line["request_id"] == "r-json" for line in lines)
    assert lines[-1]["output_text"] == "Hello, world"
    assert lines[-1]["usage"]["completion_tokens"] == len("Hello, world")


def submitted(redis_url: str, keys: Keys, *args: str) -> Job:
    """The job ``submit ARGS`` queued (exit 0), as a stand-in worker read it."""
    seen: list[Job] = []

    def record(job: Job) -> list[Event]:
        seen.append(job)
        return hello(job)

    with fake_worker(redis_url, keys, record):
        assert cli(redis_url, keys.prefix, "submit", *args) == 0
    return seen[0]


def test_submit_sends_the_options(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--max-tokens", "7", "--temperature", "0.5", "--stop", "x"]
    job = submitted(redis_url, keys, "hi", *args)
    assert (job.max_tokens, job.temperature, job.stop) == (7, 0.5, ("x",))
    # A chat turn by default, so an instruct model answers instead of continuing the text.
    assert job.chat_messages() == [{"role": "user", "content": "hi"}]
    assert job.prompt is None


@pytest.mark.parametrize(
    ("flags", "prompt", "messages"),
    [
        (["--raw"], "hi", None),
        (
            ["--system", "Be brief."],
            None,
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        ),
    ],
)
def test_submit_raw_sends_a_bare_prompt_and_system_a_leading_turn(
    redis_url: str,
    keys: Keys,
    flags: list[str],
    prompt: str | None,
    messages: list[dict[str, str]] | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = submitted(redis_url, keys, "hi", *flags)
    assert (job.prompt, job.chat_messages()) == (prompt, messages)


def test_submit_chat_flag_is_gone_and_raw_excludes_system(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["submit", "hi", "--chat"]) == 2
    assert "--chat" in capsys.readouterr().err
    assert main(["submit", "hi", "--raw", "--system", "x"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_error_event_exits_1(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing(job: Job) -> list[Event]:
        return [delta(job.request_id, 1, "par"), error(job.request_id, 2, "engine_error")]

    with fake_worker(redis_url, keys, failing):
        assert cli(redis_url, keys.prefix, "submit", "hi") == 1
    captured = capsys.readouterr()
    assert captured.out == "par\n"
    assert "engine_error" in captured.err


@pytest.mark.parametrize("reason", ["abort", "expired"])
def test_aborted_or_expired_exits_3(
    redis_url: str, keys: Keys, reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def ended(job: Job) -> list[Event]:
        return [done(job.request_id, 1, "", reason)]

    with fake_worker(redis_url, keys, ended):
        assert cli(redis_url, keys.prefix, "submit", "hi") == 3
    assert reason in capsys.readouterr().err


def test_reset_is_reported_and_the_stream_goes_on(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    def redelivered(job: Job) -> list[Event]:
        rid = job.request_id
        return [
            delta(rid, 1, "lost"),
            reset(rid, 2, attempt=2),
            delta(rid, 3, "kept", attempt=2),
            done(rid, 4, "kept", attempt=2),
        ]

    with fake_worker(redis_url, keys, redelivered):
        assert cli(redis_url, keys.prefix, "submit", "hi") == 0
    captured = capsys.readouterr()
    assert captured.out == "lost\nkept\n"
    assert "attempt 2" in captured.err


def test_no_stream_prints_the_request_id(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("submit", "hi", "--no-stream", "--request-id", "r-7", "--no-worker-check")
    assert cli(redis_url, keys.prefix, *args) == 0
    assert capsys.readouterr().out == "r-7\n"


def test_submit_without_a_live_worker_says_so_at_once_and_queues_nothing(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --model and no worker: nothing would take the job from the default stream."""
    for extra in ((), ("--no-stream",)):
        assert cli(redis_url, keys.prefix, "submit", "hi", "--request-id", "r-0", *extra) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines() == [
            "mlx-worker: no live worker serves the default stream (jobs naming no model): "
            "start a worker, name a model with --model, or queue it anyway with "
            "--no-worker-check"
        ]

    async def untouched() -> tuple[int, int]:
        client = Redis.from_url(redis_url)
        try:
            return await client.exists(keys.jobs), await client.exists(keys.log("r-0"))
        finally:
            await client.aclose()

    assert asyncio.run(untouched()) == (0, 0)


def test_stream_replays_a_finished_request(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    with fake_worker(redis_url, keys, hello):
        assert cli(redis_url, keys.prefix, "submit", "hi", "--request-id", "r-8") == 0
    capsys.readouterr()
    assert cli(redis_url, keys.prefix, "stream", "r-8") == 0
    assert capsys.readouterr().out == "Hello, world\n"


def test_unknown_request_exits_4(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(redis_url, keys.prefix, "stream", "no-such-request") == 4
    assert "no-such-request" in capsys.readouterr().err


def test_no_event_within_timeout_exits_5(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("submit", "hi", "--timeout", "0.3", "--no-worker-check")
    assert cli(redis_url, keys.prefix, *args) == 5


def test_unreachable_redis_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["submit", "hi", "--redis-url", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"mlx-worker: cannot connect to Redis at {url}")


def test_wrong_password_exits_2_saying_so(capsys: pytest.CaptureFixture[str]) -> None:
    with RedisServer(extra_args=["--requirepass", "right"]) as server:
        url = f"redis://:wrong@127.0.0.1:{server.port}/0"
        assert main(["ctl", "ping", "--redis-url", url]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mlx-worker: cannot connect to Redis at redis://:***@127.0.0.1:{server.port}/0: "
        "authentication failed\n"
    )


def test_ctl_says_how_many_workers_did_not_answer_within_the_timeout(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """A live worker that does not answer holds the command up to --timeout, no longer, and
    the person learns the replies shown are not every worker's."""
    with control_responder(redis_url, keys):
        with redis.Redis.from_url(redis_url) as admin:
            write_heartbeat_sync(admin, keys, "silent", b"1", ttl_ms=30_000)
        assert cli(redis_url, keys.prefix, "ctl", "ping", "--timeout", "3") == 0
    seen = capsys.readouterr()
    assert seen.out == "w-1: ok\n"
    assert seen.err == "1 of 2 workers replied within 3 s\n"


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["submit"]) == 2
    assert main(["submit", "hi", "--prefix", "bad{prefix"]) == 2
    assert main(["submit", "hi", "--temperature", "-1", "--redis-url", "redis://x:1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_environment_provides_url_and_prefix(
    redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MLXW_REDIS_URL", redis_url)
    monkeypatch.setenv("MLXW_PREFIX", keys.prefix)
    assert (
        main(["submit", "hi", "--no-stream", "--request-id", "from-env", "--no-worker-check"]) == 0
    )
    assert main(["stream", "from-env", "--timeout", "0.2"]) == 5  # found, but nothing runs it


def test_ctl_commands(redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = keys.prefix
    with control_responder(redis_url, keys):
        assert cli(redis_url, prefix, "ctl", "ping") == 0
        assert capsys.readouterr().out == "w-1: ok\n"
        assert cli(redis_url, prefix, "ctl", "stats", "--json") == 0
        reply = json.loads(capsys.readouterr().out)
        assert reply["ok"] and reply["worker_id"] == "w-1" and reply["result"]["running"] == 1
        # Stats of a shape the reader does not know are shown as they are, not guessed at.
        assert cli(redis_url, prefix, "ctl", "stats") == 0
        assert capsys.readouterr().out == ('w-1: {"running":1,"queued":0,"worker":"w-1"}\n')
        assert (
            cli(
                redis_url,
                prefix,
                "ctl",
                "cache-save",
                "warm",
                "--worker-id",
                "w-1",
                "--timeout",
                "15",
            )
            == 0
        )
        assert cli(redis_url, prefix, "ctl", "cache-load", "missing") == 1
        assert "not_found" in capsys.readouterr().out
        assert cli(redis_url, prefix, "ctl", "cache-clear") == 0
        assert cli(redis_url, prefix, "ctl", "abort", "some-request") == 0


def test_ctl_without_workers(
    redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(redis_url, keys.prefix, "ctl", "ping", "--timeout", "0.2") == 5
    assert cli(redis_url, keys.prefix, "ctl", "abort", "r-1") == 0
    assert "no worker replied" in capsys.readouterr().out


def test_module_entry_point(redis_url: str, keys: Keys) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_redis_protocol.cli",
            "stream",
            "nope",
            "--redis-url",
            redis_url,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "MLXW_PREFIX": keys.prefix},
    )
    assert result.returncode == 4, result.stderr


# -- against real workers --------------------------------------------------------------------


STATS_LABELS = ["jobs", "tokens", "cache", "queue", "memory"]


@pytest.mark.timeout(120)
def test_ctl_stats_summarises_a_real_worker_and_json_keeps_the_map(
    workers: WorkerFactory, redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """`ctl stats` gives people a few aligned lines per worker, with the figures of the
    reply that `--json` prints as one object; the other verbs answer in words too."""
    prefix = keys.prefix
    workers.start("w-real")
    for flags in ([], ["--raw"]):  # a chat turn (the default) and a bare prompt
        assert cli(redis_url, prefix, "submit", "hello there", "--max-tokens", "6", *flags) == 0
    capsys.readouterr()

    assert cli(redis_url, prefix, "ctl", "stats", "--json") == 0
    (line,) = capsys.readouterr().out.splitlines()
    reply = json.loads(line)
    assert reply["ok"] and reply["worker_id"] == "w-real"
    stats = reply["result"]
    engine, cache = stats["engine"], stats["prefix_cache"]
    assert cache["entries"] == 2  # one per finished job: the prompts share no prefix

    assert cli(redis_url, prefix, "ctl", "stats") == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"w-real: model tiny, up \d+s, healthy", header), header
    labels = [row.split()[0] for row in rows]
    assert labels == STATS_LABELS, rows
    starts = {match.end() for row in rows if (match := re.match(r"  \S+ +", row))}
    assert len(starts) == 1, rows  # every row indented, its figures in one column
    (column,) = starts
    text = {label: row[column:] for label, row in zip(labels, rows, strict=True)}
    assert text["jobs"] == "0 running; 0 waiting; 0 in flight; ended: completed 2"
    prompt, generated = engine["total_prompt_tokens"], engine["total_completion_tokens"]
    rate = generated / engine["model_seconds"]
    assert text["tokens"] == (
        f"{prompt} prompt, {generated} generated; {rate:.1f} tokens/s of model time"
    )
    assert text["cache"].startswith(f"{cache['entries']} entries, "), text["cache"]
    assert (
        f"hit rate {100 * cache['hits'] / 2:.0f}% ({cache['hits']} of 2 lookups)" in (text["cache"])
    )
    assert text["queue"] == f"group {prefix}, lag 0, pending 0, consumers 1"
    assert re.fullmatch(
        r"rss [\d.]+ MiB, MLX active [\d.]+ [KM]iB, MLX cache [\d.]+ ([KM]i)?B, "
        r"MLX peak [\d.]+ [KM]iB",
        text["memory"],
    ), text["memory"]

    assert cli(redis_url, prefix, "ctl", "ping") == 0
    assert capsys.readouterr().out == "w-real: pong\n"
    assert cli(redis_url, prefix, "ctl", "cache-save", "warm") == 0
    entries = cache["entries"]
    assert capsys.readouterr().out == f"w-real: saved cache 'warm' ({entries} entries)\n"
    assert cli(redis_url, prefix, "ctl", "cache-clear") == 0
    cleared = capsys.readouterr().out
    assert re.fullmatch(
        rf"w-real: cleared {entries} prefix cache entries \([\d.]+ [KM]iB\) and "
        r"[\d.]+ ([KM]i)?B of MLX buffers\n",
        cleared,
    ), cleared
    assert cli(redis_url, prefix, "ctl", "cache-load", "warm") == 0
    assert capsys.readouterr().out == f"w-real: loaded {entries} entries from cache 'warm'\n"


@pytest.mark.timeout(120)
def test_chat_for_a_model_without_chat_template_says_to_send_a_prompt(
    workers: WorkerFactory,
    redis_url: str,
    keys: Keys,
    tiny_model_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A worker whose tokenizer has no chat template ends a `messages` job with invalid_job
    and a message that names the fix; `submit --raw` then works."""
    folder = tmp_path / "tiny-without-template"
    folder.mkdir()
    for source in tiny_model_path.iterdir():  # the weights are linked, never copied
        (folder / source.name).symlink_to(source)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.unlink()
    config_path.write_text(json.dumps(config))
    assert not list(folder.glob("chat_template*"))
    prefix = keys.prefix
    # The worker's own concurrency and lease, as any other model's worker.
    workers.start("w-plain", model=str(folder), max_concurrency=None, lease_seconds=None)

    assert cli(redis_url, prefix, "submit", "hello", "--max-tokens", "4") == 1
    assert capsys.readouterr().err == (
        "error (invalid_job): invalid_field: job.messages: the model has no chat template; "
        "send a `prompt` instead (mlx-worker submit --raw)\n"
    )
    assert cli(redis_url, prefix, "submit", "hello", "--raw", "--max-tokens", "4") == 0
    assert cli(redis_url, prefix, "submit", "hello", "--system", "x", "--max-tokens", "4") == 1


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("flag", "value", "sent"),
    [
        ("--json-schema", "@schema", {"type": "json_schema", "schema": CITY_SCHEMA}),
        ("--response-format", '{"type": "json_object"}', {"type": "json_object"}),
        ("--response-format", "@@format", {"type": "regex", "pattern": "[0-9]+"}),
        (None, None, None),
    ],
)
def test_submit_sends_a_response_format_from_a_schema_file_json_or_a_json_file(
    redis_url: str,
    keys: Keys,
    tmp_path: Path,
    flag: str | None,
    value: str | None,
    sent: dict[str, object] | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``@schema`` and ``@format`` stand for files this test writes."""
    schema_file = tmp_path / "city.schema.json"
    schema_file.write_text(json.dumps(CITY_SCHEMA))
    format_file = tmp_path / "format.json"
    format_file.write_text(json.dumps({"type": "regex", "pattern": "[0-9]+"}))
    files = {"@schema": str(schema_file), "@@format": f"@{format_file}"}
    flags = [flag, files.get(value, value)] if flag and value else []
    assert submitted(redis_url, keys, "hi", *flags).response_format == sent


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--json-schema", "/no/such/file.json"], "cannot read /no/such/file.json"),
        (["--response-format", "{not json"], "--response-format: not valid JSON"),
        (["--response-format", "@/no/such/format.json"], "cannot read /no/such/format.json"),
        (["--response-format", '{"type": "xml"}'], "response_format"),
        (["--response-format", '"json_object"'], "response_format"),
        (["--json-schema", "a.json", "--response-format", "{}"], "not allowed with argument"),
    ],
)
def test_submit_refuses_a_bad_response_format_before_queueing_anything(
    redis_url: str,
    keys: Keys,
    flags: list[str],
    said: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli(redis_url, keys.prefix, "submit", "hi", "--no-worker-check", *flags) == 2
    assert said in capsys.readouterr().err
    assert not asyncio.run(_stream_length(redis_url, keys))


async def _stream_length(redis_url: str, keys: Keys) -> int:
    redis = Redis.from_url(redis_url)
    try:
        return int(await redis.xlen(keys.jobs))
    finally:
        await redis.aclose()


def test_submit_with_a_json_schema_prints_matching_json_from_a_real_worker(
    workers: WorkerFactory, redis_url: str, keys: Keys, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag's schema reaches the engine: even the random-weight model answers with JSON
    that matches it; an output cut short of it is said on stderr."""
    workers.start("w-structured")
    constrained = json.dumps({"type": "json_schema", "schema": CITY_SCHEMA})
    flags = ["--raw", "--temperature", "0", "--response-format", constrained]
    assert cli(redis_url, keys.prefix, "submit", "a city:", *flags) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) in ({"city": "Paris"}, {"city": "Rome"}), out.out
    assert out.err == ""
    assert cli(redis_url, keys.prefix, "submit", "a city:", *flags, "--max-tokens", "2") == 0
    assert capsys.readouterr().err == (
        "[the output does not match the response format: it was cut short]\n"
    )


# Runs the command after it with SIGINT at its default disposition. A suite started in the
# background by a non-interactive shell (``make test &``) inherits SIGINT ignored, and so does
# every child: ``submit`` then rightly ignores Ctrl-C, exits 0 and its job runs to its end.
SIGINT_AT_DEFAULT = (
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("detach", [False, True], ids=["aborts", "detaches"])
def test_ctrl_c_on_submit_aborts_its_job_unless_detached(
    workers: WorkerFactory, redis_url: str, keys: Keys, detach: bool
) -> None:
    """SIGINT while the text streams: the job is aborted and the command says so (exit 130);
    with --detach the job runs on to its end and the command says how to follow it."""
    workers.start("w-ctrl-c")
    request_id = f"ctrl-c-{detach}"
    tokens = 400
    command = [
        *SIGINT_AT_DEFAULT, *WORKER_COMMAND, "submit", "a long story", "--raw",
        "--max-tokens", str(tokens), "--temperature", "0", "--request-id", request_id,
        "--redis-url", redis_url, "--prefix", keys.prefix, *(["--detach"] if detach else []),
    ]  # fmt: skip
    submit = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_environment(),
    )
    try:
        with redis.Redis.from_url(redis_url) as sync:
            # A few deltas in: the job runs while the command follows it.
            wait_until(lambda: sync.xlen(keys.log(request_id)) > 3, 60, "the job's first deltas")
            submit.send_signal(signal.SIGINT)
            _, stderr = submit.communicate(timeout=30)
    finally:
        submit.kill()
    assert submit.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    note = stderr.strip().splitlines()[-1]

    async def ending() -> DoneEvent:
        async with Client(redis_url, prefix=keys.prefix) as client:
            ended = await client.wait(request_id, timeout=60)
        assert isinstance(ended, DoneEvent), ended
        return ended

    ended = asyncio.run(ending())
    if detach:
        assert note == (
            f"[detached: {request_id} keeps running; follow it: mlx-worker stream {request_id}]"
        )
        assert ended.finish_reason == "length"
        assert ended.usage.completion_tokens == tokens
    else:
        assert note == f"[interrupted: aborted {request_id}]"
        assert ended.finish_reason == "abort"
        assert 0 < ended.usage.completion_tokens < tokens
