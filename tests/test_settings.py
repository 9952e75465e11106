"""Worker settings: precedence flags > MLXW_* env > TOML file > defaults, and validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.daemon.settings import WorkerSettings, default_worker_id, load_settings


def test_precedence_flags_env_file_defaults(tmp_path: Path) -> None:
    config = tmp_path / "worker.toml"
    config.write_text(
        'model = "from-file"\nprefix = "file"\nmax-concurrency = 4\nlease_seconds = 9\n'
    )
    env = {"MLXW_PREFIX": "env", "MLXW_MAX_CONCURRENCY": "6", "MLXW_LOG_LEVEL": ""}
    settings = load_settings({"prefix": "flag", "model": None}, env, str(config))
    assert settings.prefix == "flag"  # flag beats env and file
    assert settings.max_concurrency == 6  # env beats file
    assert settings.model == "from-file"  # file beats default; a None flag is "not given"
    assert settings.lease_seconds == 9.0
    assert settings.drain_timeout == WorkerSettings().drain_timeout  # default


def test_bad_values_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="MLXW_MAX_CONCURRENCY"):
        load_settings({}, {"MLXW_MAX_CONCURRENCY": "many"})
    with pytest.raises(ValueError, match="max_concurrency must be > 0"):
        load_settings({"max_concurrency": 0}, {})
    with pytest.raises(ValueError, match="worker_id"):
        load_settings({"worker_id": "a{b}"}, {})
    config = tmp_path / "bad.toml"
    config.write_text("no_such_setting = 1\n")
    with pytest.raises(ValueError, match="unknown setting"):
        load_settings({}, {}, str(config))


def test_default_worker_id_is_stable_and_valid() -> None:
    assert default_worker_id() == default_worker_id()
    WorkerSettings(worker_id=default_worker_id())  # passes validation


def test_cli_reports_bad_settings_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "health", "--worker-id", "a{b}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mlx-worker health: bad settings: worker_id must be 1-128 characters of "
        "A-Z a-z 0-9 . _ : -, got 'a{b}'"
    ]
