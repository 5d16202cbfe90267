"""Structured output through the HTTP front (tokenizer_proc/structured.py): every spelling a
vLLM / SGLang / OpenAI client sends reaches the engine as one exact GrammarSpec, bad input is a
400 naming the field, and a grammar the worker cannot compile comes back as a 400 (or a stream's
error event). Forced tool calls: test_front_structured_tools.py."""

from __future__ import annotations

import json

import openai
import pytest

from proto.messages import GenerateReq, GrammarSpec
from tests.unit.front_harness import MODEL, start_stack
from tests.unit.front_tok import tokenizer_with_tags

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SCHEMA_TEXT = '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}'
OBJECT = GrammarSpec("json", '{"type": "object"}')
ASK = [{"role": "user", "content": "Weather?"}]
FORMAT = {"type": "triggered_tags", "triggers": ["<f"],
          "tags": [{"type": "tag", "begin": "<f>", "content": {"type": "json_schema", "json_schema": SCHEMA},
                    "end": "</f>"}]}
TAG = GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": FORMAT}))
LEGACY_TAG = GrammarSpec("structural_tag", json.dumps({"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                                                       "triggers": ["<f"]}))


@pytest.fixture(scope="module")
def stack():
    s = start_stack()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def reset_fake(stack):
    stack.fake.output_fn, stack.fake.grammar_error, stack.fake.tokens_per_step = None, None, 1
    yield


def sent(stack, count: int = 1) -> list[GenerateReq]:
    return stack.fake.of_type(GenerateReq)[-count:]


def post(client, endpoint: str, body: dict, **kw):
    """``body``'s fields through the official client: chat's response_format as its own argument,
    the rest (and the completions' response_format, a vLLM extension) in ``extra_body``."""
    body = dict(body)
    if endpoint == "chat" and "response_format" in body:
        kw["response_format"] = body.pop("response_format")
    if endpoint == "chat":
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=body, **kw)
    return client.completions.create(model=MODEL, prompt="Weather?", max_tokens=2, extra_body=body, **kw)


SPELLINGS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, OBJECT),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     GrammarSpec("json", SCHEMA_TEXT)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w"}}}, OBJECT),  # vLLM: any object
    ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, GrammarSpec("json", SCHEMA_TEXT)),  # SGLang
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec("json", SCHEMA_TEXT)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, GrammarSpec("json", SCHEMA_TEXT)),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     GrammarSpec("json", SCHEMA_TEXT, any_whitespace=False)),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     GrammarSpec("json", '{"type": "object"}', any_whitespace=False)),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, GrammarSpec("regex", "a+")),
    # vLLM merges every field into structured_outputs: its options bind whichever field carries the schema
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
      "structured_outputs": {"disable_any_whitespace": True}}, GrammarSpec("json", SCHEMA_TEXT, any_whitespace=False)),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     GrammarSpec("json", '{"type": "object"}', any_whitespace=False)),
    ({"guided_json": SCHEMA, "structured_outputs": {"disable_any_whitespace": True}},
     GrammarSpec("json", SCHEMA_TEXT, any_whitespace=False)),
    ({"json_schema": json.dumps(SCHEMA), "structured_outputs": {"disable_any_whitespace": True}},
     GrammarSpec("json", SCHEMA_TEXT, any_whitespace=False)),
    ({"guided_regex": "a+", "structured_outputs": {"disable_any_whitespace": True}}, GrammarSpec("regex", "a+")),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True, "disable_fallback": True}},
     GrammarSpec("json", SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]+"}}, GrammarSpec("regex", r"\d{3}-[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no", "東京"]}}, GrammarSpec("choice", '["yes", "no", "東京"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, GrammarSpec("ebnf", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, OBJECT),
    ({"structured_outputs": {"json_object": False}}, None),
    ({"structured_outputs": {}}, None),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}}, GrammarSpec("regex", "a+")),
    ({"guided_json": SCHEMA}, GrammarSpec("json", SCHEMA_TEXT)),
    ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json", SCHEMA_TEXT)),
    ({"guided_json": True}, GrammarSpec("json", "true")),
    ({"guided_regex": "(yes|no)"}, GrammarSpec("regex", "(yes|no)")),
    ({"guided_choice": ["a", "b"]}, GrammarSpec("choice", '["a", "b"]')),
    ({"guided_grammar": "root ::= [0-9]+"}, GrammarSpec("ebnf", "root ::= [0-9]+")),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, GrammarSpec("json", SCHEMA_TEXT)),
    ({"json_schema": json.dumps(SCHEMA)}, GrammarSpec("json", SCHEMA_TEXT)),  # SGLang
    ({"regex": "[A-Z]+"}, GrammarSpec("regex", "[A-Z]+")),
    ({"ebnf": 'root ::= "x"'}, GrammarSpec("ebnf", 'root ::= "x"')),
    ({"response_format": {"type": "structural_tag", "format": FORMAT}}, TAG),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                          "triggers": ["<f"]}}, LEGACY_TAG),
    ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", "format": FORMAT})}}, TAG),
    ({"structured_outputs": {"structural_tag": json.dumps({"structures": [
        {"begin": "<f>", "schema": json.dumps(SCHEMA), "end": "</f>"}], "triggers": ["<f"]})}}, LEGACY_TAG),
    ({}, None),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("body,want", SPELLINGS, ids=[str(b)[:70] for b, _ in SPELLINGS])
