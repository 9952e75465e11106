"""structlog set-up: JSON lines in production, a readable console format for humans.

Jobs bind ``request_id`` with ``structlog.contextvars.bound_contextvars`` so every line logged
while serving a job carries it.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Literal

import structlog

LogFormat = Literal["json", "console"]


def configure_logging(log_format: LogFormat = "json", level: str = "INFO") -> None:
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def tell_operator(line: str, exc: BaseException, *, debug: bool) -> None:
    """One line on stderr for a person at a terminal (after the traceback with ``debug``):
    how every ``mlx-worker`` failure is reported, so no traceback reaches a user otherwise."""
    if debug:
        traceback.print_exception(exc)
    print(line, file=sys.stderr, flush=True)


def one_line(exc: BaseException, *, typed: bool = False) -> str:
    """The exception's message with its line breaks and runs of spaces folded (``typed``:
    after its type's name, for a failure nobody anticipated)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if typed else text
