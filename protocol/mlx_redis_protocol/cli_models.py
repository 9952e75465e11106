"""``mlx-worker models``: the fleet's catalogue, one row per model, then the default stream.

Registered by protocol/mlx_redis_protocol/cli.py beside submit, stream, ctl and group, with the
same connection options and exit statuses (errors reach the user through that module's ``run``).
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from mlx_redis_protocol.catalogue import (
    DefaultStreamStatus,
    Fleet,
    ModelStatus,
    QueueStatus,
    fleet_models,
)
from mlx_redis_protocol.cli_output import (
    ExitCode,
    admin_call,
    admin_connection,
    aligned,
    duration,
    json_line,
)
from mlx_redis_protocol.keys import Keys

# Short: the verb runs a handful of commands and must not hang on a stalled Redis.
_HEADER = (
    "MODEL",
    "WORKERS",
    "FREE/MAX",
    "MEDIA",
    "QUEUED",
    "LAG",
    "PENDING",
    "OLDEST",
    "DEAD",
)


def add_models_command(
    subparsers: Any, connection: argparse.ArgumentParser, epilog: str | None = None
) -> argparse.ArgumentParser:
    """Register ``models`` (``connection``: the shared options); returns its parser."""
    models: argparse.ArgumentParser = subparsers.add_parser(
        "models",
        parents=[connection],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="the fleet's models: workers, free slots, queues",
        description=(
            "One row per model that a live worker serves or that has a job stream:\n"
            "  WORKERS   its live workers\n"
            "  FREE/MAX  their free and total slots\n"
            "  MEDIA     what its jobs may carry besides text (image, video; - for text only)\n"
            "  QUEUED    entries in its stream (waiting and pending)\n"
            "  LAG       entries not yet delivered to a worker (- when Redis cannot tell)\n"
            "  PENDING   entries delivered and not yet acknowledged\n"
            "  OLDEST    age of the oldest pending entry\n"
            "  DEAD      its dead letters\n"
            "Then the default stream (jobs naming no model) and the models workers forward "
            "it to."
        ),
        epilog=epilog,
    )
    models.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per model per line, then one for the default stream",
    )
    return models


async def run_models(args: argparse.Namespace, out: TextIO) -> int:
    """Execute ``models``; Redis errors propagate to the caller."""
    redis = await admin_connection(args)
    try:
        keys = Keys(args.prefix)
        fleet = await admin_call(redis, lambda: fleet_models(redis, keys))
    finally:
        await redis.aclose()
    if args.json:
        for model in fleet.models:
            print(json_line(model.as_dict()), file=out)
        print(json_line(fleet.default.as_dict()), file=out)
    else:
        for line in describe_fleet(fleet):
            print(line, file=out)
    return ExitCode.OK


def describe_fleet(fleet: Fleet) -> list[str]:
    """The catalogue for people: an aligned table of the models, the default stream's line,
    and a warning line for each thing an operator should fix."""
    lines = []
    if fleet.models:
        rows = [_HEADER] + [
            (
                model.model,
                str(len(model.workers)),
                f"{model.free_slots}/{model.max_concurrency}",
                ",".join(model.media) or "-",
                *_queue_cells(model.queue),
            )
            for model in fleet.models
        ]
        lines += aligned(rows, "lrrlrrrrr")
        lines += [_tenants_line(model) for model in fleet.models if model.tenants]
    else:
        lines.append("no live worker serves a model, and no model has a job stream")
    lines.append(_default_line(fleet.default))
    return lines + _warnings(fleet.default)


# Tenants named per model on the fair-share line (the JSON lines carry them all).
TENANTS_SHOWN = 5


def _tenants_line(model: ModelStatus) -> str:
    """Fair share of a model: each tenant's jobs waiting and tokens served in 10 minutes."""
    shown = [
        f"{share.tenant} {share.queued} queued, {share.served_tokens} tokens"
        for share in model.tenants[:TENANTS_SHOWN]
    ]
    more = len(model.tenants) - TENANTS_SHOWN
    if more > 0:
        shown.append(f"{more} more")
    return f"{model.model} tenants (last 10 min): " + "; ".join(shown)


def _queue_cells(queue: QueueStatus) -> tuple[str, ...]:
    oldest = queue.oldest_pending_seconds
    return (
        str(queue.length),
        str(queue.lag) if queue.lag is not None else "-",
        str(queue.pending),
        duration(oldest) if oldest is not None else "-",
        str(queue.dead_letters),
    )


def _default_line(default: DefaultStreamStatus) -> str:
    queued, lag, pending, oldest, dead = _queue_cells(default.queue)
    if default.default_models:
        targets = ", ".join(
            f"{model} ({_workers(count)})" for model, count in default.default_models.items()
        )
    else:
        targets = "no live worker"
    return (
        f"default stream {default.queue.stream}: {queued} queued, lag {lag}, {pending} pending, "
        f"oldest {oldest}, {dead} dead; forwarded to {targets}"
    )


def _warnings(default: DefaultStreamStatus) -> list[str]:
    warnings = []
    if default.disagreement:
        warnings.append(
            "warning: live workers forward jobs naming no model to different models; give "
            "every worker the same --default-model"
        )
    if default.old_workers:
        warnings.append(
            f"warning: {_workers(len(default.old_workers))} of an older version "
            f"({', '.join(default.old_workers)}) run jobs of {default.queue.stream} with their "
            "own model, whatever model the job names: keep them out of a fleet of several models"
        )
    return warnings


def _workers(count: int) -> str:
    return f"{count} worker" if count == 1 else f"{count} workers"
