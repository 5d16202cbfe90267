"""The OpenAI serving surface against a real `tandem serve` (Gemma 4 tiny checkpoint, CPU) and
HF transformers as the oracle: stop strings, n > 1, logprobs, echo + prompt logprobs, prompt
shapes, max_completion_tokens, skip_special_tokens, unknown fields.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from openai import OpenAI

from tests.e2e.api_util import engine_steps, metric, metrics, one_thread, post, stop_server, stream, wait_idle
from tests.helpers import hf_ref
from tests.helpers.server import Server

ATOL = 1e-4
STOP_PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def srv(ckpts):
    threads = one_thread()
    s = Server(ckpts["gemma4"])
    yield ckpts["gemma4"], s
    torch.set_num_threads(threads)
    stop_server(s)


def chat_ids(path: str, content: str) -> list[int]:
    # The checkpoint's template: "<s><|user|>{content}<|end|><|assistant|>"
    return hf_ref.encode(path, f"<s><|user|>{content}<|end|><|assistant|>")


def collect(events: list[dict], chat: bool = False) -> dict:
    """Per choice index: concatenated text, finish_reason, stop_reason; plus the usage chunk."""
    out: dict = {}
    for e in events:
        for c in e["choices"]:
            d = out.setdefault(c["index"], {"text": "", "finish_reason": None, "stop_reason": None, "lp": []})
            d["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            if c["finish_reason"] is not None:
                assert d["finish_reason"] is None, "two finish chunks"
                d["finish_reason"], d["stop_reason"] = c["finish_reason"], c.get("stop_reason")
            if c.get("logprobs"):
                d["lp"].append(c["logprobs"])
    usage = [e["usage"] for e in events if not e["choices"] and e.get("usage")]
    out["usage"] = usage[-1] if usage else None
    return out


def later_stop(full: str, after: int) -> str:
    """A 3-character printable ASCII string whose first occurrence starts at or after ``after``."""
    for i in range(after, len(full) - 2):
        s = full[i:i + 3]
        if s.isascii() and s.isprintable() and full.find(s) == i:
            return s
    raise AssertionError(full)


# ---------------------------------------------------------------------- 1. stop strings


def _check_stops(base: str, endpoint: str, body: dict, texts: list[str], stops: list[str], chat: bool):
    wait_idle(base)
    idle_kv = metric(metrics(base), "tandem:kv_cache_usage_perc")
    for include in (False, True):
        steps = engine_steps(base)
        want_text, want_n, want_stop = hf_ref.expected_stop(texts, stops, include)
        req = {**body, "stop": stops, "include_stop_str_in_output": include}
        r = post(base + endpoint, req)
        ch = r["choices"][0]
        got = ch["message"]["content"] if chat else ch["text"]
        assert (got, ch["finish_reason"], ch["stop_reason"]) == (want_text, "stop", want_stop), (stops, include)
        assert r["usage"]["completion_tokens"] == want_n
        s = collect(stream(base + endpoint, {**req, "stream_options": {"include_usage": True}}), chat)
        assert (s[0]["text"], s[0]["finish_reason"], s[0]["stop_reason"]) == (want_text, "stop", want_stop)
        assert s["usage"]["completion_tokens"] == want_n
        assert s["usage"]["prompt_tokens"] == r["usage"]["prompt_tokens"]
        # The scheduler really stopped at the stop (max_tokens is far away): idle again, and only
        # about as many engine steps as tokens were needed (two requests, a few steps of latency).
        wait_idle(base, timeout=2.0, idle_kv=idle_kv)
        assert engine_steps(base) - steps <= 2 * (want_n + 10)


def test_stop_strings_completions(srv):
    path, s = srv
    ids = hf_ref.encode(path, STOP_PROMPT)
    ref = hf_ref.greedy(path, ids, 40, ignore_eos=True)
    texts = hf_ref.prefix_texts(path, ref)
    case = hf_ref.stop_case(path, ref)
    assert case.n_tokens >= 2 and texts[case.n_tokens - 1].find(case.stop) < 0  # really straddles
    later = later_stop(texts[-1], case.start + len(case.stop))
    body = {"prompt": STOP_PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    base = s.url
    _check_stops(base, "/v1/completions", body, texts, [case.stop], chat=False)
    # The later-listed stop occurs first in the text: it wins; a stop that never occurs is harmless.
    _check_stops(base, "/v1/completions", body, texts, [later, "\u00a7never\u00a7", case.stop], chat=False)
    assert hf_ref.expected_stop(texts, [later, case.stop])[2] == case.stop


def test_stop_strings_chat(srv):
    path, s = srv
    ids = chat_ids(path, STOP_PROMPT)
    ref = hf_ref.greedy(path, ids, 40, ignore_eos=True)
    texts = hf_ref.prefix_texts(path, ref)
    case = hf_ref.stop_case(path, ref)
    body = {"messages": [{"role": "user", "content": STOP_PROMPT}], "max_tokens": 400, "temperature": 0,
            "ignore_eos": True}
    later = later_stop(texts[-1], case.start + len(case.stop))
    _check_stops(s.url, "/v1/chat/completions", body, texts, [later, case.stop], chat=True)


def test_stop_strings_multibyte(srv):
    """Stops made of characters whose UTF-8 bytes come from two tokens (the first decodes to
    U+FFFD on its own): matched on text, never on a half character, streamed without leaks."""
    path, s = srv
    prompt = "café naïve résumé Zürich — 日本語の"
    ref = hf_ref.greedy(path, hf_ref.encode(path, prompt), 30, ignore_eos=True)
    texts = hf_ref.prefix_texts(path, ref)
    wide = [c for c in texts[-1] if ord(c) > 127 and c != "\ufffd"]
    assert len(wide) >= 2, texts[-1]
    full = texts[-1]
    for stops in ([wide[0]], [full[full.index(wide[1]) - 1: full.index(wide[1]) + 1]]):
        for include in (False, True):
            want_text, want_n, want_stop = hf_ref.expected_stop(texts, stops, include)
            assert not texts[want_n - 1].endswith(want_stop)  # the last token completed the character
            body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": stops,
                    "include_stop_str_in_output": include}
            r = post(s.url + "/v1/completions", body)
            assert (r["choices"][0]["text"], r["choices"][0]["stop_reason"]) == (want_text, want_stop)
            assert r["usage"]["completion_tokens"] == want_n
            c = collect(stream(s.url + "/v1/completions", body))
            assert (c[0]["text"], c[0]["finish_reason"]) == (want_text, "stop")


def test_stop_token_ids_count_but_hide(srv):
    path, s = srv
    ids = hf_ref.encode(path, STOP_PROMPT)
    ref = hf_ref.greedy(path, ids, 12, ignore_eos=True)
    stop_id = ref[4]
    cut = ref.index(stop_id) + 1
    for include in (False, True):
        body = {"prompt": STOP_PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stop_token_ids": [stop_id], "include_stop_str_in_output": include}
        r = post(s.url + "/v1/completions", body)
        shown = ref[:cut] if include else ref[:cut - 1]
        assert r["choices"][0]["text"] == hf_ref.decode(path, shown)
        assert (r["choices"][0]["finish_reason"], r["choices"][0]["stop_reason"]) == ("stop", stop_id)
        assert r["usage"]["completion_tokens"] == cut


# ---------------------------------------------------------------------- 2. n > 1


def test_n_greedy_all_equal_hf(srv):
    path, s = srv
    prompts = ["Once upon a time", "hello there"]
    refs = [hf_ref.decode(path, hf_ref.greedy(path, hf_ref.encode(path, p), 10, ignore_eos=True))
            for p in prompts]
    body = {"prompt": prompts, "n": 3, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    r = post(s.url + "/v1/completions", body)
    # OpenAI's order: prompt-major, index = prompt * n + j.
    assert [c["index"] for c in r["choices"]] == list(range(6))
    assert [c["text"] for c in r["choices"]] == [refs[0]] * 3 + [refs[1]] * 3
    prompt_tokens = sum(len(hf_ref.encode(path, p)) for p in prompts)
    u = r["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (prompt_tokens, 60, prompt_tokens + 60)
    c = collect(stream(s.url + "/v1/completions", {**body, "stream_options": {"include_usage": True}}))
    assert [c[i]["text"] for i in range(6)] == [refs[0]] * 3 + [refs[1]] * 3
    assert c["usage"]["prompt_tokens"] == prompt_tokens and c["usage"]["completion_tokens"] == 60

    chat = {"messages": [{"role": "user", "content": "hello there"}], "n": 2, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    ids = chat_ids(path, "hello there")
    ref = hf_ref.decode(path, hf_ref.greedy(path, ids, 8, ignore_eos=True))
    r = post(s.url + "/v1/chat/completions", chat)
    assert [c["message"]["content"] for c in r["choices"]] == [ref, ref]
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 16


def test_n_sampled_with_seed(srv):
    path, s = srv
    body = {"prompt": "Once upon a time", "n": 4, "max_tokens": 16, "temperature": 1.0, "seed": 77,
            "ignore_eos": True}
    url = s.url + "/v1/completions"
    r = post(url, body)
    texts = [c["text"] for c in r["choices"]]
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert len(set(texts)) == 4, texts  # distinct samples
    assert r["usage"]["prompt_tokens"] == len(hf_ref.encode(path, "Once upon a time"))
    assert r["usage"]["completion_tokens"] == 64
    assert [c["text"] for c in post(url, body)["choices"]] == texts  # reproducible
    # Choice j is the request with seed + j (docs/http_api.md).
    single = post(url, {**body, "n": 1, "seed": 79})
    assert single["choices"][0]["text"] == texts[2]
    events = stream(url, {**body, "stream_options": {"include_usage": True}})
    c = collect(events)
    assert [c[i]["text"] for i in range(4)] == texts
    assert c["usage"]["completion_tokens"] == 64
    order = [ch["index"] for e in events for ch in e["choices"]]
    assert sorted(set(order)) == [0, 1, 2, 3]
    # interleaved by index, not one choice after the other
    assert max(i for i, x in enumerate(order) if x == 0) > min(i for i, x in enumerate(order) if x == 3)


# ---------------------------------------------------------------------- 3. logprobs


def _expected_top(path: str, row: torch.Tensor, chosen: int, k: int) -> dict:
    """The legacy completions top_logprobs dict: top-k by string (later wins, as the server does),
    plus the chosen token."""
    vals, ids = row.topk(k)
    top = {hf_ref.decode(path, [int(t)], False): float(v) for t, v in zip(ids, vals)}
    top.setdefault(hf_ref.decode(path, [chosen], False), float(row[chosen]))
    return top


def _check_completion_logprobs(path: str, lp: dict, ids: list[int], gen: list[int], k: int, first: int = 0):
    rows = hf_ref.logprob_rows(path, ids + gen)
    assert lp["tokens"][first:] == [hf_ref.decode(path, [t], False) for t in gen]
    for i, t in enumerate(gen):
        row = rows[len(ids) - 1 + i]
        assert lp["token_logprobs"][first + i] == pytest.approx(float(row[t]), abs=ATOL)
        want = _expected_top(path, row, t, k)
        got = lp["top_logprobs"][first + i]
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=ATOL), (i, key)
    offsets = lp["text_offset"]
    assert all(offsets[j + 1] - offsets[j] == len(lp["tokens"][j]) for j in range(len(offsets) - 1))


def test_completion_logprobs_match_hf(srv):
    path, s = srv
    prompt, k, n = "Once upon a time", 3, 12
    ids = hf_ref.encode(path, prompt)
    gen = hf_ref.greedy(path, ids, n, ignore_eos=True)
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": k}
    r = post(s.url + "/v1/completions", body)
    lp = r["choices"][0]["logprobs"]
    _check_completion_logprobs(path, lp, ids, gen, k)
    c = collect(stream(s.url + "/v1/completions", body))
    merged = {key: [x for part in c[0]["lp"] for x in part[key]] for key in ("tokens", "token_logprobs",
                                                                               "top_logprobs")}
    assert merged == {key: lp[key] for key in merged}


def test_chat_logprobs_match_hf(srv):
    path, s = srv
    k, n = 4, 10
    ids = chat_ids(path, "hello there")
    gen = hf_ref.greedy(path, ids, n, ignore_eos=True)
    rows = hf_ref.logprob_rows(path, ids + gen)
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": k}
    r = post(s.url + "/v1/chat/completions", body)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == n
    for i, (t, item) in enumerate(zip(gen, content)):
        row = rows[len(ids) - 1 + i]
        token = hf_ref.decode(path, [t], False)
        assert item["token"] == token and item["bytes"] == list(token.encode())
        assert item["logprob"] == pytest.approx(float(row[t]), abs=ATOL)
        vals, top_ids = row.topk(k)
        assert [x["logprob"] for x in item["top_logprobs"]] == pytest.approx(vals.tolist(), abs=ATOL)
        assert [x["token"] for x in item["top_logprobs"]] == [hf_ref.decode(path, [int(j)], False) for j in top_ids]
    c = collect(stream(s.url + "/v1/chat/completions", body), chat=True)
    assert [x for part in c[0]["lp"] for x in part["content"]] == content


# ---------------------------------------------------------------------- 4. echo + prompt logprobs


def _check_prompt_logprobs(path: str, lp: dict, ids: list[int]):
    rows = hf_ref.logprob_rows(path, ids)
    assert lp["tokens"][: len(ids)] == [hf_ref.decode(path, [t], False) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(rows[i - 1, ids[i]]), abs=ATOL), i
        want = _expected_top(path, rows[i - 1], ids[i], 1)
        assert lp["top_logprobs"][i] == pytest.approx(want, abs=ATOL)


def test_echo_prompt_logprobs_loglikelihood(srv):
    path, s = srv
    url = s.url + "/v1/completions"
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = hf_ref.encode(path, prompt)
    base = {"prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    r = post(url, {**base, "max_tokens": 0})
    ch = r["choices"][0]
    assert ch["text"] == prompt and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["tokens"]) == len(ids)
    _check_prompt_logprobs(path, ch["logprobs"], ids)
    assert (r["usage"]["prompt_tokens"], r["usage"]["completion_tokens"]) == (len(ids), 0)

    gen = hf_ref.greedy(path, ids, 1, ignore_eos=True)
    r = post(url, {**base, "max_tokens": 1, "ignore_eos": True})
    ch = r["choices"][0]
    assert ch["text"] == prompt + hf_ref.decode(path, gen)
    _check_prompt_logprobs(path, ch["logprobs"], ids)
    _check_completion_logprobs(path, ch["logprobs"], ids, gen, 1, first=len(ids))
    assert r["usage"]["completion_tokens"] == 1

    # Token-id prompt: the echo is the decoded prompt; the logprobs are the same.
    r = post(url, {**base, "prompt": ids, "max_tokens": 0})
    assert r["choices"][0]["text"] == hf_ref.decode(path, ids)
    _check_prompt_logprobs(path, r["choices"][0]["logprobs"], ids)

    # A batch (what lm-eval sends): one choice per prompt, each with its own prompt logprobs.
    batch = [prompt, "Once upon a time there was"]
    r = post(url, {**base, "prompt": batch, "max_tokens": 0})
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for c, p in zip(r["choices"], batch):
        assert c["text"] == p
        _check_prompt_logprobs(path, c["logprobs"], hf_ref.encode(path, p))

    # Streamed echo: the prompt comes first, then the completion.
    c = collect(stream(url, {**base, "max_tokens": 1, "ignore_eos": True}))
    assert c[0]["text"] == prompt + hf_ref.decode(path, gen)


def test_prefix_cache_hits_keep_results_exact(srv):
    """A prompt of several KV pages, cached by a first request: the usage reports the hit, and
    greedy text and prompt logprobs (which must recompute the whole prompt) stay exact."""
    path, s = srv
    url = s.url + "/v1/completions"
    prompt = "Once upon a time there was a little engine that served tokens all day long. " * 2
    ids = hf_ref.encode(path, prompt)
    assert len(ids) > 32
    ref = hf_ref.decode(path, hf_ref.greedy(path, ids, 6, ignore_eos=True))
    assert httpx.post(s.url + "/flush_cache").status_code == 200
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    first, second = post(url, body), post(url, body)
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == ref
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 32 <= second["usage"]["prompt_tokens_details"]["cached_tokens"] < len(ids)
    r = post(url, {**body, "max_tokens": 0, "echo": True, "logprobs": 1})
    _check_prompt_logprobs(path, r["choices"][0]["logprobs"], ids)


# ---------------------------------------------------------------------- 6. prompt shapes and options


def test_prompt_shapes(srv):
    path, s = srv
    url = s.url + "/v1/completions"
    strs = ["hello there", "Once upon a time"]
    id_lists = [hf_ref.encode(path, "numbers 0123"), [7, 99, 150, 3, 42]]
    refs = {tuple(ids): hf_ref.decode(path, hf_ref.greedy(path, ids, 6, ignore_eos=True))
            for ids in [hf_ref.encode(path, p) for p in strs] + id_lists}
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = post(url, {**body, "prompt": strs})
    assert [c["text"] for c in r["choices"]] == [refs[tuple(hf_ref.encode(path, p))] for p in strs]
    r = post(url, {**body, "prompt": id_lists[1]})
    assert r["choices"][0]["text"] == refs[tuple(id_lists[1])]
    assert r["usage"]["prompt_tokens"] == 5
    r = post(url, {**body, "prompt": id_lists})
    assert [c["text"] for c in r["choices"]] == [refs[tuple(x)] for x in id_lists]
    assert r["usage"]["prompt_tokens"] == sum(map(len, id_lists))
    # Unknown fields are ignored, whatever their shape.
    extra = {"best_of": 1, "frobnicate": {"a": [1, None]}, "logit_bias": {}, "user": "u", "x-y": None}
    r = post(url, {**body, "prompt": strs[0], **extra})
    assert r["choices"][0]["text"] == refs[tuple(hf_ref.encode(path, strs[0]))]


def test_chat_max_completion_tokens_and_special_tokens(srv):
    path, s = srv
    client = OpenAI(base_url=s.base_url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=path, messages=msgs, max_completion_tokens=5, max_tokens=9,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (5, "length")
    # A prompt whose greedy continuation has special tokens (<|user|>, id 3) in it.
    ids = hf_ref.encode(path, "Once upon a time")
    ref = hf_ref.greedy(path, ids, 16, ignore_eos=True)
    assert 3 in ref
    kw = dict(model=path, prompt="Once upon a time", max_tokens=16, temperature=0)
    shown = client.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert shown.choices[0].text == hf_ref.decode(path, ref, skip_special_tokens=False)
    assert "<|user|>" in shown.choices[0].text
    hidden = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert hidden.choices[0].text == hf_ref.decode(path, ref) and "<|user|>" not in hidden.choices[0].text
    chunks = client.completions.create(**kw, stream=True,
                                       extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert "".join(c.choices[0].text for c in chunks) == shown.choices[0].text
