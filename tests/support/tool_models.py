"""Model folders for tool-calling and reasoning tests: an existing fixture's weights and
tokenizer (linked, never copied or changed) under a chat template of the Qwen3 kind, which
renders tools, asks for hermes ``<tool_call>`` blocks and opens a ``<think>`` (or, with
``enable_thinking`` false, closes an empty one), of Mistral's kind (``[TOOL_CALLS]``) or of
Llama 3.1's (a JSON call)."""

from __future__ import annotations

import json
from pathlib import Path

# Our own template in the shape of Qwen3's: mlx-lm infers its tool parser (json_tools) from
# ``<tool_call>`` and ``tool_call.name``.
QWEN3_STYLE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\n"
    "For each call, return a JSON object within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n"
    "{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)


# Our own template in the shape of Mistral's (v3): mlx-lm infers its tool parser (mistral) from
# ``[TOOL_CALLS]``; like Mistral's published templates it refuses a call id that is not 9
# characters long.
MISTRAL_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{% if tools and loop.first %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]"
    "{% endif %}[INST] {{ message.content }}[/INST]"
    "{% elif message.tool_calls %}[TOOL_CALLS] ["
    "{% for call in message.tool_calls %}"
    "{% if call.id | length != 9 %}{{ raise_exception('a call id is 9 characters') }}{% endif %}"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, '
    '"id": "{{ call.id }}"}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}'
    "{% elif message.role == 'tool' %}"
    "{% if message.tool_call_id | length != 9 %}"
    "{{ raise_exception('a call id is 9 characters') }}{% endif %}"
    '[TOOL_RESULTS] {"content": {{ message.content | tojson }}, '
    '"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{% elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)


# Our own template in the shape of Llama 3.1's: tools and ``<|python_tag|>`` (which built-in
# tools' code starts with) mark it as ``llama3_json``; like Llama's it refuses a turn of more
# than one call.
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    'Answer a call as {"name": function name, "parameters": its arguments}. Functions:\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}"
    "{% if message.tool_calls | length != 1 %}{{ raise_exception('one call a turn') }}{% endif %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    '{"name": "{{ message.tool_calls[0].function.name }}", "parameters": '
    "{{ message.tool_calls[0].function.arguments | tojson }}}<|eot_id|>"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{# <|python_tag|> opens a built-in tool's code #}"
)


def with_template(source: Path, dest: Path, template: str = QWEN3_STYLE_TEMPLATE) -> Path:
    """``dest``: the model folder ``source`` with ``template`` as its chat template."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name != "tokenizer_config.json" and not (dest / item.name).exists():
            (dest / item.name).symlink_to(item)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest
