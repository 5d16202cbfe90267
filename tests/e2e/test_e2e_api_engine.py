"""Engine-facing API behaviour against a real `tandem serve` (Gemma 4 tiny checkpoint, CPU):
penalties, min_tokens and logit_bias against HF greedy with vLLM semantics, client disconnects,
Prometheus metrics after a known workload, and the native / auxiliary endpoints.
"""

from __future__ import annotations

import time

import httpx
import pytest
import torch
from openai import OpenAI

from tests.e2e.api_util import engine_steps, metric, metrics, one_thread, post, stop_server, stream, wait_idle
from tests.helpers import hf_ref
from tests.helpers.server import Server, post_then_leave

ATOL = 1e-4
REPEAT_PROMPT = "hello there"  # greedy repeats " th th th ...": penalties change it
BIAS_PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def srv(ckpts):
    threads = one_thread()
    s = Server(ckpts["gemma4"])
    yield ckpts["gemma4"], s
    torch.set_num_threads(threads)
    stop_server(s)


# ---------------------------------------------------------------------- 5. penalties, min_tokens

PENALTIES = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 0.7},
    {"repetition_penalty": 1.6},
    {"repetition_penalty": 0.7},
    {"presence_penalty": 0.4, "frequency_penalty": 0.4, "repetition_penalty": 1.3},
    {"presence_penalty": -0.5},
]


def _ref_kwargs(p: dict) -> dict:
    return {"presence": p.get("presence_penalty", 0.0), "frequency": p.get("frequency_penalty", 0.0),
            "repetition": p.get("repetition_penalty", 1.0)}


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(f"{k[:4]}={v}" for k, v in p.items()))
def test_penalties_match_reference(srv, penalty):
    path, s = srv
    ids = hf_ref.encode(path, REPEAT_PROMPT)
    ref = hf_ref.greedy(path, ids, 16, ignore_eos=True, **_ref_kwargs(penalty))
    if penalty.get("presence_penalty", 0) > 0 or penalty.get("repetition_penalty", 1) > 1:
        assert ref != hf_ref.greedy(path, ids, 16, ignore_eos=True)  # the penalty matters here
    body = {"prompt": REPEAT_PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **penalty}
    r = post(s.url + "/v1/completions", body)
    assert r["choices"][0]["text"] == hf_ref.decode(path, ref)
    g = post(s.url + "/generate", {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True, **penalty}})
    assert g["output_ids"] == ref


def test_penalties_chat_stream_and_batch(srv):
    path, s = srv
    p = {"frequency_penalty": 1.0, "repetition_penalty": 1.2}
    ids = [hf_ref.encode(path, REPEAT_PROMPT), hf_ref.encode(path, "Once upon a time")]
    refs = [hf_ref.decode(path, hf_ref.greedy(path, x, 12, ignore_eos=True, **_ref_kwargs(p))) for x in ids]
    # A batch mixing penalised and plain rows: each row keeps its own parameters.
    r = post(s.url + "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                         **p})
    assert [c["text"] for c in r["choices"]] == refs
    msgs = [{"role": "user", "content": REPEAT_PROMPT}]
    cids = hf_ref.encode(path, f"<s><|user|>{REPEAT_PROMPT}<|end|><|assistant|>")
    ref = hf_ref.decode(path, hf_ref.greedy(path, cids, 12, ignore_eos=True, **_ref_kwargs(p)))
    events = stream(s.url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True, **p})
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == ref


def _first_token_eos_prompt(path: str) -> list[int]:
    """A one-token prompt after which HF greedy emits an EOS at once (searched in one batch)."""
    eos = hf_ref.eos_ids(path)
    cands = torch.tensor([[t] for t in range(6, 384)])
    with torch.no_grad():
        last = hf_ref.hf_model(path)(cands, use_cache=False).logits[:, -1].argmax(-1)
    hits = [cands[i].tolist() for i in range(len(cands)) if int(last[i]) in eos]
    assert hits, "no prompt makes the model emit EOS first"
    return hits[0]


