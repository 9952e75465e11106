"""One fully populated example of every message kind, for round trips and fuzzing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_redis_protocol.codec_control import (
    decode_command,
    decode_reply,
    encode_command,
    encode_reply,
)
from mlx_redis_protocol.codec_events import decode_event, encode_event
from mlx_redis_protocol.codec_job import decode_job, encode_job
from mlx_redis_protocol.messages import (
    ChatMessage,
    ControlCommand,
    ControlReply,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    ErrorInfo,
    Job,
    QueuedEvent,
    ResetEvent,
    TokenLogprob,
    UnknownEvent,
    Usage,
)

METADATA = {"user": "ada", "tags": ["a", "b"], "n": 3, "x": 1.5, "ok": True, "none": None}

JOBS = [
    Job(request_id="req-1", prompt="Hello"),
    Job(
        request_id="req.2:full",
        prompt="Once upon a time",
        max_tokens=128,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        seed=42,
        stop=("\n\n", "THE END"),
        stop_token_ids=(2, 7),
        logprobs=5,
        stream_interval=4,
        deadline=1_900_000_000.25,
        metadata=METADATA,
    ),
    Job(request_id="req-3", prompt_token_ids=(1, 2, 3, 4), max_tokens=1, prefix_boundary=3),
    Job(
        request_id="req-4",
        messages=(ChatMessage("system", "Be brief."), ChatMessage("user", "")),
        temperature=0.0,
        prefix_boundary="system",
    ),
    Job(
        request_id="req-5",
        prompt="A person as JSON:",
        response_format={
            "type": "json_schema",
            "schema": {"type": "object", "properties": {"age": {"type": "integer"}}},
        },
    ),
    Job(
        request_id="req-6", prompt="Digits:", response_format={"type": "regex", "pattern": "[0-9]+"}
    ),
    Job(request_id="req-7.1", prompt="Copies share me", seed=3, prefix_boundary="prompt"),
    Job(request_id="req-8", messages=(ChatMessage("user", "Count me"),), count_only=True),
]

EVENTS = [
    QueuedEvent(request_id="r", seq=0, attempt=0),
    DeltaEvent(request_id="r", seq=1, attempt=1, new_text="Hé", new_token_ids=(5, 6)),
    DeltaEvent(request_id="r", seq=2, attempt=1, new_text="", new_token_ids=()),
    DeltaEvent(
        request_id="r",
        seq=3,
        attempt=1,
        new_text="x",
        new_token_ids=(9,),
        logprobs=(TokenLogprob(9, -0.25, ((9, -0.25), (4, float("-inf")))),),
    ),
    DeltaEvent(
        request_id="r",
        seq=3,
        attempt=1,
        new_text="",
        new_token_ids=(9, 10),
        logprobs=(
            TokenLogprob(9, -0.25, ((9, -0.25), (4, -3.0)), b"\xc3", (b"\xc3", b" ok")),
            TokenLogprob(10, -0.5, (), b"\xa9", ()),
        ),
    ),
    ResetEvent(request_id="r", seq=4, attempt=2),
    DoneEvent(
        request_id="r",
        seq=5,
        attempt=2,
        finish_reason="length",
        output_text="Hé x",
        usage=Usage(10, 4, cached_tokens=8, ttft_ms=12.5, tokens_per_second=80.0, duration_ms=60),
        metadata=METADATA,
        output_valid=False,
    ),
    DoneEvent(
        request_id="r",
        seq=5,
        attempt=1,
        finish_reason="stop",
        output_text="Once",
        usage=Usage(3, 4),
        stop_sequence=" upon",
    ),
    DoneEvent(
        request_id="r",
        seq=1,
        attempt=0,
        finish_reason="expired",
        output_text="",
        usage=Usage(0, 0),
    ),
    ErrorEvent(request_id="r", seq=6, attempt=1, code="engine_error", message="boom"),
    UnknownEvent(request_id="r", seq=7, attempt=1, event_type="progress", fields={"pct": 50}),
]

COMMANDS = [
    ControlCommand(kind="ping", id="c1", reply_to="mlxw:reply:{c1}"),
    ControlCommand(kind="stats", id="c2", reply_to="mlxw:reply:{c2}"),
    ControlCommand(kind="abort", id="c3", reply_to="mlxw:reply:{c3}", request_id="req-1"),
    ControlCommand(kind="cache_save", id="c4", reply_to="x", name="warm-v1.0"),
    ControlCommand(kind="cache_load", id="c5", reply_to="x", name="warm_v1"),
    ControlCommand(kind="cache_clear", id="c6", reply_to="x"),
    ControlCommand(kind="future_kind", id="c7", reply_to="x"),
]

REPLIES = [
    ControlReply(id="c1", ok=True, worker_id="w-1"),
    ControlReply(id="c2", ok=True, worker_id="w-1", result={"running": 3, "cache": {"hits": 9}}),
    ControlReply(id="c3", ok=False, worker_id="w-2", error=ErrorInfo("not_found", "no such")),
]

# (name, samples, encoder, decoder) for every message kind.
KINDS: list[tuple[str, list[Any], Callable[[Any], bytes], Callable[..., Any]]] = [
    ("job", JOBS, encode_job, decode_job),
    ("event", EVENTS, encode_event, decode_event),
    ("command", COMMANDS, encode_command, decode_command),
    ("reply", REPLIES, encode_reply, decode_reply),
]

DECODERS = [decode_job, decode_event, decode_command, decode_reply]
