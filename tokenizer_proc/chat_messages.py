"""Chat ``messages`` checked the way the OpenAI API checks them, each error naming its field.

Per role (OpenAI's chat-completions reference):
- ``system`` / ``developer`` / ``user``: ``content`` required, a string or a non-empty array of
  parts (text parts only here: we serve text models);
- ``assistant``: ``content`` may be absent or null only when ``tool_calls`` / ``function_call``
  (or, as vLLM accepts, ``reasoning_content`` / ``reasoning``) is given; its parts may also be ``{"type": "refusal", "refusal": str}`` (rendered as text);
- ``tool``: ``content`` and ``tool_call_id`` required;
- ``function`` (deprecated): ``name`` required, ``content`` may be null.
An assistant's ``tool_calls`` items need ``function.name`` and JSON ``function.arguments``;
each of the request's ``tools`` needs ``function.name`` (``validate_tools``: vLLM's tool model).
Any other role is refused. Every failure is a 400 whose ``param`` is the path, e.g.
``messages[0].content``, never a 422. Keys we do not know pass through to the template.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizer_proc.errors import APIError, bad_request

ROLES = ("system", "assistant", "user", "function", "tool", "developer")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object"}.get(type(value), type(value).__name__)


def _missing(path: str) -> APIError:
    return bad_request(f"Missing required parameter: '{path}'.", path)


def _check_parts(parts: list, path: str, role: str) -> None:
    if not parts:
        raise bad_request(f"Invalid '{path}': empty array. Expected an array with minimum length 1.", path)
    for j, part in enumerate(parts):
        where = f"{path}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"Invalid type for '{where}': expected an object, but got {_type_name(part)} instead.",
                              where)
        kind = part.get("type")
        if kind is None:
            raise _missing(f"{where}.type")
        if not isinstance(kind, str):  # an object or array here is unhashable: it was a 500
            raise bad_request(f"Invalid type for '{where}.type': expected a string, but got {_type_name(kind)} "
                              "instead.", f"{where}.type")
        field = {"text": "text", "refusal": "refusal" if role == "assistant" else None}.get(kind)
        if field is None:
            allowed = "'text' and 'refusal'" if role == "assistant" else "'text'"
            raise bad_request(f"Invalid value for '{where}.type': only {allowed} parts are supported by this "
                              f"text model, got {kind!r}.", f"{where}.type")
        if field not in part:
            raise _missing(f"{where}.{field}")
        if not isinstance(part[field], str):
            raise bad_request(f"Invalid type for '{where}.{field}': expected a string, but got "
                              f"{_type_name(part[field])} instead.", f"{where}.{field}")


def _check_content(message: dict, role: str, path: str) -> None:
    content = message.get("content")
    # an assistant turn with reasoning and null content is what --reasoning-parser answers when the
    # block took every token: sent back as history, it renders (vLLM accepts it too)
    nullable = role == "function" or (role == "assistant" and bool(
        message.get("tool_calls") or message.get("function_call")
        or isinstance(message.get("reasoning_content"), str) or isinstance(message.get("reasoning"), str)))
    if content is None:
        if nullable:
            return
        if "content" not in message:
            raise _missing(f"{path}.content")
        raise bad_request(f"Invalid value for '{path}.content': expected a string, got null.", f"{path}.content")
    if isinstance(content, list):
        _check_parts(content, f"{path}.content", role)
    elif not isinstance(content, str):
        raise bad_request(f"Invalid type for '{path}.content': expected one of a string or array of objects, "
                          f"but got {_type_name(content)} instead.", f"{path}.content")


def _check_string(message: dict, key: str, path: str, required: bool) -> None:
    value = message.get(key)
    if value is None:
        if required:
            raise _missing(f"{path}.{key}")
        return
    if not isinstance(value, str):
        raise bad_request(f"Invalid type for '{path}.{key}': expected a string, but got {_type_name(value)} "
                          "instead.", f"{path}.{key}")


def validate_messages(messages: list) -> None:
    if not messages:
        raise bad_request("Invalid 'messages': empty array. Expected an array with minimum length 1.", "messages")
    for i, message in enumerate(messages):
        path = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"Invalid type for '{path}': expected an object, but got {_type_name(message)} "
                              "instead.", path)
        role = message.get("role")
        if role is None:
            raise _missing(f"{path}.role")
        if role not in ROLES:
            supported = ", ".join(f"'{r}'" for r in ROLES[:-1]) + f", and '{ROLES[-1]}'"
            raise bad_request(f"Invalid value: {role!r}. Supported values are: {supported}.", f"{path}.role")
        _check_content(message, role, path)
        _check_string(message, "name", path, required=role == "function")
        if role == "tool":
            _check_string(message, "tool_call_id", path, required=True)
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise bad_request(f"Invalid type for '{path}.tool_calls': expected an array, but got "
                              f"{_type_name(tool_calls)} instead.", f"{path}.tool_calls")
        for j, call in enumerate(tool_calls or ()):
            _check_tool_call(call, f"{path}.tool_calls[{j}]")


def _check_object(value: Any, path: str) -> None:
    if value is None:
        raise _missing(path)
    if not isinstance(value, dict):
        raise bad_request(f"Invalid type for '{path}': expected an object, but got {_type_name(value)} instead.", path)


def _check_tool_call(call: Any, path: str) -> None:
    """An earlier tool call: ``function.name`` a string, ``function.arguments`` JSON text (or
    an object, as some clients send it), since the chat template receives it decoded."""
    _check_object(call, path)
    function = call.get("function")
    _check_object(function, f"{path}.function")
    _check_string(function, "name", f"{path}.function", required=True)
    args = function.get("arguments")
    where = f"{path}.function.arguments"
    if args is None or isinstance(args, dict):
        return
    if not isinstance(args, str):
        raise bad_request(f"Invalid type for '{where}': expected a string, but got {_type_name(args)} instead.", where)
    if args.strip():
        try:
            json.loads(args)
        except ValueError as exc:
            raise bad_request(f"Invalid '{where}': not valid JSON ({exc}).", where) from None
        except RecursionError:
            raise bad_request(f"Invalid '{where}': not valid JSON (nested too deeply).", where) from None


def validate_tools(tools: list | None) -> None:
    """``tools`` as vLLM's request model reads them (``ChatCompletionToolsParam``): ``type``
    "function" (the default), ``function`` an object with a string ``name``, ``description`` a
    string and ``parameters`` an object when given. Each tool is already an object (protocol.py)."""
    for i, tool in enumerate(tools or ()):
        path = f"tools[{i}]"
        kind = tool.get("type", "function")
        if kind != "function":
            raise bad_request(f"Invalid value for '{path}.type': expected 'function', got {kind!r}.", f"{path}.type")
        function = tool.get("function")
        _check_object(function, f"{path}.function")
        _check_string(function, "name", f"{path}.function", required=True)
        _check_string(function, "description", f"{path}.function", required=False)
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"Invalid type for '{path}.function.parameters': expected an object, but got "
                              f"{_type_name(params)} instead.", f"{path}.function.parameters")
