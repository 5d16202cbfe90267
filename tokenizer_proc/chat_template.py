"""Chat templates rendered the way HF ``apply_chat_template`` renders them.

Where the template comes from (first found wins, as in recent ``transformers``):
``chat_template.jinja``, then ``chat_template.json`` (``{"chat_template": ...}``), then
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: "default").

``--chat-template`` (a file or inline Jinja, ``common/jinja_env.py``) replaces all of them; a
request's own ``chat_template`` replaces that, when the server trusts request templates.

The environment (``common/jinja_env.py``) mirrors HF's. Messages with ``None`` values lose those keys (HF does the same: many
templates print a literal "None" otherwise).

Without any template we use ``FALLBACK_TEMPLATE``: one ``role: content`` line per message and,
with ``add_generation_prompt``, a trailing ``assistant:`` — plain text any base model can continue.
Rendered text is encoded with ``add_special_tokens=False`` (as HF does), so a template that
writes ``{{ bos_token }}`` gets exactly one BOS; the fallback writes BOS itself when the
tokenizer would normally add one.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any

import jinja2

from common.jinja_env import compile_template
from tokenizer_proc.tokenizer import TextTokenizer, read_json

FALLBACK_TEMPLATE = (
    "{% if add_bos %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# Marks the end of the final message for continue_final_message (HF's tag, trailing space included).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """Rendering failed (``raise_exception`` in the template, or a bad message); HTTP 400."""


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's ``chat_template`` may be a list of ``{name, template}`` dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next((t for t in named.values() if isinstance(t, str)), None)
        return chosen if isinstance(chosen, str) else None
    return None


def load_chat_template(tokenizer_dir: str, tokenizer_config: dict) -> str | None:
    jinja_path = os.path.join(tokenizer_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    from_json = _pick_template(read_json(os.path.join(tokenizer_dir, "chat_template.json")).get("chat_template"))
    if from_json is not None:
        return from_json
    return _pick_template(tokenizer_config.get("chat_template"))


def template_tool_calls(tool_calls: list) -> list:
    """An assistant turn's tool calls as chat templates expect them: OpenAI sends ``arguments``
    as JSON text, HF templates take a mapping (Qwen's writes ``arguments | tojson``, which would
    quote the text a second time; Llama 3.1's prints it as a dict). Like vLLM: text is decoded,
    empty or missing arguments are ``{}``. The caller's dicts are not changed."""
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            out.append(call)
            continue
        args = function.get("arguments")
        if args is None or (isinstance(args, str) and not args.strip()):
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                pass  # refused by chat_messages.py before rendering; kept as text otherwise
        out.append({**call, "function": {**function, "arguments": args}})
    return out


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Drop None-valued keys; flatten all-text part lists into one string.

    Flattening (parts joined by newlines, as vLLM does for "string"-format templates) lets any
    template render list content; an assistant's ``refusal`` part counts as text; other parts are
    rejected because we serve text models.
    A missing or null ``content`` (an assistant turn with tool calls) becomes "" so templates
    that print ``message['content']`` do not fail on it (vLLM does the same). Tool calls'
    arguments become mappings (``template_tool_calls``).
    """
    out = []
    for i, message in enumerate(messages):
        msg = {k: v for k, v in message.items() if v is not None}
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = template_tool_calls(msg["tool_calls"])
        _mirror_reasoning(msg)
        content = msg.setdefault("content", "")
        if isinstance(content, list):
            texts = []
            for part in content:
                key = part.get("type") if isinstance(part, dict) else None
                if key not in ("text", "refusal") or not isinstance(part.get(key), str):
                    raise ChatTemplateError(f"messages[{i}].content: only parts of type 'text' are supported")
                texts.append(part[key])  # an assistant's refusal part renders as its text (vLLM does too)
            msg["content"] = "\n".join(texts)
        out.append(msg)
    return out


def _mirror_reasoning(msg: dict) -> None:
    """An earlier answer's reasoning comes back as ``reasoning`` (vLLM's current name) or
    ``reasoning_content`` (DeepSeek's, SGLang's, and what Qwen3's templates read): give the
    template both."""
    for have, want in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
        if isinstance(msg.get(have), str) and want not in msg:
            msg[want] = msg[have]


class ChatTemplate:
    """A compiled template plus the variables HF passes besides the messages."""

    def __init__(self, source: str | None, tokenizer: TextTokenizer):
        self.is_fallback = source is None
        self.source = FALLBACK_TEMPLATE if source is None else source
        try:
            self.template = compile_template(self.source)
        except ValueError as exc:
            raise ValueError(f"chat template {exc}") from None
        self.tokenizer = tokenizer
        # HF passes special_tokens_map (strings) as template variables.
        self.base_vars: dict[str, Any] = dict(tokenizer.special_tokens)
        self.base_vars["add_bos"] = self.is_fallback and self._tokenizer_adds_bos(tokenizer)

    @staticmethod
    def _tokenizer_adds_bos(tokenizer: TextTokenizer) -> bool:
        if tokenizer.bos_id is None:
            return False
        return tokenizer.encode("", add_special_tokens=True)[:1] == [tokenizer.bos_id]

    @classmethod
    def from_tokenizer(cls, tokenizer: TextTokenizer, override: str | None = None) -> ChatTemplate:
        """``override``: --chat-template's text, which wins over the tokenizer's files."""
        source = override if override is not None else load_chat_template(tokenizer.dir, tokenizer.config)
        return cls(source, tokenizer)

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        documents: list | None = None,
        extra_vars: dict | None = None,
        continue_final_message: bool = False,
    ) -> str:
        if not messages:
            raise ChatTemplateError("messages: at least one message is required")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        normalized = normalize_messages(messages)
        if continue_final_message:
            normalized[-1]["content"] += CONTINUE_TAG  # content is a string once normalized
        variables = {**self.base_vars, **(extra_vars or {})}
        variables.update(
            messages=normalized,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
        )
        try:
            text = self.template.render(**variables)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template that trips over an odd message shape is the request's fault, not ours.
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc
        except RecursionError:  # e.g. tool call arguments nested too deeply for `tojson`
            raise ChatTemplateError("chat template error: a message is nested too deeply") from None
        except Exception as exc:  # noqa: BLE001 - template code (--chat-template, a trusted request's own):
            # whatever it raises ({{ 1/0 }}, a sandbox's range limit) is that template's error, a 400
            raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {exc}") from exc
        return cut_at_tag(text) if continue_final_message else text


def cut_at_tag(rendered: str) -> str:
    """``continue_final_message``: end the prompt where the final message's text ends, dropping
    whatever the template wrote to close that turn, so the model continues it (a prefilled answer).
    As HF does: the text was rendered with ``CONTINUE_TAG`` appended; cut at the tag, keeping the
    message's trailing whitespace only if the template kept it too."""
    loc = rendered.rfind(CONTINUE_TAG.strip())
    if loc < 0:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the "
                                "chat after applying the chat template")
    if rendered[loc:loc + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed the message: so do we


class RequestTemplates:
    """Templates that requests bring (the ``chat_template`` field), compiled once: a client
    usually sends the same one with every request. The least recently used is dropped first."""

    def __init__(self, tokenizer: TextTokenizer, size: int = 16):
        self.tokenizer, self.size = tokenizer, size
        self._compiled: OrderedDict[str, ChatTemplate] = OrderedDict()

    def get(self, source: str) -> ChatTemplate:
        """Raises ValueError (the compile error) for a template that does not compile."""
        template = self._compiled.pop(source, None) or ChatTemplate(source, self.tokenizer)
        self._compiled[source] = template
        while len(self._compiled) > self.size:
            self._compiled.popitem(last=False)
        return template
