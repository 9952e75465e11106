"""Prompts to token ids: chat rendering and its shared-prefix boundary, and prompt checks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mlx_redis_worker.engine.prompt import (
    chat_prompt,
    encode_prompt,
    has_chat_template,
    prompt_token_ids,
)
from mlx_redis_worker.models import load_model
from tests.support.tool_models import with_template

SYSTEM = {"role": "system", "content": "You answer in one short sentence, politely."}


def _chat(*questions: str) -> list[dict[str, str]]:
    return [SYSTEM] + [{"role": "user", "content": q} for q in questions]


def test_a_chat_is_the_rendered_template_with_the_generation_prompt(smollm2_model: Any) -> None:
    _, tokenizer = smollm2_model
    messages = _chat("What is the capital of France?")
    token_ids, boundary = chat_prompt(tokenizer, messages, system_prefix=False)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert token_ids == encode_prompt(tokenizer, rendered)
    assert boundary == 0


@pytest.mark.parametrize("model", ["smollm2_model", "tiny_model"])
def test_the_boundary_is_where_the_system_turns_end(
    model: str, request: pytest.FixtureRequest
) -> None:
    _, tokenizer = request.getfixturevalue(model)
    first, boundary = chat_prompt(tokenizer, _chat("Hi there"), system_prefix=True)
    second, other = chat_prompt(tokenizer, _chat("Something else entirely?"), system_prefix=True)
    system_alone = tokenizer.apply_chat_template([SYSTEM], tokenize=False)
    system_ids = encode_prompt(tokenizer, system_alone)
    assert 0 < boundary < len(first)
    assert boundary == other  # one boundary for every chat behind the same system turn
    assert first[:boundary] == second[:boundary] == system_ids[:boundary]
    assert tokenizer.decode(first[:boundary]) in system_alone


def test_two_leading_system_turns_are_one_prefix(smollm2_model: Any) -> None:
    _, tokenizer = smollm2_model
    second_system = {"role": "system", "content": "Never use lists."}
    messages = [SYSTEM, second_system, {"role": "user", "content": "Hi"}]
    token_ids, boundary = chat_prompt(tokenizer, messages, system_prefix=True)
    _, one_boundary = chat_prompt(tokenizer, _chat("Hi"), system_prefix=True)
    prefix = tokenizer.decode(token_ids[:boundary])
    assert boundary > one_boundary
    assert "Never use lists." in prefix and "Hi" not in prefix


def test_a_model_without_a_chat_template_is_a_clear_error() -> None:
    plain = SimpleNamespace(has_chat_template=False, bos_token=None)
    with pytest.raises(ValueError) as refused:
        chat_prompt(plain, _chat("Hi"), system_prefix=True)
    assert str(refused.value) == (
        "job.messages: the model has no chat template; send a `prompt` instead "
        "(mlx-worker submit --raw)"
    )


def test_has_chat_template_asks_the_wrapper_then_the_tokenizer(tiny_model: Any) -> None:
    _, tokenizer = tiny_model
    assert has_chat_template(tokenizer)
    assert has_chat_template(SimpleNamespace(chat_template="{{ messages }}"))
    assert not has_chat_template(SimpleNamespace(chat_template=None))
    assert not has_chat_template(SimpleNamespace())
    assert not has_chat_template(SimpleNamespace(has_chat_template=False, chat_template="x"))


@pytest.mark.parametrize(
    ("prompt", "error"),
    [
        ([1, 2, 99], "token ids out of range [0, 50): [99]"),
        ([], "prompt is empty"),
        ([1, True], "prompt must be a string or a list of integer token ids"),
        ((1, 2), "prompt must be a string or a list of integer token ids"),
        (list(range(9)), "prompt has 9 tokens, over the limit of 8"),
    ],
)
def test_prompt_token_ids_refuses_what_the_engine_cannot_run(prompt: Any, error: str) -> None:
    with pytest.raises(ValueError) as refused:
        prompt_token_ids(None, prompt, vocab_size=50, max_tokens=8)
    assert str(refused.value) == error


def test_prompt_token_ids_of_text_and_of_ids(tiny_model: Any) -> None:
    _, tokenizer = tiny_model
    ids = prompt_token_ids(tokenizer, "hello world", vocab_size=1 << 20, max_tokens=100)
    assert ids == encode_prompt(tokenizer, "hello world")
    assert prompt_token_ids(tokenizer, ids, vocab_size=1 << 20, max_tokens=100) == ids


def test_a_chat_its_template_refuses_is_a_value_error_naming_why(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A template that raises (as Llama 3.1's does for two calls in one turn, or Mistral's
    for a call id it does not take) is bad input, with the template's reason, never an
    error of another kind that would not reach the sender."""
    refusing = (
        "{% if messages[0].role == 'system' %}{{ raise_exception('no system turns here') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    _, tokenizer = load_model(str(with_template(tiny_model_path, tmp_path / "strict", refusing)))
    with pytest.raises(ValueError, match="chat template refused them: no system turns here"):
        chat_prompt(tokenizer, _chat("Hi"), system_prefix=False)
    assert chat_prompt(tokenizer, _chat("Hi")[1:], system_prefix=False)[0]
