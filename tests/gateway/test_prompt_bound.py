"""The gateway's prompt bound (what a tokens-per-minute key is charged before queueing) is at
least the tokens the worker's own rendering makes, for the fixtures' tokenizers and templates:
plain chats of every kind of text, many turns, tools (natively and by the fallback prompt),
calls and their results."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import pytest

from mlx_redis_gateway.token_meter import TOKENS_PER_IMAGE, prompt_token_bound
from mlx_redis_protocol.messages import ChatMessage, ImageInput, Job, Tool, ToolCall
from mlx_redis_worker.daemon.job_prompt import job_prompt
from mlx_redis_worker.models.loading import locate_model
from tests.support.tool_models import QWEN3_STYLE_TEMPLATE, with_template

_RANDOM = random.Random(35)
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. " * 40,
    "digits": "".join(_RANDOM.choice(string.digits) for _ in range(2000)),
    "printable": "".join(_RANDOM.choice(string.printable) for _ in range(2000)),
    "cjk": "".join(chr(_RANDOM.randint(0x4E00, 0x9FFF)) for _ in range(600)),
    "emoji": "".join(chr(_RANDOM.randint(0x1F300, 0x1F5FF)) for _ in range(500)),
    "blank lines": "\n \n" * 600,
    "empty": "",
}
WEATHER = Tool(
    name="get_weather",
    description="The weather in a city " * 5,
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
)


def jobs() -> list[Job]:
    made = [
        Job(request_id=f"r-{kind}", messages=(ChatMessage("user", text),))
        for kind, text in TEXTS.items()
    ]
    made.append(
        Job(
            request_id="r-turns",
            messages=tuple(ChatMessage(("user", "assistant")[i % 2], "ok") for i in range(40)),
        )
    )
    call = ToolCall("call_1", "get_weather", json.dumps({"city": "Paris", "days": 3}))
    made.append(
        Job(
            request_id="r-tools",
            messages=(
                ChatMessage("system", "Be brief."),
                ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "", tool_calls=(call,)),
                ChatMessage("tool", '{"sky": "clear"}', tool_call_id="call_1", name="get_weather"),
                ChatMessage("user", TEXTS["digits"][:300]),
            ),
            tools=tuple(
                Tool(name=f"f{i}", description=WEATHER.description, parameters=WEATHER.parameters)
                for i in range(12)
            ),
        )
    )
    made.append(Job(request_id="r-prompt", prompt=TEXTS["printable"]))
    return made


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    made = {name: load_tokenizer(locate_model(name)) for name in ("tiny", "smollm2")}
    qwen_style = with_template(locate_model("smollm2"), tmp_path_factory.mktemp("qwen") / "m")
    made["smollm2 (native tools)"] = load_tokenizer(Path(qwen_style))
    assert "tools" in QWEN3_STYLE_TEMPLATE
    return made


@pytest.mark.parametrize("model", ["tiny", "smollm2", "smollm2 (native tools)"])
def test_the_bound_is_at_least_the_rendered_prompts_tokens(
    tokenizers: dict[str, Any], model: str
) -> None:
    tokenizer = tokenizers[model]
    for job in jobs():
        prompt = job_prompt(job, tokenizer).prompt
        tokens = len(prompt) if isinstance(prompt, list) else len(tokenizer.encode(prompt))
        bound = prompt_token_bound(job)
        assert tokens <= bound, (job.request_id, tokens, bound)
        if job.request_id == "r-english":  # a bound, not a wild guess: English is ~4 bytes a token
            assert bound <= 5 * tokens


def test_each_image_adds_its_allowance() -> None:
    """An image's tokens are the model's to count: the bound adds an allowance per image, so
    an image flood pays at admission for more than its text (its done event settles)."""
    text = Job(request_id="r", messages=(ChatMessage(role="user", content="What is it?"),))
    pictures = tuple(ImageInput(blob=f"b{index}") for index in range(3))
    with_images = Job(request_id="r", messages=text.messages, images=pictures)
    assert prompt_token_bound(with_images) == prompt_token_bound(text) + 3 * TOKENS_PER_IMAGE
