"""OpenAI request bodies → protocol jobs: what is mapped, what is refused, what is ignored.

``POST /v1/chat/completions`` and ``POST /v1/completions`` bodies are read field by field:
known fields map to the job (docs/gateway.md has the table), fields whose value we cannot
honour (``logit_bias``, ``echo``, ...) are a 400 naming the parameter, and unknown
fields are ignored, as OpenAI's own clients expect of compatible servers. Nothing here
touches Redis.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from mlx_redis_gateway.errors import ApiError, bad_request
from mlx_redis_gateway.fanout import ChoiceJob
from mlx_redis_gateway.media_parts import IMAGE_PART_TYPES, ChatImages, staged_images
from mlx_redis_gateway.request_counts import DEFAULT_COUNTS, RequestCounts, check_chat
from mlx_redis_gateway.shaping import Kind as AnswerKind
from mlx_redis_protocol.client import build_job
from mlx_redis_protocol.codec_job import MAX_SEED
from mlx_redis_protocol.codec_tools import MAX_TOOLS, TOOL_NAME_RULE, is_tool_name
from mlx_redis_protocol.errors import ProtocolError
from mlx_redis_protocol.fields import FieldReader
from mlx_redis_protocol.identifiers import ID_RULE, is_valid_id, new_request_id
from mlx_redis_protocol.limits import Limits
from mlx_redis_protocol.media_inputs import DEFAULT_INLINE_MEDIA_BYTES
from mlx_redis_protocol.messages import (
    PROMPT_PREFIX,
    ChatMessage,
    ContentPart,
    Job,
    Tool,
    ToolCall,
)

Kind = Literal["chat", "text"]

# OpenAI's roles; "developer" is its newer name for "system" (chat templates know only that).
_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# Most jobs one request may fan out to (``n`` times the prompts of a list): each is a job on the
# queue, so a request cannot flood it.
MAX_CHOICES: Final = 16
# Most top logprobs OpenAI accepts for each endpoint.
_MAX_TOP_LOGPROBS: Final = {"chat": 20, "text": 5}
# Fields with a value we cannot honour; a default-like value (the second item) passes.
_UNSUPPORTED: Final[dict[str, tuple[str, Any]]] = {
    "functions": ("functions (deprecated) are not supported: send tools", None),
    "function_call": ("function_call (deprecated) is not supported: send tool_choice", None),
    "logit_bias": ("logit_bias is not supported by this gateway", None),
    "audio": ("audio output is not supported", None),
    "prediction": ("predicted outputs are not supported", None),
    "suffix": ("suffix (insertion) is not supported", None),
}


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One accepted OpenAI request: the job to queue and how to shape the answer; with
    ``n`` > 1 or a list of prompts, the jobs of all its choices (``choices``; ``job`` is the
    first's)."""

    kind: AnswerKind
    model: str
    job: Job
    stream: bool
    include_usage: bool
    logprobs: bool  # whether the answer carries logprobs
    resumable: bool | None  # asked for in the body (None: not said; the header may say)
    choices: tuple[ChoiceJob, ...] = ()  # more than one: a fanned-out request
    fan_out_id: str | None = None  # a fanned-out request's own id (its jobs': ``{id}.{index}``)
    # Big images of the chat, moved out of its job: stored (blob id -> file) before it is
    # queued (``media_parts.MediaResolver``).
    blobs: Mapping[str, bytes] = field(default_factory=dict)

    def with_job(self, job: Job) -> CompletionRequest:
        """The request with ``job``'s images in its job and every choice's."""
        choices = tuple(replace(c, job=replace(c.job, images=job.images)) for c in self.choices)
        return replace(self, job=job, choices=choices, blobs={})

    @property
    def request_id(self) -> str:
        """The answer's id: the job's, or the fanned-out request's own."""
        return self.fan_out_id if self.fan_out_id is not None else self.job.request_id


class _BodyReader(FieldReader):
    """FieldReader whose errors name the OpenAI parameter."""

    def error(self, code: str, name: str, rule: str) -> ProtocolError:
        return _ParamError(code, name, rule)


class _ParamError(ProtocolError):
    def __init__(self, code: str, param: str, rule: str) -> None:
        super().__init__(code, f"{param} {rule}")
        self.param = param


def parse_request(
    kind: Kind,
    body: object,
    *,
    limits: Limits,
    user_key: str | None = None,
    counts: RequestCounts = DEFAULT_COUNTS,
) -> CompletionRequest:
    """The request in a decoded JSON ``body``; ApiError (400) when it cannot be honoured.

    ``user_key``: the API key's name, recorded in the job's metadata with OpenAI's ``user``.
    ``counts``: how many messages, parts and tools it may hold (checked before all else).
    """
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if kind == "chat":
        check_chat(body, counts)
    try:
        return _parse(kind, body, limits, user_key)
    except _ParamError as exc:
        raise bad_request(exc.message, param=exc.param, code=exc.code) from exc
    except ProtocolError as exc:  # the job's own checks (limits, prompt rules)
        raise bad_request(exc.message, param=_job_field_param(exc), code=exc.code) from exc


