"""The command's log set-up: structlog's lines and the standard library's records (the protocol
library's) rendered alike, on whatever stderr is when a line is written."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
import structlog

from mlx_redis_protocol.logs import configure_logging


def test_library_records_render_like_structlog_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    configure_logging("json", "INFO")
    structlog.get_logger("here").info("from_structlog", k=1)
    logging.getLogger("mlx_redis_protocol.redis_retry").warning(
        "redis_failing", extra={"operation": "read"}
    )
    logging.getLogger("quiet").debug("below_the_level")
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    assert [(x["event"], x["level"]) for x in lines] == [
        ("from_structlog", "info"),
        ("redis_failing", "warning"),
    ]
    assert lines[0]["k"] == 1 and lines[1]["operation"] == "read"


def test_a_closed_stderr_of_an_earlier_run_is_never_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A command run in-process (a test's) configures logging while stderr is a capture that
    is closed afterwards; lines logged later go to the stderr of that moment."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("json", "INFO")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    structlog.get_logger("later").info("after_the_swap")
    logging.getLogger("later").warning("stdlib_after_the_swap")
    events = [json.loads(line)["event"] for line in second.getvalue().splitlines()]
    assert events == ["after_the_swap", "stdlib_after_the_swap"]
