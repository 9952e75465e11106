"""Operator mistakes through the real ``mlx-worker`` process: each is one line on stderr naming
the problem and a documented exit status, never a traceback unless ``--debug`` asks for it.

The model cases run against a reachable Redis (``redis_url``): the worker asks Redis first and
loads the model only after that, so without one they would be about Redis instead.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlx_redis_worker.local_redis import free_port
from tests.support.environment import clean_environment
from tests.support.processes import WorkerProcess, mlx_worker

# A password that must never show up in any output.
SECRET = "hunter2-secret"


def one_line(completed: subprocess.CompletedProcess[str], status: int) -> str:
    """The single stderr line of a failed command (asserting there is exactly one, and no
    traceback), after checking its exit status."""
    where = f"rc={completed.returncode} stderr={completed.stderr!r}"
    assert completed.returncode == status, where
    assert "Traceback" not in completed.stderr, where
    lines = completed.stderr.splitlines()
    assert len(lines) == 1, where
    return lines[0]


def run_args(redis_url: str, prefix: str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--redis-url",
        redis_url,
        "--prefix",
        prefix,
        "--worker-id",
        "operator",
        "--cache-dir",
        str(tmp_path / "caches"),
        *extra,
    ]


def test_a_model_folder_that_does_not_exist(redis_url: str, prefix: str, tmp_path: Path) -> None:
    line = one_line(
        mlx_worker(*run_args(redis_url, prefix, tmp_path, "--model", "/does/not/exist")), 2
    )
    assert line == "mlx-worker: model folder '/does/not/exist' does not exist"


def test_a_misspelt_fixture_name(redis_url: str, prefix: str, tmp_path: Path) -> None:
    """A name that is no fixture, no folder and no cached hub id: nothing is downloaded."""
    line = one_line(mlx_worker(*run_args(redis_url, prefix, tmp_path, "--model", "tiyn")), 2)
    assert line.startswith("mlx-worker: model 'tiyn' is not a fixture name (tiny, "), line
    assert "smollm2" in line and "not a local folder" in line, line
    assert "not in the local Hugging Face cache" in line, line


def test_a_folder_mlx_lm_cannot_load(redis_url: str, prefix: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    line = one_line(mlx_worker(*run_args(redis_url, prefix, tmp_path, "--model", str(empty))), 2)
    assert line.startswith(f"mlx-worker: model '{empty}': mlx-lm cannot load {empty}: "), line
    assert "config.json" in line, line


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_too(
    redis_url: str, prefix: str, tmp_path: Path, how: str
) -> None:
    args = run_args(redis_url, prefix, tmp_path, "--model", "/does/not/exist")
    if how == "flag":
        completed = mlx_worker("--debug", *args)
    else:
        completed = mlx_worker(*args, env={"MLXW_DEBUG": "1"})
    assert completed.returncode == 2, completed.stderr
    assert completed.stderr.startswith("Traceback (most recent call last):"), completed.stderr
    assert "ModelUnavailable" in completed.stderr
    last = completed.stderr.splitlines()[-1]
    assert last == "mlx-worker: model folder '/does/not/exist' does not exist"


def test_a_redis_url_that_is_no_url() -> None:
    line = one_line(mlx_worker("run", "--redis-url", "garbage"), 2)
    assert line.startswith(
        "mlx-worker run: bad settings: redis_url 'garbage' is not a Redis URL: no scheme; use "
        "redis://"
    ), line
    assert "rediss://" in line and "redis+sentinel://" in line, line


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        (f"redis://bob:{SECRET}@localhost:port/0", "the port must be a number"),
        (f"http://bob:{SECRET}@localhost:6379/0", "unknown scheme"),
        (f"redis+sentinel://bob:{SECRET}@", "redis+sentinel URLs look like"),
        (f"redis://:{SECRET}@localhost:6379/zero", "database number"),
    ],
)
def test_a_bad_redis_url_never_shows_its_password(url: str, problem: str) -> None:
    completed = mlx_worker("run", "--redis-url", url)
    line = one_line(completed, 2)
    assert problem in line, line
    assert SECRET not in completed.stderr + completed.stdout


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('max_concurrency = "four"\n', "max_concurrency must be an integer, got the string 'four'"),
        ('allow_eviction = "yes"\n', "allow_eviction must be true or false, got the string 'yes'"),
        ("lease_seconds = true\n", "lease_seconds must be a number, got bool"),
        ("max_concurrency = \n", "not valid TOML: "),
        ("max_concurency = 4\n", "unknown setting 'max_concurency'"),
    ],
    ids=["int-as-string", "bool-as-string", "bool-as-number", "syntax", "unknown-key"],
)
def test_a_config_file_with_a_wrong_value(tmp_path: Path, toml: str, message: str) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(toml)
    line = one_line(mlx_worker("run", "--config", str(config)), 2)
    assert line.startswith(f"mlx-worker run: bad settings: config file {config}: {message}"), line


def test_a_settings_mistake_is_answered_without_loading_mlx(tmp_path: Path) -> None:
    """Bad settings and `health` need none of the daemon's imports (MLX, the engine: more
    than a second of start-up): the process never imports mlx."""
    config = tmp_path / "worker.toml"
    config.write_text("max_concurency = 4\n")
    closed = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    script = (
        "import sys\n"
        "from mlx_redis_protocol.cli import main\n"
        "statuses = [main(args) for args in (\n"
        f"    ['run', '--config', {str(config)!r}],\n"
        "    ['run', '--redis-url', 'garbage'],\n"
        f"    ['health', '--worker-id', 'nobody', '--redis-url', {closed!r}],\n"
        ")]\n"
        "print(statuses, sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=clean_environment(),
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "[2, 2, 1] []", completed.stdout + completed.stderr


def test_a_config_file_that_is_not_there(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    line = one_line(mlx_worker("run", "--config", str(missing)), 2)
    assert line == (
        f"mlx-worker run: bad settings: config file {missing}: cannot read it: "
        "No such file or directory"
    )


def test_an_unknown_log_level() -> None:
    line = one_line(mlx_worker("--log-level", "LOUD", "run"), 2)
    assert line == "mlx-worker run: unknown log level 'LOUD'"


def test_an_unexpected_failure_is_one_line_and_status_1() -> None:
    """Any other exception (here: a concurrency list that is not numbers, which the bench
    does not check for) is one line naming its type, status 1; with --debug, the traceback."""
    args = ("bench", "engine", "--concurrency", "many")
    line = one_line(mlx_worker(*args), 1)
    assert line == "mlx-worker bench: ValueError: invalid literal for int() with base 10: 'many'"
    debug = mlx_worker("--debug", *args)
    assert debug.returncode == 1
    assert debug.stderr.startswith("Traceback (most recent call last):"), debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("ValueError: invalid literal for int()")


def test_an_unusable_model_is_a_usage_error_for_every_command() -> None:
    line = one_line(mlx_worker("bench", "scheduler", "--model", "tiyn"), 2)
    assert line.startswith("mlx-worker bench: model 'tiyn' is not a fixture name"), line


def test_a_redis_that_never_answers_at_start_ends_the_worker_with_status_75(
    tmp_path: Path, prefix: str
) -> None:
    """Past redis_start_timeout the worker gives up with one line, for its service manager to
    start it again; the model is never loaded."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    completed = mlx_worker(
        "--log-format",
        "json",
        *run_args(url, prefix, tmp_path, "--model", "tiny", "--redis-start-timeout", "0.3"),
    )
    where = f"rc={completed.returncode} stderr={completed.stderr!r}"
    assert completed.returncode == 75, where
    assert "Traceback" not in completed.stderr, where
    lines = completed.stderr.splitlines()
    events = [json.loads(line)["event"] for line in lines if line.startswith("{")]
    (said,) = [line for line in lines if not line.startswith("{")]
    assert said.startswith(
        f"mlx-worker: Redis at {url} did not answer within 0.3 s of the start (ConnectionError: "
    ), said
    assert said.endswith(
        "; exiting for the service manager to start the worker again (redis_start_timeout)"
    ), said
    assert "redis_failing" in events and "model_loaded" not in events, events


