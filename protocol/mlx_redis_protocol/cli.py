"""The ``mlx-worker`` command, whichever of the project's distributions are installed.

This distribution (``mlx-redis-protocol``) owns the script and its client verbs: submit, stream,
ctl, group and models. The others add their verbs through the entry-point group
``mlx_redis_worker.commands``: ``mlx-redis-gateway`` adds gateway and api-key,
``mlx-redis-worker`` adds run, health, model, bench and demo. A verb whose distribution is not
installed answers with one line saying which to install, so a producer's light install and a
worker host type the same command and no two distributions fight over one script.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, Final

from mlx_redis_protocol.cli_client import add_commands as add_client_commands
from mlx_redis_protocol.cli_output import ExitCode
from mlx_redis_protocol.install import install_command
from mlx_redis_protocol.logs import configure_logging, one_line, tell_operator

COMMANDS_GROUP: Final = "mlx_redis_worker.commands"
WORKER_DISTRIBUTION: Final = "mlx-redis-worker"
GATEWAY_DISTRIBUTION: Final = "mlx-redis-gateway"
# The verbs other distributions add, for the line a light install answers with.
OPTIONAL_VERBS: Final = {
    "run": WORKER_DISTRIBUTION,
    "health": WORKER_DISTRIBUTION,
    "model": WORKER_DISTRIBUTION,
    "bench": WORKER_DISTRIBUTION,
    "demo": WORKER_DISTRIBUTION,
    "gateway": GATEWAY_DISTRIBUTION,
    "api-key": GATEWAY_DISTRIBUTION,
}

Command = Callable[[argparse.Namespace], int]


class OperatorError(Exception):
    """A mistake of whoever ran the command (bad settings, a model that cannot be loaded):
    ``mlx-worker`` prints its message as one line and exits 2, with no traceback."""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: global flags, the client verbs, every installed distribution's
    verbs; each subcommand names the function that runs it (``func``)."""
    parser = argparse.ArgumentParser(
        prog="mlx-worker",
        description="Serve, submit to, follow and control LLM generation through Redis.",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default=os.environ.get("MLXW_LOG_FORMAT", "console"),
        help="log lines as JSON (production) or for humans (env MLXW_LOG_FORMAT)",
    )
    parser.add_argument(
        "--log-level", default=os.environ.get("MLXW_LOG_LEVEL", "INFO"), help="env MLXW_LOG_LEVEL"
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=os.environ.get("MLXW_DEBUG", "").lower() in ("1", "true", "yes", "on"),
        help="show the Python traceback of a failure, not only its one line (env MLXW_DEBUG=1)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_client_commands(commands)
    for entry_point in sorted(entry_points(group=COMMANDS_GROUP), key=lambda e: e.name):
        add_commands: Callable[[Any], None] = entry_point.load()
        add_commands(commands)
    for verb, distribution in OPTIONAL_VERBS.items():
        if verb not in commands.choices:
            _add_missing_verb(commands, verb, distribution)
    return parser


def _add_missing_verb(commands: Any, verb: str, distribution: str) -> None:
    """A verb of a distribution that is not installed: it takes any arguments and says what to
    install."""
    missing = commands.add_parser(
        verb,
        add_help=False,
        # No option prefix: every argument, --help included, is taken as given.
        prefix_chars="\0",
        help=f"(needs {distribution}: {install_command(distribution)})",
    )
    missing.add_argument("arguments", nargs="*", help=argparse.SUPPRESS)

    def answer(args: argparse.Namespace) -> int:
        raise OperatorError(
            f"'{verb}' comes with {distribution}, which is not installed here: "
            f"{install_command(distribution)}"
        )

    missing.set_defaults(func=answer)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. No traceback reaches the user without ``--debug``: a mistake of
    the operator's is one line and status 2, anything unexpected one line and status 1."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on usage errors and --help
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    try:
        configure_logging(args.log_format, args.log_level)
    except ValueError as exc:
        return _usage_error(args, str(exc), exc)
    try:
        command: Command = args.func
        return command(args)
    except KeyboardInterrupt:
        return 130
    except OperatorError as exc:
        return _usage_error(args, one_line(exc), exc)
    except Exception as exc:
        if args.debug:
            raise
        print(
            f"mlx-worker {args.command}: {one_line(exc, typed=True)}",
            file=sys.stderr,
            flush=True,
        )
        return 1


def _usage_error(args: argparse.Namespace, message: str, exc: BaseException) -> int:
    """One line naming the problem (after its traceback with --debug); status 2."""
    tell_operator(f"mlx-worker {args.command}: {message}", exc, debug=args.debug)
    return int(ExitCode.USAGE)


if __name__ == "__main__":
    sys.exit(main())
