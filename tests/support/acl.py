"""Redis ACL users for tests: the documented grants (docs/redis.md), made on a test's own server,
and what Redis denied them (``ACL LOG``)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import redis

from tests.support.environment import clean_environment
from tests.support.processes import MODEL, WORKER_COMMAND

REDIS_DOCS = Path(__file__).resolve().parents[2] / "docs" / "redis.md"
PROTOCOL_DOCS = Path(__file__).resolve().parents[2] / "protocol" / "README.md"
PASSWORD = "acl-test-pw"
# Makes a user with these rules (after ``reset``); returns its name and a URL logging in as it.
MakeUser = Callable[[list[str]], tuple[str, str]]


def documented_minimum_acl(
    prefix: str, *, gateway: bool = False, fair_share: bool = False
) -> list[str]:
    """The documented minimum ACL line for ``prefix``, as ACL SETUSER rules (after the name);
    with ``gateway`` (``fair_share``), the rules its gateway (fair share) line adds as well."""
    rules = _rules(lambda line: line.startswith("user mlxw on >PASSWORD") and "-@all" in line)
    fair_line = "ACL SETUSER mlxw +xread "
    if gateway:
        rules += _rules(
            lambda line: line.startswith("ACL SETUSER mlxw +") and not line.startswith(fair_line)
        )
    if fair_share:
        rules += _rules(lambda line: line.startswith(fair_line))
    return [
        rule.replace(">PASSWORD", f">{PASSWORD}")
        .replace("~mlxw:*", f"~{prefix}:*")
        .replace("&mlxw:*", f"&{prefix}:*")
        for rule in rules
    ]


def documented_client_acl(prefix: str) -> list[str]:
    """protocol/README.md's ACL line of a client (submit, follow, control), as ACL SETUSER
    rules for ``prefix``."""
    rules = _rules(lambda line: line.startswith("user client on >PASSWORD"), PROTOCOL_DOCS)
    return [
        rule.replace(">PASSWORD", f">{PASSWORD}")
        .replace("~mlxw:*", f"~{prefix}:*")
        .replace("&mlxw:*", f"&{prefix}:*")
        for rule in rules
    ]


def _rules(wanted: Callable[[str], bool], docs: Path = REDIS_DOCS) -> list[str]:
    lines = [line.strip() for line in docs.read_text().splitlines() if wanted(line.strip())]
    assert len(lines) == 1, lines
    return lines[0].split()[2:] if lines[0].startswith("user ") else lines[0].split()[3:]


class AclUsers:
    """Users made through ``admin`` on the server at ``url``; ``delete_all`` removes them."""

    def __init__(self, admin: redis.Redis, url: str) -> None:
        self.admin = admin
        self.url = url
        self.made: list[str] = []

    def make(self, rules: list[str]) -> tuple[str, str]:
        name = f"acl-{uuid.uuid4().hex[:8]}"
        self.admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
        self.made.append(name)
        return name, self.url.replace("redis://", f"redis://{name}:{PASSWORD}@", 1)

    def delete_all(self) -> None:
        for name in self.made:
            self.admin.execute_command("ACL", "DELUSER", name)


def denials(admin: redis.Redis, user: str) -> list[object]:
    """What Redis refused ``user`` (its ACL LOG entries)."""
    return [entry for entry in admin.acl_log(count=1000) if entry.get("username") == user]


def start_refused(
    url: str, prefix: str, tmp_path: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    """``mlx-worker run`` (with ``options``) of a model whose weights do not exist: a
    permission refusal must come first (Redis is checked before the model load)."""
    return subprocess.run(
        [
            *WORKER_COMMAND,
            "run",
            "--model",
            f"{MODEL}=/does/not/exist",
            *options,
            "--redis-url",
            url,
            "--prefix",
            prefix,
            "--worker-id",
            "refused",
            "--cache-dir",
            str(tmp_path / "caches"),
        ],
        capture_output=True,
        text=True,
        env=clean_environment({}),
        timeout=60,
        check=False,
    )


def refusal_line(completed: subprocess.CompletedProcess[str]) -> str:
    """The one line a process refused by Redis printed: exit status 2, no traceback, no
    password."""
    where = f"rc={completed.returncode} stderr={completed.stderr!r}"
    assert completed.returncode == 2, where
    assert "Traceback" not in completed.stderr, where
    lines = completed.stderr.splitlines()
    assert len(lines) == 1, where
    assert PASSWORD not in completed.stderr + completed.stdout
    return lines[0]
