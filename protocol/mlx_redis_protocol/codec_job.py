"""Encoding and validating decoding of jobs (the entries of the job stream)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlx_redis_protocol.codec_media import (
    check_placements,
    encode_image,
    encode_parts,
    encode_video,
    read_content,
    read_images,
    read_videos,
)
from mlx_redis_protocol.codec_tools import (
    encode_tool,
    encode_tool_call,
    encode_tool_choice,
    read_message_tool_calls,
    read_tool_call_id,
    read_tool_choice,
    read_tools,
)
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.fields import FieldReader, json_like_problem
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id, new_request_id
from mlx_redis_protocol.limits import DEFAULT_LIMITS, Limits
from mlx_redis_protocol.messages import (
    PROMPT_PREFIX,
    SYSTEM_PREFIX,
    ChatMessage,
    Job,
    PrefixBoundary,
)
from mlx_redis_protocol.wire import pack, top_level_strings, unpack

PROMPT_FIELDS: Final = ("prompt", "prompt_token_ids", "messages", "input")
MAX_ROLE_LEN: Final = 64
# Seeds feed a 64-bit PRNG key.
MAX_SEED: Final = 2**64 - 1
# A job's priority (lower runs first); the fair pick script reads the same range.
MIN_PRIORITY: Final = -100
MAX_PRIORITY: Final = 100
# A job's ``speculative.method``: how drafts are made, or "off" (not even the worker default).
SPECULATIVE_METHODS: Final = ("prompt_lookup", "draft_model", "off")
MAX_DRAFT_TOKENS: Final = 16


def encode_job(job: Job) -> bytes:
    """The msgpack map stored in the job stream entry's ``job`` field (None fields omitted)."""
    fields: dict[str, Any] = {}
    for name in Job.__dataclass_fields__:
        value = getattr(job, name)
        if value is None:
            continue
        if name == "messages":
            value = [_message_fields(m) for m in value]
        elif name == "tools":
            value = [encode_tool(tool) for tool in value]
        elif name == "tool_choice":
            value = encode_tool_choice(value)
        elif name == "input" and isinstance(value, tuple):
            value = [list(item) if isinstance(item, tuple) else item for item in value]
        elif name == "images":
            value = [encode_image(image) for image in value]
        elif name == "videos":
            value = [encode_video(video) for video in value]
        elif name in ("metadata", "response_format", "speculative") and isinstance(value, Mapping):
            value = dict(value)  # anything else goes as it is, for the decoder to refuse
        elif isinstance(value, tuple):
            value = list(value)
        fields[name] = value
    return pack(fields, "job")


