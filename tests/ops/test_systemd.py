"""The systemd unit (as shipped and as installed), the install script's dry run, and the
log-rotation examples."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ops.helpers import OPS, VENV, run_script

UNIT = OPS / "systemd" / "mlx-worker.service"

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """A unit file as {section: {key: [values in order]}}: keys such as Environment= repeat,
    which configparser cannot keep."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"line {number} outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep and key.strip() == key.rstrip() and key.strip(), f"line {number}: {raw!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def one(unit: Unit, section: str, key: str) -> str:
    values = unit[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}= set {len(values)} times"
    return values[0]


def environment(unit: Unit) -> dict[str, str]:
    return dict(value.split("=", 1) for value in unit["Service"].get("Environment", []))


def seconds(value: str) -> float:
    """A systemd time span of the forms used here: 90, 90s, 2min."""
    if value.endswith("min"):
        return float(value[:-3]) * 60
    return float(value.removesuffix("s"))


def check_unit(unit: Unit) -> None:
    service = unit["Service"]
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert seconds(one(unit, "Service", "WatchdogSec")) > 0
    drain = float(environment(unit)["MLXW_DRAIN_TIMEOUT"])
    # systemd must not SIGKILL a worker that is still draining.
    assert seconds(one(unit, "Service", "TimeoutStopSec")) > drain + 20
    assert one(unit, "Service", "KillMode") == "mixed"
    assert one(unit, "Service", "User") not in ("", "root", "0")
    assert one(unit, "Service", "ExecStart").split()[0].startswith("/")
    assert one(unit, "Service", "EnvironmentFile").startswith("-/")
    for key, expected in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
    }.items():
        assert one(unit, "Service", key) == expected, key
    assert one(unit, "Service", "ProtectHome") in ("read-only", "tmpfs", "yes")
    # AF_UNIX carries the notify datagrams; AF_INET/AF_INET6 reach Redis.
    assert set(one(unit, "Service", "RestrictAddressFamilies").split()) == {
        "AF_INET",
        "AF_INET6",
        "AF_UNIX",
    }
    # MLX's JIT needs memory that is written and then executed.
    assert "MemoryDenyWriteExecute" not in service
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_shipped_unit() -> None:
    text = UNIT.read_text()
    check_unit(parse_unit(text))
    assert "redis://" not in text  # the secret stays in its own file


@pytest.mark.parametrize("drain_timeout", ["30", "75.5"])
def test_installed_unit_follows_the_options(tmp_path: Path, drain_timeout: str) -> None:
    text = run_script(
        "install-systemd.sh",
        "--print",
        "--venv",
        str(VENV),
        "--user",
        "svc",
        "--drain-timeout",
        drain_timeout,
    )
    unit = parse_unit(text)
    check_unit(unit)
    assert one(unit, "Service", "ExecStart").split()[0] == str(VENV / "bin" / "mlx-worker")
    assert one(unit, "Service", "User") == one(unit, "Service", "Group") == "svc"
    assert float(environment(unit)["MLXW_DRAIN_TIMEOUT"]) == float(drain_timeout)


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="no systemd-analyze here: the parser tests above stand in for it",
)
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    rendered = tmp_path / "mlx-worker.service"  # verify wants the real unit name and suffix
    rendered.write_text(run_script("install-systemd.sh", "--print", "--venv", str(VENV)))
    assert_verifies(rendered)


def assert_verifies(unit: Path) -> None:
    completed = subprocess.run(
        ["systemd-analyze", "verify", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    # verify only warns (exit 0) about unknown keys or bad values: any line about our file fails.
    assert not [line for line in output.splitlines() if unit.name in line], output


def test_install_dry_run_prints_the_systemctl_commands() -> None:
    out = run_script("install-systemd.sh", "--dry-run", "--venv", str(VENV))
    assert "+ systemctl daemon-reload" in out
    assert "+ systemctl enable --now mlx-worker.service" in out
    assert "/etc/systemd/system/mlx-worker.service" in out
    assert "chmod 600 /etc/mlx-redis-worker/redis-url" in out
    assert "chown mlxw:mlxw /etc/mlx-redis-worker/redis-url" in out


@pytest.mark.skipif(shutil.which("logrotate") is None, reason="no logrotate here")
def test_logrotate_example_parses(tmp_path: Path) -> None:
    completed = subprocess.run(
        [
            "logrotate",
            "--debug",
            "--state",
            str(tmp_path / "state"),
            str(OPS / "logrotate/mlx-worker"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "error" not in output.lower(), output


def test_newsyslog_example_lines() -> None:
    """logfilename [owner:group] mode count size when flags: no signal (N), no compression
    (the worker still writes to the file newsyslog just rotated)."""
    lines = [
        line.split()
        for line in (OPS / "newsyslog" / "mlx-worker.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(lines) == 2
    for path, owner, mode, count, size, _when, flags in lines:
        assert path.startswith("/") and path.endswith(".log")
        assert ":" in owner
        int(mode, 8)
        assert int(count) > 0 and int(size) > 0
        assert "N" in flags and not set(flags) & set("JZX")


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="no systemd-analyze here: the parser test stands in for it",
)
def test_gateway_unit_verifies(tmp_path: Path) -> None:
    unit = tmp_path / "mlx-gateway.service"
    text = (OPS / "systemd" / "mlx-gateway.service").read_text()
    unit.write_text(text.replace("/opt/mlx-redis-worker/.venv", str(VENV)))
    assert_verifies(unit)


def test_gateway_unit_runs_the_gateway_with_keys() -> None:
    unit = parse_unit((OPS / "systemd" / "mlx-gateway.service").read_text())
    assert one(unit, "Service", "ExecStart").endswith("mlx-worker --log-format json gateway")
    assert environment(unit)["MLXW_API_KEYS"].endswith("api-keys.toml")
    assert one(unit, "Service", "MemoryDenyWriteExecute") == "yes"  # no MLX in the gateway
    # Ready once it listens, and restarted when its event loop stops pinging.
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert int(one(unit, "Service", "WatchdogSec")) > 0
