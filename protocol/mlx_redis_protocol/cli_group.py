"""``mlx-worker group list|prune``: the job groups' consumers, and removing stopped workers' ones.

Both cover every job stream: the default one and each model's (a worker is a consumer of each
group it reads).

Registered by protocol/mlx_redis_protocol/cli.py beside submit, stream and ctl, with the same
connection options and exit statuses (errors reach the user through that module's ``run``).
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from mlx_redis_protocol.cli_output import (
    ExitCode,
    admin_call,
    admin_connection,
    aligned,
    json_line,
)
from mlx_redis_protocol.group import DEFAULT_PRUNE_IDLE_SECONDS, Consumer, list_all_consumers, prune
from mlx_redis_protocol.keys import Keys

# Short: the verb runs a handful of commands and must not hang on a stalled Redis.


def add_group_command(
    subparsers: Any, connection: argparse.ArgumentParser, epilog: str | None = None
) -> argparse.ArgumentParser:
    """Register ``group list`` and ``group prune`` (``connection``: the shared options);
    returns the ``group`` parser."""
    group: argparse.ArgumentParser = subparsers.add_parser(
        "group", help="consumers of the job groups (every job stream): list, prune"
    )
    commands = group.add_subparsers(dest="group_command", required=True, metavar="COMMAND")
    formatter = argparse.RawDescriptionHelpFormatter
    listing = commands.add_parser(
        "list",
        parents=[connection],
        formatter_class=formatter,
        help=(
            "each consumer of every job stream's group: pending entries, idle seconds, "
            "whether its worker is alive"
        ),
        epilog=epilog,
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per consumer")
    pruning = commands.add_parser(
        "prune",
        parents=[connection],
        formatter_class=formatter,
        help="remove consumers of stopped workers (no pending entries, idle, no heartbeat)",
        epilog=epilog,
    )
    pruning.add_argument(
        "--idle",
        type=float,
        default=DEFAULT_PRUNE_IDLE_SECONDS,
        metavar="SECONDS",
        help=f"only consumers idle at least this long (default {DEFAULT_PRUNE_IDLE_SECONDS:g})",
    )
    pruning.add_argument("--dry-run", action="store_true", help="show, remove nothing")
    pruning.add_argument("--json", action="store_true", help="one JSON object per consumer")
    return group


async def run_group(args: argparse.Namespace, out: TextIO) -> int:
    """Execute ``group list`` or ``group prune``; Redis errors propagate to the caller."""
    keys = Keys(args.prefix)
    redis = await admin_connection(args)
    try:
        if args.group_command == "list":
            consumers = await admin_call(redis, lambda: list_all_consumers(redis, keys))
            if args.json:
                for consumer in consumers:
                    print(json_line(consumer.as_dict()), file=out)
            else:
                _table(out, consumers)
            return ExitCode.OK
        # Again whole after a failure: a consumer removed by the first try is simply gone.
        pruned = await admin_call(
            redis, lambda: prune(redis, keys, args.idle, dry_run=args.dry_run)
        )
        for entry in pruned:
            action = "would remove" if args.dry_run else "removed" if entry.removed else "kept"
            if args.json:
                print(json_line({**entry.consumer.as_dict(), "action": action}), file=out)
            else:
                note = " (it took a job meanwhile)" if action == "kept" else ""
                where = f" from {_stream_name(entry.consumer)}"
                print(f"{action} {entry.consumer.name}{where}{note}", file=out)
        return ExitCode.OK
    finally:
        await redis.aclose()


def _table(out: TextIO, consumers: list[Consumer]) -> None:
    rows = [("CONSUMER", "PENDING", "IDLE_S", "HEARTBEAT", "STREAM")] + [
        (
            c.name,
            str(c.pending),
            f"{c.idle_seconds:.0f}",
            "alive" if c.heartbeat else "none",
            _stream_name(c),
        )
        for c in consumers
    ]
    for line in aligned(rows, "lrrrl"):
        print(line, file=out)


def _stream_name(consumer: Consumer) -> str:
    return consumer.stream.stream if consumer.stream is not None else "-"
