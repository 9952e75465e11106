"""``parse_request``: how an OpenAI request body becomes a protocol job, and which bodies are
refused with a 400 that names the parameter (no Redis: the parser is pure)."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_redis_gateway.errors import ApiError
from mlx_redis_gateway.openai_api import CompletionRequest, Kind, parse_request
from mlx_redis_protocol.codec_job import MAX_SEED
from mlx_redis_protocol.limits import DEFAULT_LIMITS
from mlx_redis_protocol.messages import PROMPT_PREFIX, ChatMessage

USER_HI: Any = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER_HI, **fields}


def text(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Once upon a time", **fields}


def parse(kind: Kind, body: object, user_key: str | None = None) -> CompletionRequest:
    return parse_request(kind, body, limits=DEFAULT_LIMITS, user_key=user_key)


def refusal(kind: Kind, body: object) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(kind, body)
    error = caught.value
    assert error.status == 400
    assert error.type == "invalid_request_error"
    assert error.body()["error"]["message"] == error.message and error.message
    return error


# -- mapping --------------------------------------------------------------------------------


def test_a_chat_body_maps_every_sampling_field_onto_the_job() -> None:
    accepted = parse(
        "chat",
        chat(
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            presence_penalty=0.25,
            frequency_penalty=-0.5,
            seed=42,
            stop=["\n", "END"],
            stream=True,
            stream_options={"include_usage": True},
        ),
    )
    job = accepted.job
    assert accepted.kind == "chat" and accepted.model == "tiny" and job.model == "tiny"
    assert job.messages == (ChatMessage(role="user", content="hi"),)
    assert job.prompt is None
    assert (job.max_tokens, job.temperature, job.top_p) == (7, 0.5, 0.9)
    assert (job.presence_penalty, job.frequency_penalty) == (0.25, -0.5)
    assert job.seed == 42
    assert job.stop == ("\n", "END")
    assert job.logprobs is None and not accepted.logprobs
    assert accepted.stream and accepted.include_usage
    assert job.request_id.startswith("chatcmpl-")


def test_a_text_body_maps_its_prompt_and_gets_a_cmpl_id() -> None:
    accepted = parse("text", text(max_tokens=3))
    assert accepted.kind == "text"
    assert accepted.job.prompt == "Once upon a time" and accepted.job.messages is None
    assert accepted.job.request_id.startswith("cmpl-")
    assert not accepted.stream and not accepted.include_usage


def test_a_batch_of_one_prompt_is_that_prompt() -> None:
    accepted = parse("text", text(prompt=["only one"]))
    assert accepted.job.prompt == "only one"
    assert accepted.choices == () and accepted.request_id == accepted.job.request_id


def test_a_list_of_prompts_is_a_job_per_prompt_under_the_requests_id() -> None:
    accepted = parse("text", text(prompt=["a", "b", "c"], seed=7))
    assert accepted.request_id.startswith("cmpl-")
    assert [c.index for c in accepted.choices] == [0, 1, 2]
    assert [c.job.request_id for c in accepted.choices] == [
        f"{accepted.request_id}.{index}" for index in range(3)
    ]
    assert [c.job.prompt for c in accepted.choices] == ["a", "b", "c"]
    assert all(c.leads and c.job.seed == 7 for c in accepted.choices)
    assert all(c.job.prefix_boundary is None for c in accepted.choices)  # nothing to share
    assert accepted.job == accepted.choices[0].job


def test_n_copies_of_a_prompt_share_its_prefix_and_sample_apart() -> None:
    accepted = parse("text", text(prompt=["a", "b"], n=3, seed=MAX_SEED))
    choices = accepted.choices
    # Prompt i's copy j is choice i * n + j; its first copy leads.
    assert [(c.index, c.prompt, c.leads) for c in choices] == [
        (0, 0, True),
        (1, 0, False),
        (2, 0, False),
        (3, 1, True),
        (4, 1, False),
        (5, 1, False),
    ]
    assert [c.job.prompt for c in choices] == ["a"] * 3 + ["b"] * 3
    assert [c.job.seed for c in choices] == [MAX_SEED, 0, 1] * 2  # the client's seed, then on
    assert all(c.job.prefix_boundary == PROMPT_PREFIX for c in choices)
    chat_choices = parse("chat", chat(n=2)).choices
    assert [c.job.messages for c in chat_choices] == [(ChatMessage("user", "hi"),)] * 2
    assert chat_choices[0].job.seed != chat_choices[1].job.seed  # a random seed, then the next


def test_fields_not_given_are_left_to_the_worker() -> None:
    job = parse("chat", chat()).job
    assert job.max_tokens is None
    assert job.temperature is None and job.top_p is None
    assert job.presence_penalty is None and job.frequency_penalty is None
    assert job.stop is None and job.logprobs is None and job.metadata is None


def test_each_request_gets_its_own_id() -> None:
    assert parse("chat", chat()).job.request_id != parse("chat", chat()).job.request_id


def test_max_completion_tokens_wins_over_max_tokens_in_chat() -> None:
    assert parse("chat", chat(max_completion_tokens=5)).job.max_tokens == 5
    assert parse("chat", chat(max_tokens=9, max_completion_tokens=5)).job.max_tokens == 5
    assert parse("chat", chat(max_tokens=9)).job.max_tokens == 9


def test_completions_know_only_max_tokens() -> None:
    assert parse("text", text(max_tokens=9, max_completion_tokens=5)).job.max_tokens == 9


def test_a_stop_string_becomes_a_list_of_one() -> None:
    assert parse("chat", chat(stop="END")).job.stop == ("END",)
    assert parse("text", text(stop="END")).job.stop == ("END",)


def test_an_empty_stop_list_is_no_stop() -> None:
    assert parse("chat", chat(stop=[])).job.stop is None


def test_without_a_seed_each_job_gets_a_random_one() -> None:
    # A re-run after a worker crash then samples the same tokens as the first attempt.
    seeds = {parse("chat", chat()).job.seed for _ in range(5)}
    assert None not in seeds
    assert len(seeds) > 1
    assert all(0 <= seed <= MAX_SEED for seed in seeds if seed is not None)


def test_a_negative_seed_is_accepted_and_folded_into_64_bits() -> None:
    assert parse("chat", chat(seed=-1)).job.seed == MAX_SEED
    assert parse("chat", chat(seed=-5)).job.seed == parse("chat", chat(seed=-5)).job.seed
    assert parse("chat", chat(seed=0)).job.seed == 0


def test_user_and_the_api_key_go_into_the_job_metadata() -> None:
    assert parse("chat", chat(user="alice")).job.metadata == {"user": "alice"}
    assert parse("chat", chat(user="alice"), user_key="team-a").job.metadata == {
        "user": "alice",
        "api_key": "team-a",
    }
    assert parse("text", text(), user_key="team-a").job.metadata == {"api_key": "team-a"}


def test_the_api_keys_name_is_the_jobs_tenant() -> None:
    assert parse("chat", chat(), user_key="team-a").job.tenant == "team-a"
    assert parse("text", text(), user_key="team-b").job.tenant == "team-b"
    # Without keys (an open gateway) the job names none: the default tenant.
    assert parse("chat", chat()).job.tenant is None


def test_priority_is_an_extension_field_checked_by_the_jobs_rule() -> None:
    assert parse("chat", chat(priority=-10), user_key="team-a").job.priority == -10
    assert parse("text", text(priority=100)).job.priority == 100
    assert parse("chat", chat()).job.priority is None  # the job's default, 0
    for value in (101, -101, 1.5, "high", True):
        error = refusal("chat", chat(priority=value))
        assert error.param == "priority", (value, error.message)


def test_developer_is_the_system_role() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    job = parse("chat", chat(messages=messages)).job
    assert job.messages is not None
    assert [m.role for m in job.messages] == ["system", "system", "user", "assistant", "user"]


def test_text_parts_are_joined_into_the_content() -> None:
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a story"}]
    job = parse("chat", chat(messages=[{"role": "user", "content": parts}])).job
    assert job.messages == (ChatMessage(role="user", content="Tell me a story"),)


def test_an_assistant_turn_without_content_is_empty() -> None:
    messages = [*USER_HI, {"role": "assistant", "content": None}, *USER_HI]
    job = parse("chat", chat(messages=messages)).job
    assert job.messages is not None and job.messages[1] == ChatMessage("assistant", "")


def test_chat_logprobs_ask_the_job_for_top_alternatives() -> None:
    with_top = parse("chat", chat(logprobs=True, top_logprobs=3))
    assert with_top.logprobs and with_top.job.logprobs == 3
    sampled_only = parse("chat", chat(logprobs=True))
    assert sampled_only.logprobs and sampled_only.job.logprobs == 0
    off = parse("chat", chat(logprobs=False))
    assert not off.logprobs and off.job.logprobs is None


def test_completions_logprobs_n_asks_for_n_alternatives() -> None:
    assert parse("text", text(logprobs=2)).job.logprobs == 2
    zero = parse("text", text(logprobs=0))
    assert zero.logprobs and zero.job.logprobs == 0


def test_resumable_in_the_body_is_read() -> None:
    assert parse("chat", chat(resumable=True)).resumable is True
    assert parse("chat", chat(resumable=False)).resumable is False
    assert parse("chat", chat()).resumable is None


def test_unknown_fields_and_default_like_values_are_ignored() -> None:
    accepted = parse(
        "chat",
        chat(
            foo=1,
            n=1,
            tools=[],
            tool_choice="none",
            logit_bias={},
            response_format={"type": "text"},
            parallel_tool_calls=True,
            service_tier="auto",
        ),
    )
    assert accepted.job.messages == (ChatMessage(role="user", content="hi"),)
    assert parse("text", text(best_of=1, echo=False, suffix=None)).job.prompt


# -- refusals -------------------------------------------------------------------------------


REFUSALS: list[tuple[Kind, Any, str]] = [
    ("chat", chat(n=17), "n"),
    ("text", text(n=0), "n"),
    ("text", text(prompt=["a", "b"], n=9), "n"),
    ("text", text(prompt=["a"] * 17), "prompt"),
    ("text", text(n=2, best_of=3), "best_of"),
    ("text", text(best_of=2), "best_of"),
    ("text", text(echo=True), "echo"),
    ("text", text(suffix="and then"), "suffix"),
    ("chat", chat(temperature=3), "temperature"),
    ("chat", chat(temperature=-0.1), "temperature"),
    ("chat", chat(top_p=1.5), "top_p"),
    ("chat", chat(presence_penalty=2.5), "presence_penalty"),
    ("chat", chat(frequency_penalty=-3), "frequency_penalty"),
    ("chat", chat(max_tokens=0), "max_tokens"),
    ("chat", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("chat", chat(max_tokens="8"), "max_tokens"),
    ("chat", chat(max_tokens=DEFAULT_LIMITS.max_tokens + 1), "max_tokens"),
    (
        "chat",
        chat(max_completion_tokens=DEFAULT_LIMITS.max_tokens + 1),
        "max_completion_tokens",
    ),
    ("text", text(max_tokens=DEFAULT_LIMITS.max_tokens + 1), "max_tokens"),
    ("chat", chat(seed=1.5), "seed"),
    ("chat", chat(stream="yes"), "stream"),
    ("chat", chat(tools=[{"type": "retrieval"}]), "tools[0]"),
    ("chat", chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0]"),
    ("chat", chat(functions=[{"name": "f"}]), "functions"),
    ("chat", chat(tool_choice="required"), "tool_choice"),
    (
        "chat",
        chat(chat_template_kwargs={"enable_thinking": "no"}),
        "chat_template_kwargs.enable_thinking",
    ),
    ("chat", chat(logit_bias={"50256": -100}), "logit_bias"),
    ("chat", chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    ("chat", chat(prediction={"type": "content", "content": "x"}), "prediction"),
    ("chat", chat(response_format={"type": "xml"}), "response_format"),
    (
        "chat",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        "response_format.json_schema.schema",
    ),
    (
        "chat",
        chat(response_format={"type": "regex", "pattern": "a", "lark": "b"}),
        "response_format",
    ),
    ("chat", chat(response_format="json"), "response_format"),
    ("chat", chat(top_logprobs=2), "top_logprobs"),
    ("chat", chat(logprobs=False, top_logprobs=2), "top_logprobs"),
    ("chat", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("chat", chat(logprobs=2), "logprobs"),
    ("text", text(logprobs=6), "logprobs"),
    ("text", text(logprobs=True), "logprobs"),
    ("chat", chat(stream_options={"include_usage": True}), "stream_options"),
    ("chat", chat(stream=False, stream_options={"include_usage": True}), "stream_options"),
    ("chat", chat(stop=["a", 1]), "stop"),
    ("chat", chat(stop=[str(i) for i in range(17)]), "stop"),
    ("chat", chat(stop=""), "stop"),
    ("chat", chat(stop=["x" * 257]), "stop"),
    ("chat", chat(user=7), "user"),
    ("chat", chat(user="u" * 257), "user"),
    ("chat", chat(messages=[]), "messages"),
    ("chat", {"model": "tiny"}, "messages"),
    ("chat", chat(messages="hi"), "messages"),
    ("chat", chat(messages=["hi"]), "messages[0]"),
    ("chat", chat(messages=[{"role": "tool", "content": "42"}]), "messages[0].tool_call_id"),
    ("chat", chat(messages=[*USER_HI, {"role": "function"}]), "messages[1].role"),
    ("chat", chat(messages=[{"content": "hi"}]), "messages[0].role"),
    ("chat", chat(messages=[{"role": ["user"], "content": "hi"}]), "messages[0].role"),
    (
        "chat",
        chat(
            messages=[
                *USER_HI,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
            ]
        ),
        "messages[1].tool_calls",
    ),
    (
        "chat",
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:,"}},
                    ],
                }
            ]
        ),
        "messages[0].content[1]",  # a data: URL that is not base64
    ),
    (
        "chat",
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        "messages[0].content",
    ),
    ("chat", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("text", text(prompt=[]), "prompt"),
    ("text", text(prompt=["one", 2]), "prompt"),
    ("text", text(prompt=[1, 2, 3]), "prompt"),
    ("text", text(prompt=None), "prompt"),
    ("text", text(prompt=""), "prompt"),
    ("chat", {"messages": USER_HI}, "model"),
    ("chat", chat(model=""), "model"),
    ("chat", chat(model="no spaces allowed"), "model"),
]


@pytest.mark.parametrize(
    ("kind", "body", "param"), REFUSALS, ids=[f"{kind}-{param}" for kind, _, param in REFUSALS]
)
def test_a_value_that_cannot_be_honoured_is_a_400_naming_its_parameter(
    kind: Kind, body: dict[str, Any], param: str
) -> None:
    error = refusal(kind, body)
    assert error.param == param
    assert error.body()["error"]["param"] == param


def test_a_body_that_is_not_an_object_is_a_400() -> None:
    bodies: list[object] = [[], "hi", None, 3]
    for body in bodies:
        assert refusal("chat", body).param is None


def test_an_unknown_model_name_shape_is_model_not_found() -> None:
    assert refusal("chat", chat(model="a b")).code == "model_not_found"


def test_a_range_error_says_the_limit() -> None:
    error = refusal("chat", chat(temperature=3))
    assert "temperature" in error.message and "2" in error.message


def test_response_formats_map_onto_the_jobs() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    openai_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    cases: list[tuple[Any, Any]] = [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "json_object"}),
        (openai_schema, {"type": "json_schema", "schema": schema}),
        ({"type": "regex", "pattern": "[0-9]+"}, {"type": "regex", "pattern": "[0-9]+"}),
        ({"type": "grammar", "lark": 'start: "a"'}, {"type": "grammar", "lark": 'start: "a"'}),
    ]
    for given, expected in cases:
        job = parse("chat", chat(response_format=given)).job
        assert (dict(job.response_format) if job.response_format else None) == expected
