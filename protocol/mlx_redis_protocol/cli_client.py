"""The ``submit``, ``stream``, ``embed``, ``ctl``, ``group`` and ``models`` commands of
``mlx-worker``.

`add_commands` registers them on the ``mlx-worker`` parser's subcommands (each with
``func=run``, see `mlx_redis_protocol.cli`) and `run` executes one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from contextlib import aclosing
from typing import Any, Final, TextIO

import redis.exceptions

from mlx_redis_protocol.catalogue import live_worker_ids
from mlx_redis_protocol.cli_embed import add_embed_command, embed_job, run_embed
from mlx_redis_protocol.cli_group import add_group_command, run_group
from mlx_redis_protocol.cli_models import add_models_command, run_models
from mlx_redis_protocol.cli_output import (
    EXIT_CODES_HELP,
    ExitCode,
    describe_reply,
    event_as_dict,
    exit_code_for,
    json_line,
    reply_as_dict,
)
from mlx_redis_protocol.client import Client, build_job
from mlx_redis_protocol.codec_events import decode_event
from mlx_redis_protocol.connection import TOPOLOGIES, redact
from mlx_redis_protocol.constants import (
    DEFAULT_CONTROL_TIMEOUT_SECONDS,
    DEFAULT_PREFIX,
    DEFAULT_REDIS_URL,
)
from mlx_redis_protocol.errors import (
    ControlTimeout,
    ProtocolError,
    RedisUnavailable,
    RequestNotFound,
    StreamRewritten,
    StreamTimeout,
)
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.media_inputs import StagedMedia, prepare_media, video_input
from mlx_redis_protocol.messages import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    Job,
    ResetEvent,
    VideoInput,
)
from mlx_redis_protocol.replay_log import read_log

CTL_COMMANDS: Final = ("stats", "ping", "abort", "cache-save", "cache-load", "cache-clear")
# Ctrl-C on submit aborts its job: how long the workers' replies are waited for, and the
# whole abort (marker and command) at most, so that the interrupted command still ends soon.
INTERRUPT_REPLY_SECONDS: Final = 1.0
INTERRUPT_ABORT_SECONDS: Final = 5.0


def add_commands(subparsers: Any) -> None:
    """Register submit, stream, ctl, group and models on an argparse ``add_subparsers()``
    object."""
    connection = connection_options()
    formatter = argparse.RawDescriptionHelpFormatter

    submit = subparsers.add_parser(
        "submit",
        parents=[connection],
        formatter_class=formatter,
        help="queue a job and stream its text",
        description=(
            "Queue a job and print its text as it arrives. The prompt goes as one user chat "
            "turn, which the worker renders with the model's chat template, so an instruct "
            "model answers it; --raw sends it as plain text for the model to continue."
        ),
        epilog=EXIT_CODES_HELP,
    )
    submit.add_argument("prompt", help="the prompt text")
    prompt_kind = submit.add_mutually_exclusive_group()
    prompt_kind.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as plain text (job field `prompt`), not as a chat turn",
    )
    prompt_kind.add_argument(
        "--system", default=None, metavar="TEXT", help="a system turn before the prompt"
    )
    submit.add_argument("--max-tokens", type=int, default=None)
    submit.add_argument("--temperature", type=float, default=None)
    submit.add_argument("--top-p", type=float, default=None)
    submit.add_argument("--seed", type=int, default=None)
    submit.add_argument("--stop", action="append", default=None, help="a stop string (repeat)")
    submit.add_argument("--request-id", default=None, help="default: a random id")
    submit.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help=(
            "the fleet's model to run it with (default: the fleet's default model); a model "
            "no live worker serves ends the request with error unknown_model"
        ),
    )
    submit.add_argument(
        "--tenant",
        default=None,
        metavar="NAME",
        help="the tenant the job is run for (fair share between tenants; default: default)",
    )
    submit.add_argument(
        "--priority",
        type=int,
        default=None,
        help="-100 to 100, lower runs first among the tenant's jobs (default 0)",
    )
    submit.add_argument(
        "--no-worker-check",
        action="store_true",
        help=(
            "queue the job even when no live worker serves its model (or, without --model, "
            "no live worker is there to take jobs naming none): an autoscaler starts one; "
            "the job waits at most the replay log's TTL"
        ),
    )
    response_format = submit.add_mutually_exclusive_group()
    response_format.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain the output to this JSON Schema (a file, or - for stdin)",
    )
    response_format.add_argument(
        "--response-format",
        default=None,
        metavar="JSON",
        help=(
            'the job\'s response_format as JSON, e.g. \'{"type": "json_object"}\' or '
            '\'{"type": "regex", "pattern": "[0-9]+"}\'; @FILE reads it from a file (@- stdin)'
        ),
    )
    submit.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="an image file for a vision-language model (repeat for several)",
    )
    submit.add_argument(
        "--video", action="append", default=None, metavar="PATH", help="a video file (repeat)"
    )
    submit.add_argument(
        "--video-fps", type=float, default=None, help="frames sampled per second (default 1)"
    )
    submit.add_argument(
        "--video-max-frames", type=int, default=None, help="at most this many frames a video"
    )
    submit.add_argument(
        "--no-stream", action="store_true", help="print the request id and exit at once"
    )
    submit.add_argument(
        "--detach",
        action="store_true",
        help=(
            "on Ctrl-C, stop following but leave the job running (follow it again with "
            "`mlx-worker stream ID`); without it, Ctrl-C aborts the job"
        ),
    )
    _output_options(submit)

    stream = subparsers.add_parser(
        "stream",
        parents=[connection],
        formatter_class=formatter,
        help="follow a submitted request",
        description="Print a request's events from the start, then live, until it ends.",
        epilog=EXIT_CODES_HELP,
    )
    stream.add_argument("request_id")
    _output_options(stream)

    ctl = subparsers.add_parser("ctl", help="control commands to workers")
    ctl_commands = ctl.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND")
    for name in CTL_COMMANDS:
        command = ctl_commands.add_parser(
            name,
            parents=[connection],
            formatter_class=formatter,
            help=f"send {name.replace('-', '_')} to the workers",
            epilog=EXIT_CODES_HELP,
        )
        if name == "abort":
            command.add_argument("request_id")
        else:
            if name in ("cache-save", "cache-load"):
                command.add_argument("name", help="cache name")
            command.add_argument("--worker-id", default=None, help="one worker, not all")
        command.add_argument(
            "--model",
            default=None,
            metavar="NAME",
            help="only workers serving this model act and answer (default: every worker)",
        )
        command.add_argument("--timeout", type=float, default=DEFAULT_CONTROL_TIMEOUT_SECONDS)
        command.add_argument("--json", action="store_true", help="one JSON object per reply")

    group = add_group_command(subparsers, connection, EXIT_CODES_HELP)
    models = add_models_command(subparsers, connection, EXIT_CODES_HELP)
    embed = add_embed_command(subparsers, connection, EXIT_CODES_HELP)
    for command in (submit, stream, embed, ctl, group, models):
        command.set_defaults(func=run)


def run(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """Execute a parsed submit / stream / ctl / group / models command; returns the exit
    status."""
    out = stdout or sys.stdout
    url = args.redis_url
    try:
        return asyncio.run(_run(args, out))
    except KeyboardInterrupt:
        return 130
    # Before the OSError clause: StreamTimeout and ControlTimeout are TimeoutErrors.
    except RequestNotFound as exc:
        return _fail(ExitCode.NOT_FOUND, str(exc))
    except (StreamTimeout, ControlTimeout) as exc:
        return _fail(ExitCode.TIMEOUT, str(exc))
    except RedisUnavailable as exc:
        return _fail(ExitCode.USAGE, str(exc))
    except redis.exceptions.AuthenticationError:
        return _fail(
            ExitCode.USAGE, f"cannot connect to Redis at {redact(url)}: authentication failed"
        )
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        return _fail(ExitCode.USAGE, f"cannot connect to Redis at {redact(url)}: {exc}")
    except redis.exceptions.ResponseError as exc:
        return _fail(ExitCode.USAGE, f"Redis at {redact(url)} refused a command: {exc}")
    except ProtocolError as exc:
        return _fail(ExitCode.USAGE, f"invalid message: {exc}")
    except ValueError as exc:
        return _fail(ExitCode.USAGE, str(exc))


async def _run(args: argparse.Namespace, out: TextIO) -> int:
    if args.command == "group":
        return await run_group(args, out)
    if args.command == "models":
        return await run_models(args, out)
    # A mistake in the job is said before Redis is asked anything.
    job, blobs = _job(args) if args.command == "submit" else (None, {})
    if args.command == "embed":
        job = embed_job(args)
    async with Client(
        args.redis_url,
        prefix=args.prefix,
        topology=args.redis_topology,
        require_worker=not getattr(args, "no_worker_check", False),
    ) as client:
        if job is not None and args.command == "embed":
            return await run_embed(client, job, args, out)
        if job is not None:
            return await _submit(client, job, blobs, args, out)
        if args.command == "stream":
            return await _follow(client, args.request_id, args, out)
        if args.command == "ctl":
            return await _control(client, args, out)
    raise ValueError(f"unknown command {args.command!r}")


def _job(args: argparse.Namespace) -> tuple[Job, dict[str, bytes]]:
    """The job the flags ask for, and the blobs (big media files) to store for it."""
    sampling = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": args.stop,
        "model": args.model,
        "tenant": args.tenant,
        "priority": args.priority,
    }
    options: Any = {name: value for name, value in sampling.items() if value is not None}
    if (response_format := _response_format(args)) is not None:
        options["response_format"] = response_format
    staged = _media(args)
    if staged is not None:
        options["images"], options["videos"] = staged.images, staged.videos
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    job = build_job(
        prompt=args.prompt if args.raw else None,
        prompt_token_ids=None,
        messages=None if args.raw else [*system, {"role": "user", "content": args.prompt}],
        request_id=args.request_id,
        options={name: value for name, value in options.items() if value is not None},
    )
    return job, staged.blobs if staged is not None else {}


def _media(args: argparse.Namespace) -> StagedMedia | None:
    """``--image`` / ``--video`` files as the job's media (big ones to blobs)."""
    if not args.image and not args.video:
        if args.video_fps is not None or args.video_max_frames is not None:
            raise ValueError("--video-fps and --video-max-frames need --video")
        return None
    videos = [
        VideoInput(data=video.data, fps=args.video_fps, max_frames=args.video_max_frames)
        for video in (video_input(path, DEFAULT_LIMITS, path) for path in args.video or ())
    ]
    return prepare_media(args.image or (), videos, DEFAULT_LIMITS)