def test_every_spelling_reaches_the_engine(stack, client, endpoint, body, want):
    post(client, endpoint, body)
    assert sent(stack)[0].params.grammar == want


def test_generate_sampling_params(stack, http):
    for sp, want in (({"json_schema": json.dumps(SCHEMA)}, GrammarSpec("json", SCHEMA_TEXT)),
                     ({"regex": "a|b"}, GrammarSpec("regex", "a|b")),
                     ({"ebnf": 'root ::= "x"'}, GrammarSpec("ebnf", 'root ::= "x"')),
                     ({"structural_tag": json.dumps({"format": FORMAT})}, TAG),
                     ({}, None)):
        r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2, **sp}})
        assert r.status_code == 200, r.text
        assert sent(stack)[0].params.grammar == want


def test_every_choice_gets_the_grammar(stack, client):
    """n > 1 (and best_of, which is ignored) : each engine request carries the same grammar."""
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, n=3, seed=7,
                                   extra_body={"guided_regex": "x+", "best_of": 3})
    reqs = sent(stack, 3)
    assert [r.params.grammar for r in reqs] == [GrammarSpec("regex", "x+")] * 3
    assert [r.params.seed for r in reqs] == [7, 8, 9]
    client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, n=2, extra_body={"guided_choice": ["a"]})
    assert {r.params.grammar for r in sent(stack, 4)} == {GrammarSpec("choice", '["a"]')}


