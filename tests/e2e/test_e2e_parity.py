"""Real `tandem serve` processes against HF transformers greedy output (float32, CPU).

For each architecture: completions and chat, streamed and not, token-identical text to HF
`generate`, usage counts, and a clean SIGTERM exit.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from tests.helpers.checkpoints import hf_greedy
from tests.helpers.server import Server

PROMPTS = [
    "The quick brown fox",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings",
    "café 😀",
]


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma4"])
def served(request, ckpts):
    path = ckpts[request.param]
    srv = Server(path)
    yield request.param, path, srv
    start = time.monotonic()
    code = srv.stop(timeout=20)
    assert code == 0, srv.output()
    assert time.monotonic() - start < 20


def _client(srv) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)


def test_greedy_matches_hf_stream_and_not(served):
    arch, path, srv = served
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    client = _client(srv)
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        ref = hf_greedy(path, ids, 24)
        ref_text = tok.decode(ref, skip_special_tokens=True)
        r = client.completions.create(model=path, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == ref_text, (arch, prompt)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == len(ref)
        assert r.usage.total_tokens == len(ids) + len(ref)
        assert r.choices[0].finish_reason == ("length" if len(ref) == 24 else "stop")
        chunks = list(client.completions.create(model=path, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref_text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref)


def test_token_id_prompt_matches_hf(served):
    arch, path, srv = served
    ids = [7, 99, 150, 3, 42, 200, 201, 17, 17, 17]
    ref = hf_greedy(path, ids, 16, ignore_eos=True)
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    r = _client(srv).completions.create(model=path, prompt=ids, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.completion_tokens == 16


def test_chat_matches_hf(served):
    arch, path, srv = served
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    # The checkpoint's template: "<s><|user|>hello there<|end|><|assistant|>"
    ids = tok.encode("<s><|user|>hello there<|end|><|assistant|>").ids
    ref = hf_greedy(path, ids, 12)
    r = _client(srv).chat.completions.create(model=path, messages=[{"role": "user", "content": "hello there"}],
                                             max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)


@pytest.mark.parametrize("flags", [["--overlap-depth", "2"], ["--disable-overlap-schedule"]],
                         ids=["depth2", "no-overlap"])
def test_greedy_matches_hf_at_other_overlap_depths(ckpts, flags):
    """The fixture above serves at the default depth (3); the other depths give the same tokens,
    several requests at once so that steps hold more than one row."""
    path = ckpts["llama"]
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    srv = Server(path, *flags)
    try:
        client = _client(srv)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: client.completions.create(model=path, prompt=p, max_tokens=24,
                                                                    temperature=0).choices[0].text, PROMPTS))
        for prompt, text in zip(PROMPTS, got):
            ref = hf_greedy(path, tok.encode(prompt).ids, 24)
            assert text == tok.decode(ref, skip_special_tokens=True), (flags, prompt)
    finally:
        assert srv.stop(timeout=20) == 0, srv.output()
