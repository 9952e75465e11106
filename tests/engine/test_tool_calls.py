"""Tool calls and reasoning, model side: the splitter that reads a streamed output into
content, reasoning and call pieces (whatever the chunking), the grammars that admit only a
model's own call syntax with valid arguments, and the prompts jobs with tools render to."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_protocol.messages import ChatMessage, Job, Tool, ToolCall, ToolChoice
from mlx_redis_worker.daemon.job_prompt import job_prompt
from mlx_redis_worker.engine.output_parser import OutputParser, Split
from mlx_redis_worker.engine.tool_calls import (
    FALLBACK,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Markers,
    ToolSyntax,
    closed,
    tool_grammar,
    tool_syntax,
)
from mlx_redis_worker.models import load_model
from tests.support.tool_models import (
    LLAMA3_STYLE_TEMPLATE,
    MISTRAL_STYLE_TEMPLATE,
    with_template,
)

THINK = ("<think>", "</think>")
LIGHT = '{"name": "set_light", "arguments": {"room": "hall \\"B\\"", "on": true}}'
HEAT = '{"name": "set_heat", "arguments": {"level": 3, "zones": [1, {"z": "}"}]}}'


def _split(text: str, seed: int, **parser: Any) -> tuple[OutputParser, Split]:
    """``text`` fed in random pieces of 1 to 5 characters, then finished."""
    rng = random.Random(seed)
    splitter = OutputParser(**parser)
    total = Split()
    at = 0
    while at < len(text):
        size = rng.randint(1, 5)
        total.add(splitter.feed(text[at : at + size]))
        at += size
    total.add(splitter.finish())
    return splitter, total


def _joined(split: Split) -> list[tuple[str | None, str]]:
    calls: dict[int, list[Any]] = {}
    for piece in split.tool_calls:
        call = calls.setdefault(piece.index, [None, ""])
        call[0] = call[0] or piece.name
        call[1] += piece.arguments
    return [(name, arguments) for name, arguments in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize(
    ("syntax", "text", "content"),
    [
        (
            FALLBACK,
            f"Sure. <tool_call>\n{LIGHT}\n</tool_call>\n<tool_call>\n{HEAT}\n</tool_call>",
            "Sure. ",
        ),
        (MISTRAL, f"[TOOL_CALLS][{LIGHT}, {HEAT}]", ""),
        (LLAMA3_JSON, LIGHT.replace('"arguments"', '"parameters"'), ""),
    ],
    ids=["hermes", "mistral", "llama3_json"],
)
def test_calls_stream_as_pieces_that_join_to_their_arguments(
    syntax: ToolSyntax, text: str, content: str, seed: int
) -> None:
    splitter, split = _split(text, seed, syntax=syntax)
    assert split.content == splitter.content == content
    expected = [json.loads(LIGHT), json.loads(HEAT)]
    if syntax is LLAMA3_JSON:
        expected = expected[:1]
    assert [(call.name, json.loads(call.arguments)) for call in splitter.calls] == [
        (item["name"], item["arguments"]) for item in expected
    ]
    assert _joined(split) == [(call.name, call.arguments) for call in splitter.calls]
    first_pieces = [piece for piece in split.tool_calls if piece.id is not None]
    assert [piece.id for piece in first_pieces] == [call.id for call in splitter.calls]


@pytest.mark.parametrize("seed", range(4))
def test_a_thought_streams_apart_from_the_answer(seed: int) -> None:
    _, split = _split("<think>\nHm, <b>.\n</think>\n\nThe answer.", seed, thought=THINK)
    assert (split.reasoning, split.content) == ("\nHm, <b>.\n", "The answer.")
    opened, split = _split(
        "Hm.</think>\n\n<tool_call>\n" + LIGHT + "\n</tool_call>",
        seed,
        thought=THINK,
        thought_open=True,
        syntax=HERMES,
    )
    assert (split.reasoning, split.content) == ("Hm.", "")
    assert [call.name for call in opened.calls] == ["set_light"]
    _, split = _split("No thought, < and <think", seed, thought=THINK)
    assert (split.reasoning, split.content) == ("", "No thought, < and <think")


def test_text_that_is_no_call_stays_the_answer() -> None:
    """A marker prefix held back comes out at the end; a region that is no call object is
    content, markers and all; a call cut short makes no call."""
    _, split = _split("Look: <tool_ca", 1, syntax=HERMES)
    assert split.content == "Look: <tool_ca"
    _, split = _split("<tool_call>\nnot json</tool_call> ok", 1, syntax=HERMES)
    assert split.content == "<tool_call>\nnot json</tool_call>ok" and not split.tool_calls
    cut, split = _split('<tool_call>\n{"name": "f", "arguments": {"a": 1', 1, syntax=HERMES)
    assert not cut.calls and _joined(split) == [("f", '{"a": 1')]
    other, split = _split(
        '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', 1, syntax=HERMES
    )
    assert [(c.name, c.arguments) for c in other.calls] == [("f", '{"a": 1}')]
    assert _joined(split) == [("f", '{"a": 1}')]


TOOLS = (
    Tool(
        name="set_light",
        parameters={
            "type": "object",
            "properties": {"room": {"type": "string"}, "on": {"type": "boolean"}},
            "required": ["room", "on"],
        },
    ),
    Tool(
        name="set_heat",
        parameters={
            "type": "object",
            "properties": {"level": {"type": "integer"}, "zones": {"type": "array"}},
            "required": ["level"],
        },
    ),
)


def _accepts(tokenizer: Any, grammar: str, text: str) -> bool:
    import llguidance.hf
    from llguidance import LLMatcher

    lexicon = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=4096)
    matcher = LLMatcher(lexicon, LLMatcher.grammar_from_lark(grammar))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and bool(matcher.is_accepting())


def test_grammars_admit_only_the_syntax_with_valid_arguments(tiny_model: Any) -> None:
    tokenizer = tiny_model[1]
    markers = Markers.of(tokenizer)
    light, heat = (f"<tool_call>\n{c}\n</tool_call>" for c in (LIGHT, HEAT))
    bad = '<tool_call>\n{"name": "set_heat", "arguments": {"level": "3"}}\n</tool_call>'
    cases = {
        (ToolChoice("required"), True): {
            light: True,
            f"{light}\n{heat}": True,
            f"{light}\n{heat}\n": True,  # a line break after the last call ends it too
            f"{light}\n\n": False,
            "Hi": False,
            bad: False,
        },
        (ToolChoice("required"), False): {
            light: True,
            f"{light}\n": True,
            f"{light}\n{heat}": False,
        },
        (ToolChoice("function", "set_heat"), True): {heat: True, light: False},
        (None, True): {
            "Hi there": True,
            f"Sure. {light}": True,
            f"Sure. {light}\n": True,
            f"So {bad}": False,
        },
    }
    for (choice, parallel), texts in cases.items():
        grammar = tool_grammar(FALLBACK, TOOLS, choice, parallel=parallel, markers=markers)
        for text, accepted in texts.items():
            assert _accepts(tokenizer, grammar, text) is accepted, (choice, parallel, text)
    thinking = tool_grammar(
        FALLBACK,
        TOOLS,
        ToolChoice("required"),
        parallel=True,
        markers=markers,
        thought=THINK,
        thought_open=True,
    )
    assert _accepts(tokenizer, thinking, f"Hmm.</think>\n\n{light}")
    assert not _accepts(tokenizer, thinking, "Hmm.</think>\n\nHi")
    array = tool_grammar(MISTRAL, TOOLS, ToolChoice("required"), parallel=False, markers=markers)
    assert _accepts(tokenizer, array, f"[TOOL_CALLS][{LIGHT}]")
    assert _accepts(tokenizer, array, f"[TOOL_CALLS] [{LIGHT}]")  # v3's blank, Tekken's none
    assert not _accepts(tokenizer, array, f"[TOOL_CALLS][{LIGHT}, {HEAT}]")


def test_jobs_render_tools_natively_or_by_the_fallback(
    tiny_model: Any, tiny_model_path: Path, tmp_path: Path
) -> None:
    """The tiny model's ChatML template knows no tools: the fallback system turn describes
    them and earlier calls are written as it asks; a Qwen3-style template renders them
    itself, opens a thought, and closes it empty when thinking is off."""
    history = (
        ChatMessage("user", "Hall light on"),
        ChatMessage(
            "assistant",
            "",
            tool_calls=(ToolCall("c1", "set_light", '{"room": "hall", "on": true}'),),
        ),
        ChatMessage("tool", "done", tool_call_id="c1"),
    )
    job = Job(request_id="r", messages=history, tools=TOOLS, tool_choice=ToolChoice("required"))
    plain = tiny_model[1]
    assert tool_syntax(plain) is FALLBACK
    prompt = job_prompt(job, plain)
    text = plain.decode(prompt.prompt)
    assert "You can call functions" in text and '"name": "set_heat"' in text
    assert '<tool_call>\n{"name": "set_light", "arguments": {"room": "hall", "on": true}}' in text
    assert "<tool_response>\ndone\n</tool_response>" in text
    assert prompt.response_format is not None and prompt.parser is not None
    assert prompt.parser.thought is None

    _, native = load_model(str(with_template(tiny_model_path, tmp_path / "qwen3-style")))
    assert tool_syntax(native) is HERMES
    thinking = job_prompt(job, native)
    text = native.decode(thinking.prompt)
    assert "You can call functions" not in text and "<tools>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert thinking.parser is not None and thinking.parser.thought == THINK
    assert thinking.response_format is not None and "think" in (thinking.response_format.lark or "")
    off = job_prompt(Job(request_id="r", messages=history, thinking=False), native)
    assert native.decode(off.prompt).endswith("<think>\n\n</think>\n\n")
    assert off.parser is None and off.response_format is None  # nothing to split


def test_tools_beside_a_response_format_are_refused(tiny_model: Any) -> None:
    job = Job(
        request_id="r",
        messages=(ChatMessage("user", "x"),),
        tools=TOOLS,
        response_format={"type": "json_object"},
    )
    with pytest.raises(ValueError, match="response_format"):
        job_prompt(job, tiny_model[1])
    none = Job(
        request_id="r",
        messages=(ChatMessage("user", "x"),),
        tools=TOOLS,
        tool_choice=ToolChoice("none"),
        response_format={"type": "json_object"},
    )
    assert job_prompt(none, tiny_model[1]).parser is None


def test_objects_that_say_nothing_of_other_keys_are_closed_to_them() -> None:
    """A call's arguments get no keys of the model's own (every such call still validates);
    what a schema says, and its const and enum values, stay as they are."""
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "c": {"type": "array", "items": {"properties": {}}},
            "d": {"const": {"properties": {}}},
        },
        "$defs": {"e": {"type": "object", "properties": {}, "additionalProperties": True}},
    }
    assert closed(schema) == {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "integer"}},
                "additionalProperties": False,
            },
            "c": {"type": "array", "items": {"properties": {}, "additionalProperties": False}},
            "d": {"const": {"properties": {}}},
        },
        "$defs": {"e": {"type": "object", "properties": {}, "additionalProperties": True}},
        "additionalProperties": False,
    }


def test_a_mistral_template_gets_call_ids_it_accepts(tiny_model_path: Path, tmp_path: Path) -> None:
    """Mistral's templates refuse a call id that is not 9 letters and digits (ours are
    longer, and clients send their own): the history is rendered with stable ids of that
    shape, the same for a call and its result; an id of that shape stays as it is."""
    folder = with_template(tiny_model_path, tmp_path / "mistral-style", MISTRAL_STYLE_TEMPLATE)
    _, tokenizer = load_model(str(folder))
    assert tool_syntax(tokenizer) is MISTRAL
    for call_id, expected in (("call_0123456789abcdef01234567", None), ("Ab3dE6g8Z", "Ab3dE6g8Z")):
        history = (
            ChatMessage("user", "Hall light on"),
            ChatMessage(
                "assistant", "", tool_calls=(ToolCall(call_id, "set_light", '{"on": true}'),)
            ),
            ChatMessage("tool", "done", tool_call_id=call_id),
        )
        job = Job(request_id="r", messages=history, tools=TOOLS, tool_choice=ToolChoice("required"))
        text = tokenizer.decode(job_prompt(job, tokenizer).prompt)
        ids = re.findall(r'"(?:call_)?id": "([^"]*)"', text)
        assert len(ids) == 2 and ids[0] == ids[1], text
        assert len(ids[0]) == 9 and ids[0].isalnum() and ids[0] == (expected or ids[0])


def test_a_llama_template_gets_one_call_a_turn_each_followed_by_its_result(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Llama 3.1's template refuses an assistant turn of several calls: such a turn is
    rendered as one turn a call, each followed by its own result (whatever order the
    results came in)."""
    folder = with_template(tiny_model_path, tmp_path / "llama-style", LLAMA3_STYLE_TEMPLATE)
    _, tokenizer = load_model(str(folder))
    assert tool_syntax(tokenizer) is LLAMA3_JSON
    calls = (
        ToolCall("c1", "set_light", '{"on": true}'),
        ToolCall("c2", "set_heat", '{"level": 2}'),
    )
    history = (
        ChatMessage("user", "Light on, heat to 2"),
        ChatMessage("assistant", "Both.", tool_calls=calls),
        ChatMessage("tool", "heat set", tool_call_id="c2"),
        ChatMessage("tool", "light on", tool_call_id="c1"),
    )
    job = Job(request_id="r", messages=history, tools=TOOLS, tool_choice=ToolChoice("required"))
    text = tokenizer.decode(job_prompt(job, tokenizer).prompt)
    light, heat = ('"name": "set_light", "parameters"', '"name": "set_heat", "parameters"')
    order = [text.index(piece) for piece in (light, "light on", heat, "heat set")]
    assert order == sorted(order), text
