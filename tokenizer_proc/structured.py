"""Structured output: every spelling of a constraint on the generated text, turned into the one
``GrammarSpec`` the worker compiles (``SamplingParams.grammar``, proto/messages.py).

Spellings, in the order they are read (at most one per request: a second is a 400 naming it):
- OpenAI ``response_format``: ``text`` (none), ``json_object`` (``{"type": "object"}``),
  ``json_schema`` (``json_schema.schema``; missing: any object, as vLLM; SGLang's spelling with
  the schema at ``response_format.schema`` too); ``structural_tag`` (xgrammar's ``format`` object,
  or the older ``structures`` + ``triggers``, as vLLM and SGLang take it);
- vLLM's ``structured_outputs``: ``json`` (a schema, or its text), ``regex``, ``choice`` (a list
  of strings), ``grammar`` (GBNF/EBNF), ``json_object: true``; ``structural_tag`` (the tag's JSON
  text). Its options (``disable_any_whitespace``: JSON fixed separators) bind the constraint
  whichever field carries it (``with_options``);
- vLLM's older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- SGLang's top-level ``json_schema`` (schema text), ``regex``, ``ebnf``, and the same three in
  ``/generate``'s ``sampling_params`` (params named ``sampling_params.<field>``), where
  ``structural_tag`` (JSON text) is read too.
A chat request's forced ``tool_choice`` is one more constraint (tool_choice.py), read last.

Checked here with the standard library only (the front never imports xgrammar): a schema parses
as JSON and is an object or a boolean; a choice list has at least one string; a regex or grammar
is a non-empty string; a structural tag is an object with a ``format`` object, or non-empty
``structures`` (each a string ``begin`` and ``end`` around a schema) and ``triggers``. Whether a
regex, grammar or schema compiles is the worker's to say: its error comes back as a 400 before
any token. Schemas are re-serialised (``json.dumps``), so the worker sees one canonical text per
schema.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import msgspec

from proto.messages import GrammarSpec
from tokenizer_proc.errors import APIError, bad_request

JSON_OBJECT = '{"type": "object"}'


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(value: Any, param: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value, parse_constant=_reject_constant)
    except ValueError as exc:
        raise bad_request(f"Invalid '{param}': not valid JSON ({exc}).", param) from None
    except RecursionError:
        raise bad_request(f"Invalid '{param}': nested too deeply.", param) from None


def json_grammar(schema: Any, param: str) -> GrammarSpec:
    """A JSON Schema (an object, a boolean, or the text of one) -> GrammarSpec("json", text)."""
    return GrammarSpec("json", _dumps(_schema(schema, param), param))


def _schema(schema: Any, param: str) -> dict | bool:
    """A JSON Schema, parsed from its text if need be, checked to be an object or a boolean."""
    schema = _json_value(schema, param)
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"Invalid '{param}': a JSON Schema must be an object or a boolean, got "
                          f"{type(schema).__name__}.", param)
    return schema


def _dumps(value: Any, param: str) -> str:
    """The canonical text the worker compiles (one text per equal value)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (RecursionError, ValueError):
        raise bad_request(f"Invalid '{param}': nested too deeply.", param) from None


def _pattern(kind: str) -> Callable[[Any, str], GrammarSpec]:
    def make(text: str, param: str) -> GrammarSpec:
        if not text:
            raise bad_request(f"Invalid '{param}': must not be empty.", param)
        return GrammarSpec(kind, text)

    return make


def choice_grammar(choices: list[str], param: str) -> GrammarSpec:
    if not choices:
        raise bad_request(f"Invalid '{param}': empty array. Expected at least one choice.", param)
    return GrammarSpec("choice", json.dumps(choices, ensure_ascii=False))


def structural_tag_grammar(tag: Any, param: str) -> GrammarSpec:
    """xgrammar's structural tag (an object or its JSON text) -> GrammarSpec("structural_tag", text):
    ``{"format": {...}}`` (``type`` "structural_tag" added), or the older form
    ``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`` (schemas checked as
    JSON Schemas). What the format itself means is the worker's to check (xgrammar's compile)."""
    tag = _json_value(tag, param)
    if not isinstance(tag, dict):
        raise bad_request(f"Invalid '{param}': a structural tag must be an object.", param)
    older = tag.get("structures") is not None or tag.get("triggers") is not None
    if older and tag.get("format") is not None:
        raise bad_request(f"Invalid '{param}': give either 'format' or the older 'structures' and 'triggers', "
                          "not both.", param)
    if older:
        return GrammarSpec("structural_tag", _dumps(_older_tag(tag.get("structures"), tag.get("triggers"), param), param))
    if not isinstance(tag.get("format"), dict):
        raise bad_request(f"Invalid '{param}': a structural tag needs 'format' (an object), or the older "
                          "'structures' and 'triggers'.", param)
    return GrammarSpec("structural_tag", _dumps({"type": "structural_tag", "format": tag["format"]}, param))


