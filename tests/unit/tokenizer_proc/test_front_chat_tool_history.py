"""Earlier tool calls in a chat: OpenAI sends ``function.arguments`` as JSON text, the models'
chat templates expect a mapping. Rendered with the tool-call parts of the Qwen2.5, Qwen3,
Llama 3.1 and Gemma 4 templates (written out here: the real files are not available offline)
and compared with transformers' ``apply_chat_template`` given mappings."""

from __future__ import annotations

import copy

import pytest

from tests.unit.front_tok import write_tokenizer_dir
from tokenizer_proc.chat_template import ChatTemplate
from tokenizer_proc.tokenizer import TextTokenizer

transformers = pytest.importorskip("transformers")

# Qwen2.5: arguments written with `| tojson` (a string would come out quoted a second time).
QWEN25 = """{%- for message in messages %}
{%- if message.role == "user" or message.role == "system" or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{%- ARGS %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
QWEN25_ARGS = "{{- tool_call.arguments | tojson }}"
# Qwen3: text arguments are printed as they are, mappings with `| tojson`.
QWEN3_ARGS = ("{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
              "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}")

# Llama 3.1: one call per turn, `"parameters": ` + arguments `| tojson`; tool results as ipython.
LLAMA31 = """{{- bos_token }}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls|length == 1 %}{{- raise_exception("Only single tool-calls are supported") }}{%- endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- '}<|eot_id|>' }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}
{%- else %}{{- message.content }}{%- endif %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

# Gemma 4: a mapping is written key:value (strings between <|"|>), a string is printed raw.
GEMMA4 = """{%- for message in messages %}
{%- if message['tool_calls'] %}
{%- for tool_call in message['tool_calls'] %}
{%- set function = tool_call['function'] %}
{{- '<|tool_call>call:' + function['name'] + '{' -}}
{%- if function['arguments'] is mapping %}
{%- for key, value in function['arguments'] | dictsort %}
{{- key + ':' + ('<|"|>' + value + '<|"|>' if value is string else value | string) -}}
{{- ',' if not loop.last -}}
{%- endfor %}
{%- elif function['arguments'] is string %}{{- function['arguments'] -}}
{%- endif %}
{{- '}<tool_call|>' -}}
{%- endfor %}
{%- else %}
{{- message['role'] + ': ' + (message['content'] or '') + '\\n' }}
{%- endif %}
{%- endfor %}"""

TEMPLATES = {
    "qwen2.5": QWEN25.replace("{%- ARGS %}", QWEN25_ARGS),
    "qwen3": QWEN25.replace("{%- ARGS %}", QWEN3_ARGS),
    "llama3.1": LLAMA31,
    "gemma4": GEMMA4,
}

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
]


def with_mapping_arguments(messages: list[dict]) -> list[dict]:
    out = copy.deepcopy(messages)
    out[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "days": 2}
    return out


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_text_arguments_render_like_mappings_in_transformers(tmp_path, name):
    tok_dir = write_tokenizer_dir(str(tmp_path), TEMPLATES[name])
    before = copy.deepcopy(HISTORY)
    ours = ChatTemplate.from_tokenizer(TextTokenizer(tok_dir)).render(HISTORY, add_generation_prompt=True)
    assert HISTORY == before  # the request's messages are not changed
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    theirs = hf.apply_chat_template(with_mapping_arguments(HISTORY), tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    if name != "gemma4":
        assert '{"city": "Paris", "days": 2}}' in ours  # an object, not a quoted string
    else:
        assert 'call:get_weather{city:<|"|>Paris<|"|>,days:2}' in ours


def test_empty_or_missing_arguments_are_an_empty_mapping(tmp_path):
    tok_dir = write_tokenizer_dir(str(tmp_path), TEMPLATES["qwen2.5"])
    template = ChatTemplate.from_tokenizer(TextTokenizer(tok_dir))
    for args in ("", None):
        messages = copy.deepcopy(HISTORY)
        messages[1]["tool_calls"][0]["function"]["arguments"] = args
        assert '"arguments": {}}' in template.render(messages)
