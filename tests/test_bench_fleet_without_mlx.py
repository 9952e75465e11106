"""`mlx-worker bench fleet` on a machine without MLX: every process of the bench (the command,
its worker hosts, its gateway) starts with a ``sitecustomize`` that makes importing MLX, mlx-lm,
the tokenizer stack, llguidance, mlx-vlm, mlx-embeddings, numpy or Pillow fail, as on a host
that has only the three wheels and their small pure-Python dependencies. The bench must still
run its simulated fleet (the real daemon over the engine stand-in) and end every request
exactly once, and no process of it may even try one of those imports."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.environment import clean_environment
from tests.support.processes import mlx_worker

BLOCKED = (
    "mlx",
    "mlx_lm",
    "transformers",
    "tokenizers",
    "llguidance",
    "mlx_vlm",
    "mlx_embeddings",
    "numpy",
    "PIL",
)
WORKERS = 5
REQUESTS = 20
TOKENS = 4

# Every process that starts with it notes its command line, and every import of a blocked
# package it tries (with where from), in the file FLEET_BLOCKER_LOG names: one JSON per line.
SITECUSTOMIZE = """
import json, os, sys, traceback

_BLOCKED = frozenset({blocked!r})
_LOG = os.environ["FLEET_BLOCKER_LOG"]


def _note(**entry):
    with open(_LOG, "a") as log:
        log.write(json.dumps({{"pid": os.getpid(), **entry}}) + "\\n")


class _NoMlx:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            stack = [f for f in traceback.format_stack() if "<frozen" not in f]
            _note(blocked=name, stack=stack[-10:-1])
            raise ImportError(f"{{name}} is not installed on this host (test blocker)")
        return None


_note(argv=sys.orig_argv)
sys.meta_path.insert(0, _NoMlx())
"""


def blocked_environment(tmp_path: Path) -> tuple[dict[str, str], Path]:
    folder = tmp_path / "no-mlx"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=BLOCKED))
    log = tmp_path / "blocker.jsonl"
    path = os.pathsep.join(filter(None, (str(folder), os.environ.get("PYTHONPATH"))))
    return clean_environment({"PYTHONPATH": path, "FLEET_BLOCKER_LOG": str(log)}), log


def notes(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.timeout(300)
def test_bench_fleet_runs_where_mlx_cannot_be_imported(tmp_path: Path) -> None:
    env, log = blocked_environment(tmp_path)
    result = mlx_worker(
        "bench",
        "fleet",
        f"--workers={WORKERS}",
        "--hosts=1",
        "--topology=server",
        f"--requests={REQUESTS}",
        "--rate=0",
        f"--max-tokens={TOKENS}",
        "--max-concurrency=4",
        "--step-ms=20",
        "--idle-seconds=0.5",
        env=env,
        timeout=240,
    )
    seen = notes(log)
    tried = [note for note in seen if "blocked" in note]
    output = result.stdout + result.stderr
    assert tried == [], "".join(f"{t['blocked']} from\n{''.join(t['stack'])}" for t in tried[:3])
    assert result.returncode == 0, output[-4000:]
    # The command, its worker host and its gateway each started with the blocker.
    commands = [" ".join(note["argv"]) for note in seen if "argv" in note]
    assert any("bench fleet" in command for command in commands), commands
    assert sum("mlx_redis_worker.bench.fleet_host" in command for command in commands) == 1
    assert sum(" gateway " in command for command in commands) == 1
    # The load's row: requests, ended once / whole / duplicates / lost.
    row = re.search(
        rf"^\| server \| {WORKERS} \| [^|]+ \| (\d+) \| (\d+) / (\d+) / (\d+) / (\d+) \|",
        result.stdout,
        re.MULTILINE,
    )
    assert row is not None, output[-4000:]
    assert tuple(int(n) for n in row.groups()) == (REQUESTS, REQUESTS, REQUESTS, 0, 0)
    assert f"{WORKERS}/{WORKERS} replies" in result.stdout


def test_the_blocker_blocks(tmp_path: Path) -> None:
    """The environment the bench runs in above does refuse those imports."""
    env, log = blocked_environment(tmp_path)
    for name in ("mlx.core", "mlx_lm", "tokenizers"):
        probe = python_probe(f"import {name}", env)
        assert probe.returncode != 0
        assert "is not installed on this host (test blocker)" in probe.stderr
    assert [note["blocked"] for note in notes(log) if "blocked" in note] == [
        "mlx",
        "mlx_lm",
        "tokenizers",
    ]


def python_probe(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