def test_min_tokens_masks_eos(srv):
    path, s = srv
    ids = _first_token_eos_prompt(path)
    assert hf_ref.greedy(path, ids, 8)[0] in hf_ref.eos_ids(path)
    ref = hf_ref.greedy(path, ids, 12, min_tokens=4)
    assert len(ref) > 4
    r = post(s.url + "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0, "min_tokens": 4})
    ch = r["choices"][0]
    want_reason = "stop" if ref[-1] in hf_ref.eos_ids(path) else "length"
    assert (ch["finish_reason"], r["usage"]["completion_tokens"]) == (want_reason, len(ref))
    assert ch["text"] == hf_ref.decode(path, ref)
    # Without min_tokens it stops at once.
    r = post(s.url + "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert (r["choices"][0]["finish_reason"], r["usage"]["completion_tokens"]) == ("stop", 1)


@pytest.mark.parametrize("n_extra", [0, 20])
def test_min_tokens_masks_stop_token_ids(srv, n_extra):
    path, s = srv
    ids = hf_ref.encode(path, REPEAT_PROMPT)
    plain = hf_ref.greedy(path, ids, 16, ignore_eos=True)
    stop_id = plain[2]
    # n_extra other stop ids listed first (tokens the reference never produces unmasked here).
    others = [t for t in range(6, 384) if t not in plain][:n_extra]
    stop_ids = others + [stop_id]
    ref = hf_ref.greedy(path, ids, 16, min_tokens=5, stop_ids=stop_ids, ignore_eos=True)
    assert plain.index(stop_id) < 5 and ref[:5].count(stop_id) == 0
    r = post(s.url + "/v1/completions", {"prompt": REPEAT_PROMPT, "max_tokens": 16, "temperature": 0,
                                         "ignore_eos": True, "stop_token_ids": stop_ids, "min_tokens": 5})
    ch = r["choices"][0]
    stopped = ref[-1] in stop_ids
    assert r["usage"]["completion_tokens"] == len(ref)
    assert ch["text"] == hf_ref.decode(path, ref[:-1] if stopped else ref)
    assert ch["finish_reason"] == ("stop" if stopped else "length")


def test_min_tokens_defers_stop_strings(srv):
    path, s = srv
    ids = hf_ref.encode(path, "To be, or not to be")
    ref = hf_ref.greedy(path, ids, 30, ignore_eos=True)
    texts = hf_ref.prefix_texts(path, ref)
    case = hf_ref.stop_case(path, ref)
    body = {"prompt": "To be, or not to be", "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stop": [case.stop]}
    r = post(s.url + "/v1/completions", body)
    assert r["usage"]["completion_tokens"] == case.n_tokens
    # With min_tokens past that point the first match does not count; a later one (if any) does.
    m = case.n_tokens + 2
    later = [k for k in range(m, len(ref) + 1) if texts[k].count(case.stop) > texts[k - 1].count(case.stop)]
    r = post(s.url + "/v1/completions", {**body, "min_tokens": m})
    if later:
        k = later[0]
        assert r["usage"]["completion_tokens"] == k
        assert r["choices"][0]["text"] == texts[k][: texts[k].rfind(case.stop)]
    else:
        assert (r["choices"][0]["text"], r["usage"]["completion_tokens"]) == (texts[-1], len(ref))


def test_logit_bias(srv):
    """OpenAI's logit_bias through the official client: +100 on one token makes greedy repeat it
    (its logprobs stay the raw model's, vLLM's default), -100 on the greedy first token bans it;
    chat takes it too."""
    path, s = srv
    ids = hf_ref.encode(path, BIAS_PROMPT)
    ref = hf_ref.greedy(path, ids, 6, ignore_eos=True)
    boosted = next(t for t in range(40, 400) if t not in ref and hf_ref.decode(path, [t]).strip())
    client = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=path, prompt=BIAS_PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                  logit_bias={str(boosted): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == hf_ref.decode(path, [boosted] * 6) and r.usage.completion_tokens == 6
    raw = hf_ref.logprob_rows(path, ids + [boosted])[len(ids) - 1, boosted].item()
    assert abs(r.choices[0].logprobs.token_logprobs[0] - raw) < ATOL  # not ~0: the bias is not in it
    banned = client.completions.create(model=path, prompt=ids, max_tokens=1, temperature=0,
                                       logit_bias={str(ref[0]): -100}, extra_body={"ignore_eos": True})
    assert banned.choices[0].text != hf_ref.decode(path, ref[:1])
    chat = client.chat.completions.create(model=path, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias={str(boosted): 100})
    assert chat.choices[0].message.content == hf_ref.decode(path, [boosted] * 3)


# ---------------------------------------------------------------------- 8. disconnects


def test_stream_disconnect_aborts_engine_request(srv):
    path, s = srv
    wait_idle(s.url)
    before, steps = metrics(s.url), engine_steps(s.url)
    idle_kv = metric(before, "tandem:kv_cache_usage_perc")
    body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        closed = time.monotonic()
    wait_idle(s.url, timeout=2.0, idle_kv=idle_kv)  # the idle stats lag up to ~1 s: see below
    assert time.monotonic() - closed < 2.0
    after = metrics(s.url)
    assert engine_steps(s.url) - steps < 200  # a full run would take 480 steps
    assert metric(after, "tandem:request_success_total", finished_reason="abort") == \
        metric(before, "tandem:request_success_total", finished_reason="abort") + 1
    assert metric(after, "tandem:generation_tokens_total") - metric(before, "tandem:generation_tokens_total") < 200


def test_non_stream_disconnect_aborts_engine_request(srv):
    path, s = srv
    wait_idle(s.url)
    before, steps = metrics(s.url), engine_steps(s.url)
    msgs = [{"role": "user", "content": "Once upon a time"}]
    post_then_leave(s.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 480, "ignore_eos": True},
                    until=lambda: httpx.get(s.url + "/load", timeout=5).json()["server_load"] == 1)  # accepted
    wait_idle(s.url, timeout=2.0)
    assert engine_steps(s.url) - steps < 300
    assert metric(metrics(s.url), "tandem:request_success_total", finished_reason="abort") == \
        metric(before, "tandem:request_success_total", finished_reason="abort") + 1


def test_idle_gauges_are_fresh_after_abort(srv):
    path, s = srv
    ref = hf_ref.greedy(path, hf_ref.encode(path, "To be, or not to be"), 12, ignore_eos=True)
    stop = hf_ref.stop_case(path, ref).stop
    for _ in range(3):
        r = post(s.url + "/v1/completions", {"prompt": "To be, or not to be", "max_tokens": 100, "ignore_eos": True,
                                             "temperature": 0, "stop": [stop]})
        assert r["choices"][0]["finish_reason"] == "stop"
        wait_idle(s.url, timeout=0.4)


# ---------------------------------------------------------------------- 9. metrics


def test_metrics_after_known_workload(srv):
    path, s = srv
    wait_idle(s.url)
    before = metrics(s.url)
    url = s.url + "/v1/completions"
    usages, reasons = [], []
    for body in [
        {"prompt": "Once upon a time", "max_tokens": 9, "ignore_eos": True},
        {"prompt": [7, 99, 150, 3], "max_tokens": 1, "ignore_eos": True},
        {"prompt": "To be, or not to be", "max_tokens": 30, "ignore_eos": True, "temperature": 0, "stop": ["ther"]},
    ]:
        r = post(url, body)
        usages.append(r["usage"])
        reasons.append(r["choices"][0]["finish_reason"])
    events = stream(s.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 5, "ignore_eos": True,
                                                    "stream_options": {"include_usage": True}})
    usages.append(events[-1]["usage"])
    reasons.append("length")
    # n = 2: two engine requests; the metrics count each one's prompt (usage counts it once).
    r = post(url, {"prompt": "hello there", "n": 2, "max_tokens": 4, "ignore_eos": True, "seed": 3})
    reasons += ["length", "length"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert reasons[:3] == ["length", "length", "stop"]
    # The stop-string request's scheduler timings come with the engine's echo of its abort.
    wait_idle(s.url)
    after = metrics(s.url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    requests = len(reasons)
    gen = sum(u["completion_tokens"] for u in usages) + r["usage"]["completion_tokens"]
    assert delta("tandem:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages) + 2 * n_prompt
    assert delta("tandem:generation_tokens_total") == gen
    for reason in ("stop", "length", "abort", "error"):
        assert delta("tandem:request_success_total", finished_reason=reason) == reasons.count(reason)
    assert delta("tandem:time_to_first_token_seconds_count") == requests
    assert delta("tandem:e2e_request_latency_seconds_count") == requests
    assert delta("tandem:inter_token_latency_seconds_count") == gen - requests  # one sample per token
    assert delta("tandem:request_generation_tokens_count") == requests
    assert delta("tandem:request_generation_tokens_sum") == gen
    assert delta("tandem:request_queue_time_seconds_count") == requests
    # max_tokens 1 gives no TPOT sample
    assert delta("tandem:request_time_per_output_token_seconds_count") == requests - 1
    text = httpx.get(s.url + "/metrics").text
    assert "_created" not in text and "vllm:" not in text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "time_to_first_token_seconds_bucket", "e2e_request_latency_seconds_bucket"):
        assert f"tandem:{name}{{" in text


# ---------------------------------------------------------------------- 10. native and auxiliary endpoints


def test_generate_native(srv):
    path, s = srv
    prompt = "Once upon a time there was a little engine that served tokens all day long."
    ids = hf_ref.encode(path, prompt)
    assert len(ids) > 16  # at least one full KV page to cache
    ref = hf_ref.greedy(path, ids, 8, ignore_eos=True)
    assert httpx.post(s.url + "/flush_cache").status_code == 200
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    cached = []
    for _ in range(2):
        g = post(s.url + "/generate", {"text": prompt, "sampling_params": sp})
        m = g["meta_info"]
        assert g["text"] == hf_ref.decode(path, ref) and g["output_ids"] == ref
        assert (m["prompt_tokens"], m["completion_tokens"]) == (len(ids), 8)
        assert m["finish_reason"] == {"type": "length", "length": 8}
        assert m["e2e_latency"] > 0 and m["spec_verify_ct"] == 0
        cached.append(m["cached_tokens"])
    assert cached[0] == 0 and 16 <= cached[1] < len(ids), cached
    # stop string: matched is the string; streaming sends the cumulative text
    texts = hf_ref.prefix_texts(path, ref)
    stop = hf_ref.stop_case(path, ref, 2).stop
    want_text, want_n, _ = hf_ref.expected_stop(texts, [stop])
    g = post(s.url + "/generate", {"input_ids": ids, "sampling_params": {**sp, "stop": stop}})
    assert (g["text"], g["meta_info"]["finish_reason"]) == (want_text, {"type": "stop", "matched": stop})
    assert g["meta_info"]["completion_tokens"] == want_n
    events = stream(s.url + "/generate", {"input_ids": ids, "sampling_params": sp})
    seen = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])) and seen[-1] == hf_ref.decode(path, ref)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert events[-1]["output_ids"] == ref
    # sampled, with logprobs: raw-model logprobs of the tokens actually sampled
    g = post(s.url + "/generate", {"input_ids": ids, "return_logprob": True, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.8, "seed": 5, "ignore_eos": True}})
    rows = hf_ref.logprob_rows(path, ids + g["output_ids"])
    for i, (lp, tok, _) in enumerate(g["meta_info"]["output_token_logprobs"]):
        assert tok == g["output_ids"][i]
        assert lp == pytest.approx(float(rows[len(ids) - 1 + i, tok]), abs=ATOL)
    assert "input_token_logprobs" not in g["meta_info"]  # logprob_start_len defaults to -1