async def _submit(
    client: Client, job: Job, blobs: dict[str, bytes], args: argparse.Namespace, out: TextIO
) -> int:
    """``blobs``: the job's big media files, stored just before it is queued. Ctrl-C while
    it is queued or followed aborts the job (``--detach``: leaves it running); the command
    then exits 130."""
    if job.model is None and not args.no_worker_check and not await _any_live_worker(client):
        # As for a job naming a model no worker serves: said at once, not by a silent wait.
        return _fail(
            ExitCode.ERROR,
            "no live worker serves the default stream (jobs naming no model): start a "
            "worker, name a model with --model, or queue it anyway with --no-worker-check",
        )
    try:
        return await _submit_and_follow(client, job, blobs, args, out)
    except asyncio.CancelledError:  # asyncio.run's answer to the first Ctrl-C
        await _interrupted(client, job, args)
        raise


async def _any_live_worker(client: Client) -> bool:
    """Whether a live worker is there to take jobs from the default stream: every worker reads
    it, whatever its heartbeat says (one that predates models, or does not decode, too)."""
    return bool(await live_worker_ids(await client.connect(), client.keys))


async def _interrupted(client: Client, job: Job, args: argparse.Namespace) -> None:
    """Abort the job the interrupted command queued (it may not be queued yet: its marker
    stops it all the same), or with ``--detach`` say how to follow it again."""
    request_id = job.request_id
    if args.detach:
        _note(f"[detached: {request_id} keeps running; follow it: mlx-worker stream {request_id}]")
        return
    try:
        await asyncio.wait_for(
            client.abort(request_id, model=job.model, timeout=INTERRUPT_REPLY_SECONDS),
            INTERRUPT_ABORT_SECONDS,
        )
    except (TimeoutError, RedisUnavailable, redis.exceptions.RedisError, OSError) as exc:
        _note(f"[interrupted: the abort of {request_id} failed ({exc}): ctl abort {request_id}]")
        return
    _note(f"[interrupted: aborted {request_id}]")