def test_redis_start_timeout_must_not_be_negative(tmp_path: Path, prefix: str) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    line = one_line(mlx_worker(*run_args(url, prefix, tmp_path, "--redis-start-timeout", "-1")), 2)
    assert line == "mlx-worker run: bad settings: redis_start_timeout must be >= 0, got -1.0"


@pytest.mark.timeout(90)
def test_sigterm_while_waiting_for_an_unreachable_redis_exits_0(
    tmp_path: Path, prefix: str
) -> None:
    """A worker whose Redis does not answer waits for it, and a stop request ends the wait:
    within a second or so, status 0, without a model load."""
    closed = free_port()  # nothing listens there
    # No fast intervals: the worker's own way of waiting for Redis.
    worker = WorkerProcess(
        "operator", tmp_path, prefix=prefix, redis_url=f"redis://127.0.0.1:{closed}/0"
    ).start()
    try:
        deadline = time.monotonic() + 60
        # Waiting for Redis: its first failed connect is logged.
        while "redis_failing" not in worker.log_text():
            assert worker.running(), worker.log_text()
            assert time.monotonic() < deadline, worker.log_text()
            time.sleep(0.1)
        time.sleep(2)
        assert worker.running(), worker.log_text()
        worker.signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert worker.wait(10) == 0, worker.log_text()
        assert time.monotonic() - signalled < 3, worker.log_text()
        lines = worker.log_text().splitlines()
        events = [json.loads(line) for line in lines if line[:1] == "{"]
        assert [e["event"] for e in events if e["event"].startswith("worker_")] == [
            "worker_stopped_before_serving"
        ]
        assert "Traceback" not in worker.log_text()
    finally:
        worker.kill()