@pytest.mark.parametrize("start", [0, 5])
def test_generate_prompt_and_top_logprobs(srv, start):
    path, s = srv
    ids = hf_ref.encode(path, "The quick brown fox jumps")
    g = post(s.url + "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
                                   "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 3,
                                                                              "temperature": 0}})
    m, out = g["meta_info"], g["output_ids"]
    rows = hf_ref.logprob_rows(path, ids + out)

    def check_top(top, row):
        vals, top_ids = row.topk(2)
        assert [t for _, t, _ in top] == top_ids.tolist()
        assert [v for v, _, _ in top] == pytest.approx(vals.tolist(), abs=ATOL)

    for i, ((lp, tok, _), top) in enumerate(zip(m["output_token_logprobs"], m["output_top_logprobs"], strict=True)):
        assert tok == out[i] and lp == pytest.approx(float(rows[len(ids) - 1 + i, tok]), abs=ATOL)
        check_top(top, rows[len(ids) - 1 + i])
    assert [t for _, t, _ in m["input_token_logprobs"]] == ids[start:]
    assert len(m["input_top_logprobs"]) == len(ids) - start
    for j, ((lp, tok, _), top) in enumerate(zip(m["input_token_logprobs"], m["input_top_logprobs"]), start):
        if j == 0:
            assert lp is None and top is None
            continue
        assert lp == pytest.approx(float(rows[j - 1, tok]), abs=ATOL)
        check_top(top, rows[j - 1])


