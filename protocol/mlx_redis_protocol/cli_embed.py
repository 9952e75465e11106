"""``mlx-worker embed``: embed texts (or token ids) with an embedding model of the fleet.

It prints one JSON object per input and line, ``{"index": i, "embedding": [...]}`` (floats,
or with ``--encoding base64`` the base64 of the little-endian float32 bytes, as OpenAI's
``encoding_format`` gives them), then the usage on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from mlx_redis_protocol.cli_output import ExitCode, json_line
from mlx_redis_protocol.client import Client
from mlx_redis_protocol.embeddings import ENCODINGS, EmbeddingFailed, embedding_job
from mlx_redis_protocol.messages import Job

ENDED_EARLY = ("abort", "expired")


def add_embed_command(subparsers: Any, connection: argparse.ArgumentParser, epilog: str) -> Any:
    embed = subparsers.add_parser(
        "embed",
        parents=[connection],
        help="embed texts with an embedding model of the fleet",
        description=__doc__,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    embed.add_argument("inputs", nargs="*", help="texts to embed (or -: one a line from stdin)")
    embed.add_argument("--model", default=None, help="the fleet's embedding model")
    embed.add_argument("--no-worker-check", action="store_true", help="queue without a check")
    embed.add_argument("--dimensions", type=int, default=None, help="shorter vectors")
    embed.add_argument(
        "--token-ids", action="store_true", help="each input is comma-separated token ids"
    )
    embed.add_argument("--encoding", choices=ENCODINGS, default="float")
    embed.add_argument("--request-id", default=None)
    embed.add_argument("--timeout", type=float, default=None, help="longest wait for an event")
    return embed


def embed_job(args: argparse.Namespace) -> Job:
    """The job the arguments ask for (``ValueError`` for a mistake in them)."""
    texts: list[str] = list(args.inputs)
    if texts == ["-"]:
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise ValueError("embed: give at least one input (or - to read them from stdin)")
    inputs: list[Any] = texts
    if args.token_ids:
        try:
            inputs = [[int(token) for token in text.split(",")] for text in texts]
        except ValueError as exc:
            raise ValueError(
                f"--token-ids: an input is not comma-separated integers: {exc}"
            ) from exc
    return embedding_job(
        inputs, model=args.model, dimensions=args.dimensions, request_id=args.request_id
    )


async def run_embed(client: Client, job: Job, args: argparse.Namespace, out: TextIO) -> int:
    assert job.input is not None
    try:
        result = await client.embed(
            list(job.input),
            model=job.model,
            dimensions=job.dimensions,
            request_id=job.request_id,
            timeout=args.timeout,
        )
    except EmbeddingFailed as exc:
        print(f"mlx-worker: {exc}", file=sys.stderr, flush=True)
        return ExitCode.ABORTED if exc.code in ENDED_EARLY else ExitCode.ERROR
    for index, vector in enumerate(result.encoded(args.encoding)):
        print(json_line({"index": index, "embedding": vector}), file=out)
    out.flush()
    print(f"prompt_tokens: {result.usage.prompt_tokens}", file=sys.stderr, flush=True)
    return ExitCode.OK
