"""The environment of the worker and CLI processes tests start: none of the developer's worker
settings, and intervals short enough that what a test waits for happens within seconds."""

from __future__ import annotations

import os
from collections.abc import Mapping

# Facts about this machine that a worker must share with the test process that prepared the
# models: where they are, and which OpenBLAS to load. Every other MLXW_ variable is a setting
# of the developer's that would change what a test's worker does.
MACHINE_VARIABLES = ("MLXW_MODEL_CACHE", "MLXW_OPENBLAS")
# A real service manager's socket must never hear a test worker's READY=1.
SERVICE_MANAGER_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# Heartbeats every half second, gone 2 s after the last: a test sees a worker come and go;
# activity rewritten five times a second: a test sees a job of a fraction of a second in it.
FAST_HEARTBEAT: Mapping[str, str] = {
    "MLXW_HEARTBEAT_INTERVAL": "0.5",
    "MLXW_HEARTBEAT_TTL": "2",
    "MLXW_ACTIVITY_INTERVAL": "0.2",
}
# A killed worker's jobs are reclaimed within a second of their lease's end.
FAST_RECLAIM: Mapping[str, str] = {"MLXW_RECLAIM_INTERVAL": "0.5"}
# Reads that block 200 ms under a 5 s socket timeout: a stop or a lost Redis is noticed soon.
SHORT_READS: Mapping[str, str] = {"MLXW_READ_BLOCK_MS": "200", "MLXW_SOCKET_TIMEOUT": "5"}

# The daemon and protocol tests' workers.
FAST_ENV: Mapping[str, str] = {**FAST_HEARTBEAT, **FAST_RECLAIM, **SHORT_READS}
# The service tests' workers: a service's own reclaim interval.
SERVICE_ENV: Mapping[str, str] = {**FAST_HEARTBEAT, **SHORT_READS}
# The reliability drivers' workers: fast failure detection and a short drain, with the
# default reads and socket timeout (the stall scenario sets its own).
FAULT_ENV: Mapping[str, str] = {**FAST_HEARTBEAT, **FAST_RECLAIM, "MLXW_DRAIN_TIMEOUT": "2"}


def clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without worker settings or a service manager's variables,
    unbuffered (a child's log is complete when it is killed), plus ``extra``."""
    env = {name: value for name, value in os.environ.items() if not _inherited_setting(name)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _inherited_setting(name: str) -> bool:
    if name in MACHINE_VARIABLES:
        return False
    return name.startswith("MLXW_") or name in SERVICE_MANAGER_VARIABLES