def error_of(response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


CONFLICT = "Only one structured-output constraint may be set per request, but both '{}' and '{}' constrain the output."
ERRORS = [
    ({"guided_json": "{not json"}, "guided_json", "Invalid 'guided_json': not valid JSON ("),
    ({"guided_json": '{"a": NaN}'}, "guided_json", "Invalid 'guided_json': not valid JSON ("),
    ({"guided_json": [1, 2]}, "guided_json",
     "Invalid 'guided_json': a JSON Schema must be an object or a boolean, got list."),
    ({"structured_outputs": {"json": "5"}}, "structured_outputs.json",
     "Invalid 'structured_outputs.json': a JSON Schema must be an object or a boolean, got int."),
    ({"json_schema": "[1"}, "json_schema", "Invalid 'json_schema': not valid JSON ("),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": 3}}},
     "response_format.json_schema.schema",
     "Invalid 'response_format.json_schema.schema': a JSON Schema must be an object or a boolean, got int."),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice",
     "Invalid 'structured_outputs.choice': empty array. Expected at least one choice."),
    ({"guided_choice": []}, "guided_choice", "Invalid 'guided_choice': empty array. Expected at least one choice."),
    ({"guided_regex": ""}, "guided_regex", "Invalid 'guided_regex': must not be empty."),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar",
     "Invalid 'structured_outputs.grammar': must not be empty."),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex",
     CONFLICT.format("structured_outputs.json", "structured_outputs.regex")),
    ({"structured_outputs": {"choice": ["a"], "json_object": True}}, "structured_outputs.json_object",
     CONFLICT.format("structured_outputs.choice", "structured_outputs.json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
      "guided_regex": "a"}, "guided_regex", CONFLICT.format("response_format", "guided_regex")),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
     "structured_outputs.json", CONFLICT.format("response_format", "structured_outputs.json")),
    ({"guided_json": SCHEMA, "regex": "a"}, "regex", CONFLICT.format("guided_json", "regex")),
    ({"guided_choice": ["a"], "ebnf": "root ::= x"}, "ebnf", CONFLICT.format("guided_choice", "ebnf")),
    ({"response_format": {"type": "structural_tag"}}, "response_format",
     "Invalid 'response_format': a structural tag needs 'format' (an object), or the older 'structures' and "
     "'triggers'."),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "Invalid 'structured_outputs.structural_tag': a structural tag needs 'format' (an object), or the older "
     "'structures' and 'triggers'."),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs.structural_tag",
     "Invalid 'structured_outputs.structural_tag': a structural tag must be an object."),
    ({"structured_outputs": {"structural_tag": "{x"}}, "structured_outputs.structural_tag",
     "Invalid 'structured_outputs.structural_tag': not valid JSON ("),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<f"]}},
     "response_format.structures", "Invalid 'response_format.structures': expected a non-empty array."),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA}],
                          "triggers": ["<f"]}}, "response_format.structures[0]",
     "Invalid 'response_format.structures[0]': expected an object with string 'begin' and 'end' and a 'schema'."),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": 3, "end": "</f>"}],
                          "triggers": ["<f"]}}, "response_format.structures[0].schema",
     "Invalid 'response_format.structures[0].schema': a JSON Schema must be an object or a boolean, got int."),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}],
                          "triggers": [""]}}, "response_format.triggers",
     "Invalid 'response_format.triggers': expected a non-empty array of non-empty strings."),
    ({"response_format": {"type": "structural_tag", "format": FORMAT}, "guided_regex": "a"}, "guided_regex",
     CONFLICT.format("response_format", "guided_regex")),
    ({"response_format": {"type": "structural_tag", "format": FORMAT, "triggers": ["<f"],
                          "structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}]}}, "response_format",
     "Invalid 'response_format': give either 'format' or the older 'structures' and 'triggers', not both."),
    ({"response_format": {"type": "structural_tag", "format": FORMAT, "triggers": ["<f"]}}, "response_format",
     "Invalid 'response_format': give either 'format' or the older 'structures' and 'triggers', not both."),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?"}}, "structured_outputs.whitespace_pattern",
     "Invalid 'structured_outputs.whitespace_pattern': not supported by this server's grammar backend (xgrammar); "
     "use 'disable_any_whitespace' for compact JSON."),
    ({"structured_outputs": {"structural_tag": json.dumps({"triggers": ["<f"]})}}, "structured_outputs.structural_tag.structures",
     "Invalid 'structured_outputs.structural_tag.structures': expected a non-empty array."),
]


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("body,param,message", ERRORS, ids=[str(b)[:70] for b, _, _ in ERRORS])
def test_bad_constraints_are_a_400(stack, http, endpoint, body, param, message):
    before = len(sent(stack, 10**6))
    base = {"messages": ASK} if endpoint.endswith("chat/completions") else {"prompt": "Hi"}
    err = error_of(http.post(endpoint, json={**base, "max_tokens": 2, **body}))
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400
    assert err["message"].startswith(message) if message.endswith("(") else err["message"] == message
    assert len(sent(stack, 10**6)) == before  # nothing reached the engine


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
    ({"structured_outputs": "json"}, "structured_outputs"),
])
def test_wrong_types_name_the_field(http, body, param):
    assert error_of(http.post("/v1/chat/completions", json={"messages": ASK, **body}))["param"] == param


def test_generate_errors_name_sampling_params(http):
    for sp, param in (({"json_schema": "{", "max_new_tokens": 2}, "sampling_params.json_schema"),
                      ({"json_schema": "{}", "regex": "a"}, "sampling_params.regex"),
                      ({"ebnf": ""}, "sampling_params.ebnf"),
                      ({"structural_tag": "{}"}, "sampling_params.structural_tag")):
        assert error_of(http.post("/generate", json={"text": "Hi", "sampling_params": sp}))["param"] == param


GRAMMAR_ERROR = "Invalid regex '(': missing ), unterminated subpattern at position 0"