async def _submit_and_follow(
    client: Client, job: Job, blobs: dict[str, bytes], args: argparse.Namespace, out: TextIO
) -> int:
    request_id = await client.submit_job(job, blobs=blobs)
    if args.no_stream:
        print(request_id, file=out, flush=True)
        refusal = await _refusal(client, request_id) if args.model is not None else None
        if refusal is None:
            return ExitCode.OK
        _describe_end(refusal)
        return exit_code_for(refusal)
    return await _follow(client, request_id, args, out)


def _response_format(args: argparse.Namespace) -> Any:
    """The response_format the flags ask for; its shape is checked with the rest of the job."""
    if args.json_schema is not None:
        schema = _read_json(_read_text(args.json_schema), f"--json-schema {args.json_schema}")
        return {"type": "json_schema", "schema": schema}
    if args.response_format is not None:
        text: str = args.response_format
        if text.startswith("@"):
            return _read_json(_read_text(text[1:]), f"--response-format {text}")
        return _read_json(text, "--response-format")
    return None


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text: {exc}") from exc


def _read_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc}") from exc


async def _refusal(client: Client, request_id: str) -> ErrorEvent | None:
    """The error event the client wrote instead of queueing the job (its model is served by
    no live worker): the newest entry of the log, from attempt 0. None when it was queued."""
    logged = await read_log(client.redis, client.keys, request_id)
    if not logged:
        return None
    event = decode_event(logged[-1].data, client.limits)
    if isinstance(event, ErrorEvent) and event.attempt == 0:
        return event
    return None


