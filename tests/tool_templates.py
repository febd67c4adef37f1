# ruff: noqa: E501 (the template as its model ships it)
"""A chat template that renders tools, for tests: Qwen2.5's (Hermes-style <tool_call> calls,
<tool_response> results) with its system prose shortened to fit stories260K's 512 positions,
and stories260K saved with it as a model folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.helpers import STORIES_260K

HERMES_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\nCall as <tool_call>\\n{\\"name\\": <name>, \\"arguments\\": <object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def hermes_stories_folder(folder: Path) -> Path:
    """stories260K (its weights linked) with HERMES_TEMPLATE as its chat template."""
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        shutil.copy(STORIES_260K / name, folder / name)
    (folder / "model.safetensors").symlink_to(STORIES_260K / "model.safetensors")
    config = json.loads((STORIES_260K / "tokenizer_config.json").read_text())
    config["chat_template"] = HERMES_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