# The job's fields whose checks (in ``build_job``) can refuse a body, and the body's name of
# each (the job's errors read ``job.FIELD ...``).
_JOB_FIELD_PARAMS: Final = {
    "prompt": "prompt",
    "messages": "messages",
    "stop": "stop",
    "response_format": "response_format",
    "tools": "tools",
    "tool_choice": "tool_choice",
    "parallel_tool_calls": "parallel_tool_calls",
    "priority": "priority",
}


def _job_field_param(error: ProtocolError) -> str | None:
    field = re.match(r"job\.([a-z_]+)", error.message)
    return _JOB_FIELD_PARAMS.get(field[1]) if field is not None else None


def _parse(
    kind: Kind, body: Mapping[str, Any], limits: Limits, user_key: str | None
) -> CompletionRequest:
    reader = _BodyReader(body, "body", limits)
    model = reader.required_string("model", non_empty=True)
    if not is_valid_id(model):
        raise bad_request(f"model must be {ID_RULE}", param="model", code="model_not_found")
    n = _refuse_unsupported(reader, kind)
    stream = bool(reader.boolean("stream"))
    stream_options = reader.mapping("stream_options") or {}
    include_usage = stream_options.get("include_usage") is True
    if stream_options and not stream:
        raise bad_request("stream_options needs stream: true", param="stream_options")
    logprobs, top = _logprobs(reader, kind)
    options: dict[str, Any] = {
        "model": model,
        "max_tokens": _max_tokens(reader, kind),
        "temperature": reader.number("temperature", minimum=0.0, maximum=2.0),
        "top_p": reader.number("top_p", minimum=0.0, maximum=1.0),
        # An extension (vLLM's, and Anthropic's Messages field): 0 is off.
        "top_k": reader.integer("top_k", minimum=0),
        "presence_penalty": reader.number("presence_penalty", minimum=-2.0, maximum=2.0),
        "frequency_penalty": reader.number("frequency_penalty", minimum=-2.0, maximum=2.0),
        "seed": _seed(reader),
        "stop": _stop(reader),
        "logprobs": top if logprobs else None,
        "metadata": _metadata(reader, user_key),
        "response_format": _response_format(reader),
        # The API key's name is the tenant whose fair share of the fleet the job draws on;
        # ``priority`` (an extension, vLLM's name and order) orders that tenant's own jobs.
        "tenant": user_key,
        "priority": reader.integer("priority"),
    }
    if kind == "chat":
        options |= _tool_options(reader)
    images = ChatImages(limits)
    prompts, messages = _prompt(reader, kind, images)
    blobs: dict[str, bytes] = {}
    if images.images:
        options["images"], blobs = staged_images(images.images, DEFAULT_INLINE_MEDIA_BYTES)
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(
            f"n times the prompts is over {MAX_CHOICES} choices", param="n", code="limit_exceeded"
        )
    request_id = request_id_for(kind)
    fan_out = len(prompts) * n > 1
    if fan_out and n > 1:
        options["prefix_boundary"] = PROMPT_PREFIX  # the copies share the prompt's prefill
    jobs = [
        build_job(
            prompt=prompt,
            prompt_token_ids=None,
            messages=messages,
            request_id=f"{request_id}.{index * n}" if fan_out else request_id,
            options={name: value for name, value in options.items() if value is not None},
            limits=limits,
        )
        for index, prompt in enumerate(prompts)
    ]
    choices = tuple(
        ChoiceJob(
            index=index * n + copy,
            job=replace(
                job,
                request_id=f"{request_id}.{index * n + copy}",
                # Copies of one prompt sample apart, and repeatably so for a client's seed.
                seed=(options["seed"] + copy) % (MAX_SEED + 1),
            ),
            prompt=index,
            leads=copy == 0,
        )
        for index, job in enumerate(jobs)
        for copy in range(n)
    )
    if jobs[0].calls_tools() and jobs[0].response_format is not None:
        raise bad_request(
            "response_format cannot go with tools the model may call (tool_choice none)",
            param="response_format",
        )
    return CompletionRequest(
        kind=kind,
        model=model,
        job=choices[0].job if fan_out else jobs[0],
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        resumable=reader.boolean("resumable"),
        choices=choices if fan_out else (),
        fan_out_id=request_id if fan_out else None,
        blobs=blobs,
    )