def _older_tag(structures: Any, triggers: Any, param: str) -> dict:
    """The older structural tag's ``structures`` and ``triggers``, checked, schemas parsed."""
    if not isinstance(structures, list) or not structures:
        raise bad_request(f"Invalid '{param}.structures': expected a non-empty array.", f"{param}.structures")
    items = []
    for i, s in enumerate(structures):
        where = f"{param}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str) \
                or "schema" not in s:
            raise bad_request(f"Invalid '{where}': expected an object with string 'begin' and 'end' and a "
                              "'schema'.", where)
        items.append({"begin": s["begin"], "schema": _schema(s["schema"], f"{where}.schema"), "end": s["end"]})
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise bad_request(f"Invalid '{param}.triggers': expected a non-empty array of non-empty strings.",
                          f"{param}.triggers")
    return {"structures": items, "triggers": triggers}


MAKERS = {"json": json_grammar, "regex": _pattern("regex"), "ebnf": _pattern("ebnf"), "choice": choice_grammar}
# Top-level request fields -> the kind of constraint they spell (vLLM's older names, then SGLang's).
TOP_LEVEL = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
             ("guided_grammar", "ebnf"), ("json_schema", "json"), ("regex", "regex"), ("ebnf", "ebnf"))
# vLLM's structured_outputs keys -> kinds
STRUCTURED_OUTPUTS = (("json", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "ebnf"))


def _response_format(rf: Any) -> GrammarSpec | None:
    if rf.type == "json_object":
        return GrammarSpec("json", JSON_OBJECT)
    if rf.type == "json_schema":
        if rf.json_schema is None:  # SGLang also reads the schema at response_format.schema
            schema, param = rf.schema, "response_format.schema"
        else:
            schema, param = rf.json_schema.schema, "response_format.json_schema.schema"
        return GrammarSpec("json", JSON_OBJECT) if schema is None else json_grammar(schema, param)
    if rf.type == "structural_tag":
        return structural_tag_grammar({"format": rf.format, "structures": rf.structures, "triggers": rf.triggers},
                                      "response_format")
    return None


def _candidates(req: Any, prefix: str) -> Iterator[tuple[str, GrammarSpec]]:
    rf = getattr(req, "response_format", None)
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            yield "response_format", spec
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        for key, kind in STRUCTURED_OUTPUTS:
            if getattr(so, key) is not None:
                yield f"structured_outputs.{key}", MAKERS[kind](getattr(so, key), f"structured_outputs.{key}")
        if so.json_object:
            yield "structured_outputs.json_object", GrammarSpec("json", JSON_OBJECT)
        if so.structural_tag is not None:
            yield "structured_outputs.structural_tag", structural_tag_grammar(so.structural_tag,
                                                                              "structured_outputs.structural_tag")
    for field, kind in TOP_LEVEL:
        value = getattr(req, field, None)
        if value is not None:
            yield prefix + field, MAKERS[kind](value, prefix + field)
    if getattr(req, "structural_tag", None) is not None:
        yield prefix + "structural_tag", structural_tag_grammar(req.structural_tag, prefix + "structural_tag")


def with_options(spec: GrammarSpec | None, req: Any) -> GrammarSpec | None:
    """``structured_outputs``' options applied to the grammar, whichever field carries it: vLLM
    merges ``response_format``, the older fields and a forced ``tool_choice`` into
    ``structured_outputs`` before reading its options, so ``disable_any_whitespace`` binds a
    schema sent in ``response_format`` or ``tools`` too. ``disable_additional_properties`` is what
    the worker's xgrammar does anyway (strict mode: no property the schema does not list), and
    ``disable_fallback`` has nothing to disable (one backend); ``whitespace_pattern`` (outlines'
    option) has no xgrammar equivalent: a 400 rather than a pattern silently not applied."""
    so = getattr(req, "structured_outputs", None)
    if so is None:
        return spec
    if so.whitespace_pattern is not None:
        raise bad_request("Invalid 'structured_outputs.whitespace_pattern': not supported by this server's grammar "
                          "backend (xgrammar); use 'disable_any_whitespace' for compact JSON.",
                          "structured_outputs.whitespace_pattern")
    if spec is not None and spec.kind == "json" and so.disable_any_whitespace:
        return msgspec.structs.replace(spec, any_whitespace=False)
    return spec


def find_constraint(req: Any, prefix: str = "") -> tuple[str, GrammarSpec] | None:
    """(the field that set it, the grammar, ``structured_outputs``' options applied) of a request
    body or /generate's ``sampling_params`` (``prefix`` "sampling_params."); None without a
    constraint. APIError(400) on bad input."""
    found = None
    for param, spec in _candidates(req, prefix):
        if found is not None:
            raise conflict(found[0], param)
        found = (param, spec)
    with_options(None, req)  # a bad option is a 400 with or without a constraint
    return None if found is None else (found[0], with_options(found[1], req))


def request_grammar(req: Any, prefix: str = "") -> GrammarSpec | None:
    found = find_constraint(req, prefix)
    return found[1] if found else None


def chat_grammar(req: Any, forced: GrammarSpec | None) -> GrammarSpec | None:
    """A chat request's grammar: its constraint, or the one a forced ``tool_choice`` brings
    (tool_choice.py), read last: both is a 400 naming ``tool_choice``."""
    found = find_constraint(req)
    if found and forced:
        raise conflict(found[0], "tool_choice")
    return with_options(forced, req) if forced else (found[1] if found else None)


def conflict(first: str, second: str) -> APIError:
    return bad_request(f"Only one structured-output constraint may be set per request, but both '{first}' and "
                       f"'{second}' constrain the output.", second)