async def _follow(client: Client, request_id: str, args: argparse.Namespace, out: TextIO) -> int:
    """Print the request's events; the exit status follows from how it ended. A history
    rewritten under the stream (Redis lost events in a failover) is followed again from the
    start, like a reset: the text printed so far is void."""
    printer = _Printer(out, args.json)
    while True:
        try:
            async with aclosing(client.stream(request_id, timeout=args.timeout)) as events:
                async for event in events:
                    printer.show(event)
                    if isinstance(event, DoneEvent | ErrorEvent):
                        return exit_code_for(event)
        except StreamRewritten as exc:
            printer.void(f"[{exc}: following it again from the start; the text above is void]")
            continue
        return _fail(ExitCode.USAGE, f"request {request_id!r}: events ended without done or error")


class _Printer:
    """Events as text (or JSON lines) on stdout; notes for the person on stderr."""

    def __init__(self, out: TextIO, as_json: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.ended_with_newline = True

    def show(self, event: Event) -> None:
        if self.as_json:
            print(json_line(event_as_dict(event)), file=self.out, flush=True)
        elif isinstance(event, DeltaEvent) and event.new_text:
            self.out.write(event.new_text)
            self.out.flush()
            self.ended_with_newline = event.new_text.endswith("\n")
        elif isinstance(event, ResetEvent):
            self.void(f"[restarted as attempt {event.attempt}: the text above is void]")
        if isinstance(event, DoneEvent | ErrorEvent) and not self.as_json:
            self._end_line()
            _describe_end(event)

    def void(self, note: str) -> None:
        self._end_line()
        _note(note)

    def _end_line(self) -> None:
        if not self.ended_with_newline:
            self.out.write("\n")
            self.out.flush()
            self.ended_with_newline = True


async def _control(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    command: str = args.ctl_command
    timeout: float = args.timeout
    worker_id = getattr(args, "worker_id", None)
    model: str | None = args.model
    if command == "abort":
        replies = await client.abort(args.request_id, model=model, timeout=timeout)
        if not replies and not args.json:
            print(f"abort marker set for {args.request_id}; no worker replied", file=out)
    elif command == "stats":
        replies = await client.stats(worker_id=worker_id, model=model, timeout=timeout)
    elif command == "ping":
        replies = await client.ping(worker_id=worker_id, model=model, timeout=timeout)
    elif command == "cache-save":
        replies = await client.cache_save(
            args.name, worker_id=worker_id, model=model, timeout=timeout
        )
    elif command == "cache-load":
        replies = await client.cache_load(
            args.name, worker_id=worker_id, model=model, timeout=timeout
        )
    else:
        replies = await client.cache_clear(worker_id=worker_id, model=model, timeout=timeout)
    # People compare workers by name; programs get the arrival order.
    shown = replies if args.json else sorted(replies, key=lambda reply: reply.worker_id)
    for reply in shown:
        line = json_line(reply_as_dict(reply)) if args.json else describe_reply(reply, command)
        print(line, file=out, flush=True)
    if replies and not replies.complete:
        # The timeout bounds the wait, whoever is slow: say how many did not answer in it.
        _note(f"{len(replies)} of {replies.expected} workers replied within {timeout:g} s")
    return ExitCode.OK if all(reply.ok for reply in replies) else ExitCode.ERROR


def connection_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument(
        "--redis-url",
        default=os.environ.get("MLXW_REDIS_URL", DEFAULT_REDIS_URL),
        # The default is not shown: it may come from the environment and hold a password.
        help=(
            "redis:// (a server or any Cluster node), rediss:// for TLS, or "
            "redis+sentinel://host:port[,host:port…]/service_name[/db] "
            f"(default: $MLXW_REDIS_URL or {DEFAULT_REDIS_URL})"
        ),
    )
    options.add_argument(
        "--redis-topology",
        choices=TOPOLOGIES,
        default=os.environ.get("MLXW_REDIS_TOPOLOGY", "auto"),
        help="what a redis:// URL names; auto asks the server (env MLXW_REDIS_TOPOLOGY)",
    )
    options.add_argument(
        "--prefix",
        default=os.environ.get("MLXW_PREFIX", DEFAULT_PREFIX),
        help=f"key prefix (default: $MLXW_PREFIX or {DEFAULT_PREFIX})",
    )
    return options


def _output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="one JSON object per event per line")
    parser.add_argument(
        "--timeout", type=float, default=None, help="give up after this many seconds without events"
    )


def _describe_end(event: DoneEvent | ErrorEvent) -> None:
    if isinstance(event, ErrorEvent):
        _note(f"error ({event.code}): {event.message}")
    elif event.finish_reason in ("abort", "expired"):
        _note(f"[{event.finish_reason}]")
    if isinstance(event, DoneEvent) and event.output_valid is False:
        _note("[the output does not match the response format: it was cut short]")


def _note(text: str) -> None:
    """Messages for the person at the terminal go to stderr, keeping stdout the pure text."""
    print(text, file=sys.stderr, flush=True)


def _fail(code: ExitCode, message: str) -> int:
    print(f"mlx-worker: {message}", file=sys.stderr, flush=True)
    return code