def _message_fields(message: ChatMessage) -> dict[str, Any]:
    content: Any = encode_parts(message) if message.parts is not None else message.content
    fields: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        fields["tool_calls"] = [encode_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        fields["name"] = message.name
    return fields


def decode_job(data: object, limits: Limits = DEFAULT_LIMITS) -> Job:
    """A validated Job. Raises only ProtocolError (with ``request_id`` once that was read).

    A job without ``request_id`` gets a fresh one (nobody can subscribe to it, but it runs).
    A job refused for any reason carries its request id when that is *readable* (see
    ``readable_request_id``), so its request can be told why.
    """
    try:
        return _decode_job(data, limits)
    except ProtocolError as exc:
        if exc.request_id is None:
            exc.request_id = readable_request_id(data)
        raise


def readable_request_id(data: object) -> str | None:
    """The job's request id if the bytes begin with a msgpack map holding a top-level
    ``request_id`` str that is a valid id, whatever else is wrong with the message."""
    request_id = top_level_strings(data, ("request_id",)).get("request_id")
    return request_id if request_id is not None and is_valid_id(request_id) else None


def _decode_job(data: object, limits: Limits) -> Job:
    reader = FieldReader(unpack(data, limits, "job"), "job", limits)
    # Errors carry the job's own id only: a refusal must not go to an id made up here.
    reader.request_id = _request_id(reader)
    prompt, prompt_token_ids, messages, inputs = _prompt(reader)
    tools = read_tools(reader)
    images = read_images(reader)
    videos = read_videos(reader, images)
    check_placements(reader, messages, images, videos)
    return Job(
        request_id=reader.request_id or new_request_id(),
        prompt=prompt,
        prompt_token_ids=prompt_token_ids,
        messages=messages,
        max_tokens=_max_tokens(reader),
        temperature=reader.number("temperature", minimum=0.0),
        top_p=reader.number("top_p", minimum=0.0, maximum=1.0),
        top_k=reader.integer("top_k", minimum=0),
        min_p=reader.number("min_p", minimum=0.0, maximum=1.0),
        repetition_penalty=reader.number("repetition_penalty", above=0.0),
        presence_penalty=reader.number("presence_penalty"),
        frequency_penalty=reader.number("frequency_penalty"),
        seed=_seed(reader),
        stop=_stop(reader),
        stop_token_ids=reader.token_ids("stop_token_ids", max_items=limits.max_stop_token_ids),
        logprobs=_logprobs(reader),
        stream_interval=reader.integer("stream_interval", minimum=1),
        prefix_boundary=_prefix_boundary(reader, prompt_token_ids, messages),
        deadline=reader.number("deadline"),
        metadata=reader.metadata("metadata"),
        model=_model(reader),
        response_format=_response_format(reader),
        tenant=_tenant(reader),
        priority=_priority(reader),
        tools=tools,
        tool_choice=read_tool_choice(reader, tools),
        parallel_tool_calls=reader.boolean("parallel_tool_calls"),
        thinking=reader.boolean("thinking"),
        speculative=_speculative(reader),
        input=inputs,
        dimensions=_dimensions(reader, inputs),
        images=images,
        videos=videos,
    )


def _request_id(reader: FieldReader) -> str | None:
    value = reader.message.get("request_id")
    if value is None:
        return None
    if not isinstance(value, str) or not is_valid_id(value):
        raise reader.error("invalid_field", "request_id", f"must be {ID_RULE}")
    return value


def _model(reader: FieldReader) -> str | None:
    value = reader.string("model")
    if value is not None and not is_valid_id(value):
        raise reader.error("invalid_field", "model", f"must be {ID_RULE}")
    return value


def _tenant(reader: FieldReader) -> str | None:
    value = reader.string("tenant")
    if value is not None and not is_valid_id(value):
        raise reader.error("invalid_field", "tenant", f"must be {ID_RULE}")
    return value


def _priority(reader: FieldReader) -> int | None:
    value = reader.integer("priority", minimum=MIN_PRIORITY)
    if value is not None and value > MAX_PRIORITY:
        raise reader.error("invalid_field", "priority", f"must be <= {MAX_PRIORITY}")
    return value


# Each response_format type and the one field it takes beside ``type``.
RESPONSE_FORMATS: Final = {
    "json_object": None,
    "json_schema": "schema",
    "regex": "pattern",
    "grammar": "lark",
}


def _response_format(reader: FieldReader) -> dict[str, Any] | None:
    value = reader.mapping("response_format")
    if value is None:
        return None
    where = FieldReader(value, f"{reader.what}.response_format", reader.limits)
    where.request_id = reader.request_id
    kind = where.required_string("type")
    if kind not in RESPONSE_FORMATS:
        raise where.error("invalid_field", "type", f"must be one of {', '.join(RESPONSE_FORMATS)}")
    field = RESPONSE_FORMATS[kind]
    # nil counts as absent, as everywhere in a job (a producer may send every field it knows).
    given = {name for name, item in value.items() if item is not None}
    extra = given - {"type", *([field] if field else [])}
    if extra:
        # key=str: msgpack map keys may be bytes as well as str, which do not compare.
        name = min(extra, key=str)
        raise where.error("invalid_field", name, f"is not a field of a {kind!r} response_format")
    if field is None:
        return {"type": kind}
    if field == "schema":
        schema = where.mapping("schema", required=True)
        problem = json_like_problem(schema, reader.limits.max_schema_depth)
        if problem is not None:
            code = "limit_exceeded" if "deeply" in problem else "invalid_field"
            raise where.error(code, "schema", problem)
        return {"type": kind, "schema": schema}
    text = where.required_string(field, non_empty=True, max_len=reader.limits.max_str_len)
    return {"type": kind, field: text}


def _speculative(reader: FieldReader) -> dict[str, Any] | None:
    value = reader.mapping("speculative")
    if value is None:
        return None
    where = FieldReader(value, f"{reader.what}.speculative", reader.limits)
    where.request_id = reader.request_id
    extra = {name for name, item in value.items() if item is not None} - {
        "method",
        "num_draft_tokens",
    }
    if extra:
        raise where.error("invalid_field", min(extra, key=str), "is not a field of speculative")
    method = where.required_string("method")
    if method not in SPECULATIVE_METHODS:
        raise where.error(
            "invalid_field", "method", f"must be one of {', '.join(SPECULATIVE_METHODS)}"
        )
    count = where.integer("num_draft_tokens", minimum=1)
    if count is not None and count > MAX_DRAFT_TOKENS:
        raise where.error("limit_exceeded", "num_draft_tokens", f"is over {MAX_DRAFT_TOKENS}")
    return {"method": method} if count is None else {"method": method, "num_draft_tokens": count}


def readable_model(data: object) -> str | None:
    """The job's ``model`` when it is readable as for ``readable_request_id``: where a
    worker forwards a job from the default stream."""
    model = top_level_strings(data, ("model",)).get("model")
    return model if model is not None and is_valid_id(model) else None


def _prompt(
    reader: FieldReader,
) -> tuple[
    str | None, tuple[int, ...] | None, tuple[ChatMessage, ...] | None, EmbeddingInput | None
]:
    present = [name for name in PROMPT_FIELDS if reader.has(name)]
    if not present:
        raise reader.error(
            "missing_field", "prompt", "(or prompt_token_ids, messages or input) is needed"
        )
    if len(present) > 1:
        raise ProtocolError(
            "conflicting_fields",
            f"job has {' and '.join(present)}; exactly one prompt kind is allowed",
            request_id=reader.request_id,
        )
    limits = reader.limits
    prompt = reader.string("prompt", non_empty=True, max_len=limits.max_str_len)
    token_ids = reader.token_ids(
        "prompt_token_ids", max_items=limits.max_prompt_tokens, min_items=1
    )
    return prompt, token_ids, _messages(reader), _input(reader)


EmbeddingInput = tuple[str | tuple[int, ...], ...]


def _input(reader: FieldReader) -> EmbeddingInput | None:
    """An embedding job's inputs: non-empty texts, or non-empty lists of token ids."""
    limits = reader.limits
    items = reader.array("input", max_items=limits.max_embedding_inputs, min_items=1)
    if items is None:
        return None
    inputs: list[str | tuple[int, ...]] = []
    for index, item in enumerate(items):
        name = f"input[{index}]"
        if isinstance(item, str):
            if not item:
                raise reader.error("invalid_field", name, "must not be empty")
            if len(item) > limits.max_str_len:
                raise reader.error("limit_exceeded", name, f"is over {limits.max_str_len} chars")
            inputs.append(item)
            continue
        if not isinstance(item, list):
            raise reader.error("invalid_field", name, "must be a string or an array of token ids")
        holder = FieldReader({name: item}, reader.what, limits)
        holder.request_id = reader.request_id
        token_ids = holder.token_ids(name, max_items=limits.max_prompt_tokens, min_items=1)
        assert token_ids is not None  # a list was given
        inputs.append(token_ids)
    return tuple(inputs)


def _dimensions(reader: FieldReader, inputs: EmbeddingInput | None) -> int | None:
    value = reader.integer("dimensions", minimum=1)
    if value is not None and inputs is None:
        raise reader.error("invalid_field", "dimensions", "is for embedding jobs (with input)")
    return value


def _messages(reader: FieldReader) -> tuple[ChatMessage, ...] | None:
    items = reader.array("messages", max_items=reader.limits.max_messages, min_items=1)
    if items is None:
        return None
    messages = []
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise reader.error("invalid_field", f"messages[{index}]", "must be a map")
        turn = FieldReader(item, f"{reader.what}.messages[{index}]", reader.limits)
        turn.request_id = reader.request_id
        role = turn.required_string("role", non_empty=True, max_len=MAX_ROLE_LEN)
        tool_calls = read_message_tool_calls(turn)
        # An assistant turn that only calls tools may leave its content out (OpenAI's null).
        if not tool_calls and not turn.has("content"):
            raise turn.error("missing_field", "content", "is required")
        content, parts = read_content(turn)
        messages.append(
            ChatMessage(
                role=role,
                content=content or "",
                tool_calls=tool_calls or None,
                tool_call_id=read_tool_call_id(turn),
                name=turn.string("name", max_len=MAX_ROLE_LEN),
                parts=parts,
            )
        )
    return tuple(messages)


def _max_tokens(reader: FieldReader) -> int | None:
    value = reader.integer("max_tokens", minimum=1)
    if value is not None and value > reader.limits.max_tokens:
        raise reader.error("limit_exceeded", "max_tokens", f"is over {reader.limits.max_tokens}")
    return value


def _seed(reader: FieldReader) -> int | None:
    value = reader.integer("seed", minimum=0)
    if value is not None and value > MAX_SEED:
        raise reader.error("invalid_field", "seed", "must fit in 64 bits")
    return value


def _stop(reader: FieldReader) -> tuple[str, ...] | None:
    items = reader.array("stop", max_items=reader.limits.max_stop)
    if items is None:
        return None
    max_len = reader.limits.max_stop_len
    for item in items:
        if not isinstance(item, str) or not item:
            raise reader.error("invalid_field", "stop", "must hold non-empty strings")
        if len(item) > max_len:
            raise reader.error("limit_exceeded", "stop", f"holds a string over {max_len} chars")
    return tuple(items)


def _prefix_boundary(
    reader: FieldReader,
    prompt_token_ids: tuple[int, ...] | None,
    messages: tuple[ChatMessage, ...] | None,
) -> PrefixBoundary | None:
    if reader.message.get("prefix_boundary") == SYSTEM_PREFIX:
        if messages is None or messages[0].role != "system":
            raise reader.error(
                "invalid_field",
                "prefix_boundary",
                '"system" needs messages that start with a system turn',
            )
        return SYSTEM_PREFIX
    if reader.message.get("prefix_boundary") == PROMPT_PREFIX:
        return PROMPT_PREFIX
    value = reader.integer("prefix_boundary", minimum=0)
    if value is not None and prompt_token_ids is not None and value > len(prompt_token_ids):
        raise reader.error(
            "invalid_field",
            "prefix_boundary",
            f"is over the prompt's {len(prompt_token_ids)} tokens",
        )
    return value


def _logprobs(reader: FieldReader) -> int | None:
    value = reader.integer("logprobs", minimum=0)
    if value is not None and value > reader.limits.max_logprobs:
        raise reader.error("limit_exceeded", "logprobs", f"is over {reader.limits.max_logprobs}")
    return value
