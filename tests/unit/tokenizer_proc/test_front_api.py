"""The HTTP front end to end: official openai client -> uvicorn -> ZMQ -> FakeEngine and back."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from proto.messages import AbortReq, FlushCache, GenerateReq, ReqOutput
from tests.helpers.server import post_then_leave
from tests.unit.front_harness import MODEL, start_stack


@pytest.fixture(scope="module")
def stack():
    s = start_stack()
    yield s
    s.close()


@pytest.fixture(autouse=True)
def reset_fake(stack):
    fake = stack.fake
    fake.tokens_per_step, fake.paused, fake.error_token, fake.eos_after, fake.output_fn = 1, False, None, None, None
    yield


def fixed_output(stack, text: str):
    ids = stack.tok.encode(text, add_special_tokens=False)
    stack.fake.output_fn = lambda req: list(ids)
    return ids


def gen_reqs(stack) -> list[GenerateReq]:
    return stack.fake.of_type(GenerateReq)


# ---------------------------------------------------------------------- basics


def test_models(client):
    models = client.models.list()
    assert models.data[0].id == MODEL
    assert models.data[0].model_extra["max_model_len"] == 512
    # models.retrieve (GET /v1/models/{id}): the same card; an unknown id is OpenAI's 404.
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("org/no-such-model")
    err = exc.value.body
    assert err["code"] == 404 and err["param"] == "model" and "org/no-such-model" in err["message"]


def test_completion_non_stream_and_stream_agree(stack, client):
    ids = fixed_output(stack, "Hello 😀 world, 日本語 café!")
    full = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=len(ids))
    assert full.choices[0].text == "Hello 😀 world, 日本語 café!"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == len(ids)

    chunks = list(client.completions.create(model=MODEL, prompt="Say hi", max_tokens=len(ids), stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert "\ufffd" not in "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_model_may_be_omitted(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_prompt_token_ids_and_batches(stack, client):
    fixed_output(stack, "abc abc abc")
    one = stack.tok.encode("Hello", add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=[one, one], max_tokens=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 2 * len(one)  # once per prompt, not per choice
    assert r.usage.completion_tokens == 4 * 3


def test_n_streaming_interleaves_by_index(stack, client):
    ids = fixed_output(stack, "one two three four")
    chunks = list(client.completions.create(model=MODEL, prompt="x", max_tokens=len(ids), n=3, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks[:-1]:
        texts[c.choices[0].index] = texts.get(c.choices[0].index, "") + c.choices[0].text
    assert texts == {i: "one two three four" for i in range(3)}
    assert chunks[-1].usage.completion_tokens == 3 * len(ids)
    assert chunks[-1].usage.prompt_tokens == len(stack.tok.encode("x"))


def test_n_with_seed_gives_distinct_seeds(stack, client):
    client.completions.create(model=MODEL, prompt="seeded", max_tokens=1, n=3, seed=7)
    seeds = [g.params.seed for g in gen_reqs(stack)[-3:]]
    assert seeds == [7, 8, 9]


def test_sampling_fields_reach_the_engine(stack, client):
    client.completions.create(
        model=MODEL, prompt="params", max_tokens=3, temperature=0.5, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.25,
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [7],
                    "repetition_penalty": 1.1, "min_tokens": 1, "unknown_field": 1},
    )
    p = gen_reqs(stack)[-1].params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (3, 0.5, 0.9, 5, 0.1)
    assert p.ignore_eos and p.stop_token_ids == (7,) and p.repetition_penalty == 1.1 and p.min_new_tokens == 1
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.25)
    client.completions.create(model=MODEL, prompt="params", max_tokens=1, extra_body={"top_k": 0})
    assert gen_reqs(stack)[-1].params.top_k == -1


def test_logit_bias_reaches_the_engine(stack, client, http):
    """Token ids in id order, biases clamped to [-100, 100] (vLLM); chat and /generate too."""
    client.completions.create(model=MODEL, prompt="bias", max_tokens=1, logit_bias={"9": 250, "3": -0.5, "12": -300})
    p = gen_reqs(stack)[-1].params
    assert (p.logit_bias_ids, p.logit_bias) == ((3, 9, 12), (-0.5, 100.0, -100.0))
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                   logit_bias={"4": 2})
    assert gen_reqs(stack)[-1].params.logit_bias_ids == (4,)
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1, "logit_bias": {"5": 1.5}}})
    assert r.status_code == 200 and gen_reqs(stack)[-1].params.logit_bias == (1.5,)
    client.completions.create(model=MODEL, prompt="bias", max_tokens=1)
    assert gen_reqs(stack)[-1].params.logit_bias_ids == ()


# ---------------------------------------------------------------------- stops


@pytest.mark.parametrize("tokens_per_step", [1, 3, 8])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_straddling_tokens(stack, client, tokens_per_step, stream):
    stack.fake.tokens_per_step = tokens_per_step
    ids = fixed_output(stack, "The quick brown fox. Stop here. Then more text that must not appear.")
    kwargs = dict(model=MODEL, prompt="x", max_tokens=len(ids), stop=["must", "p he"])
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        r = client.completions.create(**kwargs)
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    assert text == "The quick brown fox. Sto"
    assert finish == "stop"
    # Usage counts tokens up to and including the one that completed "p he".
    upto = next(i for i in range(1, len(ids) + 1) if "p he" in stack.tok.decode(ids[:i]))
    assert usage.completion_tokens == upto
    rid = gen_reqs(stack)[-1].rid
    assert stack.fake.wait_for(lambda: any(a.rid == rid and a.reason == "stop_string"
                                           for a in stack.fake.of_type(AbortReq)))


def test_include_stop_str_and_eos(stack, client):
    fixed_output(stack, "alpha beta gamma")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10, stop="beta",
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == "alpha beta"
    stack.fake.eos_after = 3
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=10)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3


# ---------------------------------------------------------------------- chat


def test_chat_non_stream_and_stream(stack, client):
    fixed_output(stack, "Bonjour 🚀!")
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=50)
    assert r.choices[0].message.content == "Bonjour 🚀!" and r.choices[0].message.role == "assistant"
    prompt = gen_reqs(stack)[-1].prompt_ids
    assert len(prompt) // 4 == r.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, max_tokens=50,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Bonjour 🚀!"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_default_max_tokens_fills_context(stack, client):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    req = gen_reqs(stack)[-1]
    assert req.params.max_new_tokens == 512 - len(req.prompt_ids) // 4


def test_chat_logprobs(stack, client):
    ids = fixed_output(stack, "abc def")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].logprob == -0.25 and content[0].token == stack.tok.token_str(ids[0])


# ---------------------------------------------------------------------- logprobs / echo


def test_completion_logprobs_shape(stack, client):
    ids = fixed_output(stack, "one two three")
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=len(ids), logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[:2] == [-0.25, -0.5]
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_echo_max_tokens_zero_for_lm_eval(stack, client):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    n_prompt = len(stack.tok.encode(prompt))
    lp = choice.logprobs
    assert len(lp.token_logprobs) == n_prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1] == -0.25
    assert gen_reqs(stack)[-1].params.prompt_logprobs == 1


def test_vllm_prompt_logprobs_field(stack, http):
    r = http.post("/v1/completions", json={"prompt": "The fox", "max_tokens": 1, "prompt_logprobs": 2}).json()
    rows = r["choices"][0]["prompt_logprobs"]
    ids = stack.tok.encode("The fox")
    assert rows[0] is None and len(rows) == len(ids)
    assert rows[1][str(ids[1])]["logprob"] == -0.25 and len(rows[1]) == 2


def test_echo_with_generation(stack, client):
    fixed_output(stack, " jumps")
    r = client.completions.create(model=MODEL, prompt="The fox", max_tokens=5, echo=True, logprobs=0)
    assert r.choices[0].text == "The fox jumps"
    assert len(r.choices[0].logprobs.tokens) == len(stack.tok.encode("The fox")) + len(
        stack.tok.encode(" jumps", add_special_tokens=False))


# ---------------------------------------------------------------------- errors


def test_error_mapping(stack, client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt="x")
    assert exc.value.body["type"] == "NotFoundError" and exc.value.body["code"] == 404
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="x", max_tokens=600)
    assert "maximum context length is 512 tokens" in exc.value.body["message"]
    assert "(2 in the prompt, 600 for the completion)" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10_000], max_tokens=1)


def test_engine_error_before_tokens(stack, client, http):
    stack.fake.error_token = 77
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[5, 77], max_tokens=2)
    assert "rejects" in exc.value.body["message"]
    r = http.post("/v1/completions", json={"prompt": [5, 77], "max_tokens": 2, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["error"]["code"] == 400 and events[-1] == "[DONE]"


def test_engine_abort_finish_reason(stack, client):
    stack.fake.output_fn = lambda req: [5] * 50
    stack.fake.paused = True

    def abort_soon():
        # Wait until the fake engine itself holds the request (not just the front).
        stack.fake.wait_for(lambda: len(stack.fake.running) > 0, timeout=15)
        with stack.fake._lock:
            rid = next(iter(stack.fake.running))  # the scheduler aborting on its own (e.g. preemption limit)
            stack.fake.running.pop(rid)
            stack.fake._send([ReqOutput(rid, b"", finish_reason="abort")])

    t = threading.Thread(target=abort_soon)
    t.start()
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=50)
    t.join()
    assert r.choices[0].finish_reason == "abort"


# ---------------------------------------------------------------------- disconnects


def _wait_abort(stack, reason="client_disconnect"):
    rid = gen_reqs(stack)[-1].rid
    return stack.fake.wait_for(lambda: any(a.rid == rid and a.reason == reason for a in stack.fake.of_type(AbortReq)))


def test_stream_disconnect_aborts(stack):
    stack.fake.output_fn = lambda req: [5] * 4000
    stack.fake.step_s = 0.01
    try:
        with httpx.Client(base_url=stack.base_url, timeout=10) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 400, "stream": True}) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        assert _wait_abort(stack)
        assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 0)
    finally:
        stack.fake.step_s = 0.002


def test_non_stream_disconnect_aborts(stack):
    stack.fake.paused = True
    n = len(gen_reqs(stack))
    post_then_leave(stack.base_url, "/v1/completions", {"prompt": "x", "max_tokens": 5},
                    until=lambda: len(gen_reqs(stack)) > n)  # the engine holds it, then the client leaves
    assert _wait_abort(stack)
    assert stack.fake.wait_for(lambda: stack.engine.num_inflight == 0)


# ---------------------------------------------------------------------- other endpoints


def test_health_version_flush(stack, http):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.post("/flush_cache").status_code == 200
    assert stack.fake.wait_for(lambda: stack.fake.of_type(FlushCache))
    assert http.get("/health_generate").status_code == 200


def test_tokenize_detokenize(stack, http):
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello 😀"}).json()
    assert r["tokens"] == stack.tok.encode("Hello 😀") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"][0] == stack.tok.token_to_id("<|im_start|>")
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == "<s>Hello 😀"
    assert http.post("/detokenize", json={"tokens": [99999]}).status_code == 400


def test_native_generate(stack, http):
    fixed_output(stack, "native text here")
    r = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 20, "temperature": 0},
                                     "rid": "my-rid"}).json()
    assert r["text"] == "native text here"
    meta = r["meta_info"]
    assert meta["id"] == "my-rid" and meta["finish_reason"] == {"type": "length", "length": meta["completion_tokens"]}
    assert {"prompt_tokens", "cached_tokens", "e2e_latency", "spec_verify_ct"} <= meta.keys()
    r = http.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 20, "stop": "text"},
                                     "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["text"] == "native "  # cumulative
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "text"}
    assert all(events[i + 1]["text"].startswith(events[i]["text"]) for i in range(len(events) - 1))


def test_server_info_and_spec_accept_length(stack, http, client):
    stack.fake.tokens_per_step = 4
    fixed_output(stack, "a b c d e f g h i j k l")
    client.completions.create(model=MODEL, prompt="x", max_tokens=12)
    assert stack.fake.wait_for(lambda: (stack.engine.last_stats or None) is not None
                               and stack.engine.last_stats.spec_num_drafts == stack.fake.drafts)
    info = http.get("/server_info").json()
    fake = stack.fake
    expected = (fake.accepted + fake.drafts) / fake.drafts
    assert info["avg_spec_accept_length"] == pytest.approx(expected)
    assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(expected)
    assert info["max_total_num_tokens"] == 64 * 16 and info["served_model_name"] == MODEL
    assert http.get("/get_server_info").status_code == 200


def test_metrics_exposition(stack, http, client):
    stack.fake.tokens_per_step = 3
    fixed_output(stack, "one two three four five six")
    client.completions.create(model=MODEL, prompt="x", max_tokens=6)
    text = http.get("/metrics").text
    assert "_created" not in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "request_time_per_output_token_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prefill_time_seconds_bucket",
                 "request_decode_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket", "spec_decode_num_drafts_total",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                 "spec_decode_num_accepted_tokens_per_pos_total"):
        assert f"tandem:{name}" in text, name
    assert 'le="2560.0"' in text and 'model_name="fake-model"' in text
    assert "vllm:" not in text


def test_openapi_describes_bodies_and_errors(http):
    spec = http.get("/openapi.json").json()
    op = spec["paths"]["/v1/completions"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"prompt", "max_tokens", "temperature", "logprobs", "stream"} <= schema["properties"].keys()
    assert {"400", "404", "503"} <= op["responses"].keys()
    assert "422" not in json.dumps(spec["paths"])
