"""structlog set-up: JSON lines in production, a readable console format for humans.

Jobs bind ``request_id`` with ``structlog.contextvars.bound_contextvars`` so every line logged
while serving a job carries it. The protocol library logs through the standard library's
``logging`` (a client library imposes no logging framework on producers); its records go
through the same renderer, their ``extra`` fields as key-value pairs.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Final, Literal

import structlog

LogFormat = Literal["json", "console"]


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when a line is written: a command run in-process (a test's,
    whose stderr is swapped per test and then closed) never leaves the loggers holding a closed
    stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


_STDERR: Final = _CurrentStderr()


def configure_logging(log_format: LogFormat = "json", level: str = "INFO") -> None:
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"unknown log level {level!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    _route_standard_logging(shared, renderer, numeric_level)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=_STDERR),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )


def _route_standard_logging(
    shared: list[structlog.typing.Processor], renderer: structlog.typing.Processor, level: int
) -> None:
    """Records of the standard library's loggers (the protocol library's, redis-py's) rendered
    like structlog's own lines, on stderr, at the same level."""
    handler = logging.StreamHandler(_STDERR)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_mlxw", False)]:
        root.removeHandler(old)
    handler._mlxw = True  # type: ignore[attr-defined]  # ours, replaced when reconfigured
    root.addHandler(handler)
    root.setLevel(level)


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