def test_tokenize_detokenize_and_info(srv):
    path, s = srv
    u = s.url
    ids = hf_ref.encode(path, "café 😀 hello")
    assert post(u + "/tokenize", {"prompt": "café 😀 hello"}) == {"count": len(ids), "max_model_len": 512,
                                                                 "tokens": ids}
    chat = hf_ref.encode(path, "<s><|user|>hi<|end|><|assistant|>")
    t = post(u + "/v1/tokenize", {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
    assert t["tokens"] == chat and len(t["token_strs"]) == len(chat)
    assert post(u + "/detokenize", {"tokens": chat})["prompt"] == "<s><|user|>hi<|end|><|assistant|>"
    assert post(u + "/v1/detokenize", {"tokens": ids})["prompt"] == "café 😀 hello"
    assert isinstance(httpx.get(u + "/version").json()["version"], str)
    info = httpx.get(u + "/server_info").json()
    assert info["engine_info"]["vocab_size"] == 384 and info["engine_info"]["max_context"] == 512
    assert info["max_total_num_tokens"] == info["engine_info"]["num_pages"] * info["engine_info"]["page_size"]
    assert info["avg_spec_accept_length"] is None and info["internal_states"][0]["avg_spec_accept_length"] is None
    assert httpx.get(u + "/get_server_info").json()["engine_info"] == info["engine_info"]
    assert httpx.get(u + "/health_generate", timeout=30).status_code == 200
    assert httpx.get(u + "/health").status_code == 200
    wait_idle(u)  # the running count is the scheduler's last report: the probe's idle one may still be on its way
    load = httpx.get(u + "/load").json()  # what routers poll (tandem router reads the last three)
    assert load["server_load"] == 0 and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert 0.0 <= load["kv_cache_usage_perc"] <= 1.0
    models = OpenAI(base_url=s.base_url, api_key="none", max_retries=0).models.list()
    assert [m.id for m in models.data] == [path]
    card = httpx.get(u + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 512 and card["object"] == "model" and card["owned_by"] == "tandem"