def request_id_for(kind: Kind) -> str:
    """A fresh request id, shaped like OpenAI's response ids (it is the response's ``id``)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{new_request_id()}"


def _refuse_unsupported(reader: _BodyReader, kind: Kind) -> int:
    """Refuses what cannot be honoured; ``n``, the choices per prompt."""
    n = reader.integer("n", minimum=1) or 1
    best_of = reader.integer("best_of", minimum=1)
    if best_of is not None and best_of not in (1, n):
        raise bad_request("best_of must be 1 or n (no choice is ranked)", param="best_of")
    if reader.boolean("echo"):
        raise bad_request("echo is not supported", param="echo")
    for name, (message, allowed) in _UNSUPPORTED.items():
        value = reader.message.get(name)
        if value is not None and value != allowed and value != [] and value != {}:
            raise bad_request(message, param=name)
    return n


def _response_format(reader: _BodyReader) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as the job's: ``text`` (none), ``json_object``,
    ``json_schema`` (its ``json_schema.schema``), and this gateway's own ``regex``
    (``pattern``) and ``grammar`` (``lark``), passed as they are."""
    value = reader.mapping("response_format")
    if value is None or value.get("type", "text") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format json_schema needs json_schema.schema (an object)",
                param="response_format.json_schema.schema",
            )
        return {"type": "json_schema", "schema": schema}
    if kind in ("regex", "grammar"):
        return dict(value)
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema, "
        "regex, grammar)",
        param="response_format",
    )


def _tool_options(reader: _BodyReader) -> dict[str, Any]:
    """OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the reasoning switch
    (``chat_template_kwargs.enable_thinking``, as vLLM takes it) as the job's fields."""
    items = reader.array("tools", max_items=MAX_TOOLS) or []
    tools = [_tool(item, index) for index, item in enumerate(items)]
    template_kwargs = reader.mapping("chat_template_kwargs") or {}
    thinking = template_kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise bad_request(
            "chat_template_kwargs.enable_thinking must be a boolean",
            param="chat_template_kwargs.enable_thinking",
        )
    return {
        "tools": tools or None,
        "tool_choice": _tool_choice(reader.message.get("tool_choice")),
        "parallel_tool_calls": reader.boolean("parallel_tool_calls"),
        "thinking": thinking,
    }


def _tool(item: object, index: int) -> Tool:
    param = f"tools[{index}]"
    if not isinstance(item, dict) or item.get("type", "function") != "function":
        raise bad_request(f"{param} must be a function tool", param=param)
    function = item.get("function")
    if not isinstance(function, dict) or not is_tool_name(function.get("name")):
        raise bad_request(f"{param}.function.name must be {TOOL_NAME_RULE}", param=param)
    description = function.get("description")
    parameters = function.get("parameters")
    strict = function.get("strict")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", param=param)
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters must be an object", param=param)
    return Tool(
        name=function["name"],
        description=description,
        parameters=parameters,
        strict=strict if isinstance(strict, bool) else None,
    )


def _tool_choice(value: object) -> object:
    """``"auto"``, ``"none"``, ``"required"`` or ``{"type": "function", "function": {"name":
    …}}`` as the job takes it (the job's checks refuse anything else)."""
    if isinstance(value, dict) and isinstance(value.get("function"), dict):
        return {"name": value["function"].get("name")}
    return value


def _max_tokens(reader: _BodyReader, kind: Kind) -> int | None:
    # max_completion_tokens is chat's newer name for it; when both are given it wins.
    newer = reader.integer("max_completion_tokens", minimum=1) if kind == "chat" else None
    name = "max_completion_tokens" if newer is not None else "max_tokens"
    value = newer if newer is not None else reader.integer("max_tokens", minimum=1)
    if value is not None and value > reader.limits.max_tokens:
        raise bad_request(
            f"{name} is over {reader.limits.max_tokens}", param=name, code="limit_exceeded"
        )
    return value


def _seed(reader: _BodyReader) -> int | None:
    """The client's seed; without one, a fresh one: a job re-run after a worker crash then
    samples the same tokens, so its stream continues where it was instead of diverging."""
    seed = reader.integer("seed")
    if seed is None:
        return secrets.randbelow(2**63)
    return seed % (MAX_SEED + 1)  # OpenAI allows negative seeds; ours are 64-bit unsigned


def _stop(reader: _BodyReader) -> list[str] | None:
    value = reader.message.get("stop")
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    items = reader.array("stop", max_items=reader.limits.max_stop)
    assert items is not None  # present, checked above
    if not all(isinstance(item, str) for item in items):
        raise bad_request("stop must be a string or an array of strings", param="stop")
    return items or None


