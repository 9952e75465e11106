"""The launchd plist (rendered by the install script) and the launchd scripts' dry runs."""

from __future__ import annotations

import os
import plistlib
import re
from pathlib import Path
from typing import Any

import pytest

from tests.ops.helpers import OPS, VENV, run_script

TEMPLATE = OPS / "launchd" / "com.mlx-redis-worker.plist.template"


def render(*args: str, home: Path) -> dict[str, Any]:
    text = run_script(
        "install-launchd.sh", "--print", "--venv", str(VENV), *args, env={"HOME": str(home)}
    )
    plist: dict[str, Any] = plistlib.loads(text.encode())
    return plist


@pytest.mark.parametrize("drain_timeout", ["30", "45.5"])
def test_agent_plist_has_the_service_keys(tmp_path: Path, drain_timeout: str) -> None:
    plist = render("--drain-timeout", drain_timeout, "--metrics-port", "9464", home=tmp_path)
    assert plist["Label"] == "com.mlx-redis-worker"
    program = plist["ProgramArguments"]
    assert Path(program[0]).is_absolute()
    assert Path(program[0]) == VENV / "bin" / "mlx-worker"
    assert os.access(program[0], os.X_OK)
    assert "run" in program
    assert plist["RunAtLoad"] is True
    # Restart after crashes and error exits, not after the clean exit 0 of a requested stop.
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ThrottleInterval"] >= 5
    # Background would let macOS throttle MLX decoding severalfold.
    assert plist["ProcessType"] == "Interactive"
    env = plist["EnvironmentVariables"]
    assert env["HOME"] == str(tmp_path)
    assert env["PATH"].split(":")[0] == str(VENV / "bin")
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["MLXW_METRICS_PORT"] == "9464"
    # launchd must not SIGKILL a worker that is still draining.
    assert float(env["MLXW_DRAIN_TIMEOUT"]) == float(drain_timeout)
    assert isinstance(plist["ExitTimeOut"], int)
    assert plist["ExitTimeOut"] > float(drain_timeout) + 20
    assert Path(plist["WorkingDirectory"]).is_absolute()
    assert plist["StandardOutPath"] != plist["StandardErrorPath"]
    assert all(Path(plist[k]).is_absolute() for k in ("StandardOutPath", "StandardErrorPath"))
    # The secret stays out: the worker reads the URL from a file.
    assert env["MLXW_REDIS_URL_FILE"] == str(tmp_path / ".config/mlx-redis-worker/redis-url")
    assert "redis://" not in plistlib.dumps(plist).decode()
    # An agent runs as whoever loads it.
    assert "UserName" not in plist


def test_daemon_plist_runs_as_the_service_user(tmp_path: Path) -> None:
    plist = render("--system", "--user", "nobody", home=tmp_path)
    assert plist["UserName"] == "nobody"
    assert plist["StandardErrorPath"].startswith("/Library/Logs/")
    assert plist["EnvironmentVariables"]["MLXW_REDIS_URL_FILE"].startswith("/usr/local/etc/")
    # Empty means "no metrics endpoint": the worker ignores empty MLXW_* variables.
    assert plist["EnvironmentVariables"]["MLXW_METRICS_PORT"] == ""


def test_values_are_escaped(tmp_path: Path) -> None:
    plist = render("--model", "a&b<c>|d\\e", home=tmp_path)
    assert plist["EnvironmentVariables"]["MLXW_MODEL"] == "a&b<c>|d\\e"


def test_template_placeholders_are_all_rendered(tmp_path: Path) -> None:
    placeholders = set(re.findall(r"@[A-Z_]+@", TEMPLATE.read_text()))
    assert {"@VENV@", "@DRAIN_TIMEOUT@", "@EXIT_TIMEOUT@", "@URL_FILE@"} <= placeholders
    for args in ((), ("--system", "--user", "nobody")):
        rendered = run_script(
            "install-launchd.sh", "--print", "--venv", str(VENV), *args, env={"HOME": str(tmp_path)}
        )
        assert not re.findall(r"@[A-Z_]+@", rendered)


def test_install_dry_run_prints_the_launchctl_commands(tmp_path: Path) -> None:
    out = run_script(
        "install-launchd.sh", "--dry-run", "--venv", str(VENV), env={"HOME": str(tmp_path)}
    )
    domain = f"gui/{os.getuid()}"
    assert (
        f"launchctl bootstrap {domain} {tmp_path}/Library/LaunchAgents/com.mlx-redis-worker.plist"
        in out
    )
    assert f"launchctl kickstart -k {domain}/com.mlx-redis-worker" in out
    assert "chmod 600" in out and "redis-url" in out
    assert list(tmp_path.iterdir()) == []  # a dry run changes nothing


def test_uninstall_dry_run_prints_bootout(tmp_path: Path) -> None:
    out = run_script("uninstall-launchd.sh", "--dry-run", env={"HOME": str(tmp_path)})
    assert f"launchctl bootout gui/{os.getuid()}/com.mlx-redis-worker" in out
    out = run_script("uninstall-launchd.sh", "--dry-run", "--system")
    assert "launchctl bootout system/com.mlx-redis-worker" in out
    assert "rm -f /Library/LaunchDaemons/com.mlx-redis-worker.plist" in out


@pytest.mark.parametrize(
    "script", ["install-launchd.sh", "uninstall-launchd.sh", "install-systemd.sh"]
)
def test_help(script: str) -> None:
    assert "usage:" in run_script(script, "--help")