def test_a_grammar_the_worker_cannot_compile_is_a_400(stack, client, http):
    """The worker answers an uncompilable grammar with an error output (error_code 400) before any
    token: non-streaming requests get that 400, streams an error event then [DONE]."""
    stack.fake.grammar_error = GRAMMAR_ERROR
    for endpoint in ("chat", "completions"):
        with pytest.raises(openai.BadRequestError) as exc:
            post(client, endpoint, {"guided_regex": "("})
        assert exc.value.status_code == 400
        assert exc.value.body == {"message": GRAMMAR_ERROR, "type": "BadRequestError", "param": None, "code": 400}
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"regex": "("}})
    assert error_of(r)["message"] == GRAMMAR_ERROR
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/generate", {"text": "Hi", "sampling_params": {"regex": "("}})):
        r = http.post(path, json={**body, "guided_regex": "(", "stream": True})
        assert r.status_code == 200
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
        assert errors == [{"message": GRAMMAR_ERROR, "type": "BadRequestError", "param": None, "code": 400}]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    # the same request without a grammar is served
    assert post(client, "chat", {}).choices[0].finish_reason == "length"


def test_reasoning_parser_with_a_grammar_answers_in_content(tmp_path):
    """A tokenizer whose ``</think>`` is not one token: the worker could not see the reasoning
    end, so the grammar binds from the first token and the constrained answer is all content
    (docs/http_api.md)."""
    s = start_stack(reasoning_parser="qwen3")
    try:
        assert s.tok.token_to_id("</think>") is None
        ids = s.tok.encode('{"city": "Paris"}', add_special_tokens=False) + [s.tok.eos_id]
        s.fake.output_fn = lambda req: list(ids)
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
        plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20).choices[0].message
        assert plain.content is None and plain.model_extra["reasoning_content"] == '{"city": "Paris"}'
        for stream in (False, True):
            r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, stream=stream,
                                               response_format={"type": "json_object"})
            if stream:
                content = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            else:
                content = r.choices[0].message.content
                assert r.choices[0].message.model_extra.get("reasoning_content") is None
            assert content == '{"city": "Paris"}'
        assert s.fake.of_type(GenerateReq)[-1].params.grammar == OBJECT
    finally:
        s.close()


def think_tag_tokenizer(path: str) -> str:
    """Qwen3's notation: ``<think>`` / ``</think>`` are added tokens, not special ones."""
    return tokenizer_with_tags(path, ["<think>", "</think>"], special=False)


def test_the_grammar_binds_after_the_reasoning_ends(tmp_path):
    """vLLM / SGLang with a reasoning parser: the model reasons unconstrained and the grammar
    starts after ``</think>`` (``GrammarSpec.after`` is its token id); the answer splits into
    reasoning and the constrained content. A prompt that closed the block (enable_thinking off)
    binds from the first token; ``separate_reasoning: false`` (SGLang) still waits for the tag
    and leaves the whole answer in ``content``."""
    s = start_stack(tok_dir=think_tag_tokenizer(str(tmp_path)), reasoning_parser="qwen3")
    try:
        end = s.tok.token_to_id("</think>")
        assert end is not None and s.tok.encode("</think>", add_special_tokens=False) == [end]
        text = '<think>\nA city: Paris.\n</think>\n\n{"city": "Paris"}'
        ids = s.tok.encode(text, add_special_tokens=False) + [s.tok.eos_id]
        s.fake.output_fn = lambda req: list(ids)
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=20)
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
        for stream in (False, True):
            r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, stream=stream,
                                               response_format=fmt)
            if stream:
                chunks = [c.choices[0].delta for c in r if c.choices]
                content = "".join(d.content or "" for d in chunks)
                reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in chunks)
            else:
                content = r.choices[0].message.content
                reasoning = r.choices[0].message.model_extra["reasoning_content"]
            assert (reasoning.strip(), content.strip()) == ("A city: Paris.", '{"city": "Paris"}')
            assert sent(s)[0].params.grammar == GrammarSpec("json", SCHEMA_TEXT, after=end)
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, response_format=fmt,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert sent(s)[0].params.grammar == GrammarSpec("json", SCHEMA_TEXT)
        whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, response_format=fmt,
                                               extra_body={"separate_reasoning": False}).choices[0].message
        assert sent(s)[0].params.grammar == GrammarSpec("json", SCHEMA_TEXT, after=end)
        assert whole.content.strip() == text and not whole.model_extra.get("reasoning_content")
        call = s.tok.encode('<think>\nf it is.\n</think>\n\n[{"name": "f", "parameters": {"x": 1}}]',
                            add_special_tokens=False) + [s.tok.eos_id]
        s.fake.output_fn = lambda req: list(call)
        msg = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, tool_choice="required",
                                             tools=[{"type": "function", "function": {"name": "f"}}]).choices[0]
        assert sent(s)[0].params.grammar.after == end  # forced tool calls follow the reasoning too
        assert msg.message.model_extra["reasoning_content"].strip() == "f it is."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.message.tool_calls] == [("f", {"x": 1})]
        assert msg.finish_reason == "tool_calls"
    finally:
        s.close()