def _logprobs(reader: _BodyReader, kind: Kind) -> tuple[bool, int]:
    """Whether to return logprobs, and how many top alternatives per token."""
    most = _MAX_TOP_LOGPROBS[kind]
    if kind == "chat":
        wanted = bool(reader.boolean("logprobs"))
        top = reader.integer("top_logprobs", minimum=0)
        if top is not None and top > most:
            raise bad_request(f"top_logprobs must be <= {most}", param="top_logprobs")
        if top is not None and not wanted:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        return wanted, top or 0
    count = reader.integer("logprobs", minimum=0)
    if count is not None and count > most:
        raise bad_request(f"logprobs must be <= {most}", param="logprobs")
    return count is not None, count or 0


def _metadata(reader: _BodyReader, user_key: str | None) -> dict[str, Any] | None:
    user = reader.string("user", max_len=256)
    metadata = {"user": user, "api_key": user_key}
    kept = {name: value for name, value in metadata.items() if value is not None}
    return kept or None


def _prompt(
    reader: _BodyReader, kind: Kind, images: ChatImages
) -> tuple[list[str | None], list[ChatMessage] | None]:
    """The request's prompts (completions: a string, or a list of them, each a choice of its
    own), or its one chat."""
    if kind == "text":
        prompt = reader.message.get("prompt")
        prompts = prompt if isinstance(prompt, list) else [prompt]
        if not prompts or not all(isinstance(item, str) for item in prompts):
            raise bad_request(
                "prompt must be a string or a non-empty array of strings (token arrays are not "
                "supported)",
                param="prompt",
            )
        if len(prompts) > MAX_CHOICES:
            raise bad_request(
                f"prompt holds over {MAX_CHOICES} prompts", param="prompt", code="limit_exceeded"
            )
        return list(prompts), None
    items = reader.array("messages", required=True, max_items=reader.limits.max_messages)
    assert items is not None  # required
    if not items:
        raise bad_request("messages must not be empty", param="messages")
    return [None], [_message(item, index, images) for index, item in enumerate(items)]


def _message(item: object, index: int, images: ChatImages) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(item, dict):
        raise bad_request(f"{param} must be an object", param=param)
    raw_role = item.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise bad_request(
            f"{param}.role must be one of system, developer, user, assistant, tool",
            param=f"{param}.role",
        )
    tool_call_id = item.get("tool_call_id")
    if role == "tool" and not isinstance(tool_call_id, str):
        raise bad_request(f"{param}.tool_call_id is required", param=f"{param}.tool_call_id")
    name = item.get("name")
    content, parts = _content(item.get("content"), f"{param}.content", images, role)
    return ChatMessage(
        role=role,
        content=content,
        parts=parts,
        tool_calls=_tool_calls(item.get("tool_calls"), f"{param}.tool_calls"),
        tool_call_id=tool_call_id if role == "tool" else None,
        name=name if isinstance(name, str) and role == "tool" else None,
    )


def _tool_calls(value: object, param: str) -> tuple[ToolCall, ...] | None:
    """An assistant message's ``tool_calls`` (the job's checks then check each call)."""
    if not value:
        return None
    if not isinstance(value, list):
        raise bad_request(f"{param} must be an array", param=param)
    calls = []
    for index, item in enumerate(value):
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            raise bad_request(f"{param}[{index}] must be a function call", param=param)
        call_id, name = item.get("id"), function.get("name")
        calls.append(
            ToolCall(
                id=call_id if isinstance(call_id, str) else "",
                name=name if isinstance(name, str) else "",
                arguments=_arguments(function.get("arguments")),
            )
        )
    return tuple(calls)


def _arguments(value: object) -> str:
    """A call's arguments as JSON text (some clients send the object itself)."""
    return json.dumps(value) if isinstance(value, dict) else value if isinstance(value, str) else ""


def _content(
    content: object, param: str, images: ChatImages, role: str
) -> tuple[str, tuple[ContentPart, ...] | None]:
    """A message's text (a string, or its text parts joined) and, when it holds images (a
    user turn's ``image_url`` parts), its parts in order. Other parts are refused."""
    if isinstance(content, str):
        return content, None
    if content is None:
        return "", None
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or an array of content parts", param=param)
    parts: list[ContentPart] = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES and role == "user":
            assert isinstance(part, dict)
            parts.append(images.add(part, f"{param}[{index}]"))
            continue
        if kind != "text":
            raise bad_request(
                f"{param} may hold only text parts (and image_url parts in a user turn)",
                param=param,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{param}: a text part needs a string text", param=param)
        parts.append(ContentPart("text", text))
    text = "".join(part.text for part in parts)
    return text, tuple(parts) if any(part.type == "image" for part in parts) else None


def check_request_id(request_id: str) -> str:
    if not is_valid_id(request_id):
        raise ApiError(404, f"no request {request_id!r}", code="request_not_found")
    return request_id
