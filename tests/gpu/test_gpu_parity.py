"""The CPU parity tests again on CUDA, where non_blocking copies, events and stream order are
real: greedy tokens equal HF transformers (float32 on the GPU), with and without overlap (depth
1, 2, 3) and frozen-KV MTP, through the in-process engine and through a real `tandem serve`."""

from __future__ import annotations

import functools

import pytest
import torch
from openai import OpenAI

from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama, build_qwen3
from tests.helpers.inproc import InProcEngine
from tests.helpers.server import Server

PROMPTS = [[5, 17, 33, 99, 120, 7, 8, 9, 10, 11] * 3, [4, 5, 6], list(range(10, 60)), [200] * 40]


@functools.lru_cache(maxsize=8)
def _hf_cuda(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=512)
def _hf_greedy_cuda(model_dir, prompt, n):
    model = _hf_cuda(model_dir)
    ids = torch.tensor([list(prompt)], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def hf_greedy_cuda(model_dir, prompt, n):
    return _hf_greedy_cuda(model_dir, tuple(prompt), n)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_ckpts")
    g = build_gemma4(str(root / "gemma4"))
    return {
        "llama": build_llama(str(root / "llama")),
        "qwen3": build_qwen3(str(root / "qwen3")),
        "gemma4": g,
        "assistant": build_assistant(str(root / "assistant"), g),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma4"])
@pytest.mark.parametrize("overlap", [True, False])
def test_inproc_parity_cuda(ckpts, arch, overlap):
    d = ckpts[arch]
    eng = InProcEngine(d, overlap=overlap, device="cuda", dtype="float32", chunked_prefill_size=16,
                       max_total_tokens=65536)
    for i, p in enumerate(PROMPTS):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
    eng.run()
    for i, p in enumerate(PROMPTS):
        assert eng.tokens[f"r{i}"] == hf_greedy_cuda(d, p, 24), (arch, i)


@pytest.mark.parametrize("overlap", [True, False])
def test_inproc_mtp_parity_cuda(ckpts, overlap):
    d = ckpts["gemma4"]
    eng = InProcEngine(d, draft=ckpts["assistant"], steps=3, overlap=overlap, device="cuda", dtype="float32",
                       chunked_prefill_size=16, max_total_tokens=65536)
    for i, p in enumerate(PROMPTS * 8):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
    eng.run()
    for i, p in enumerate(PROMPTS * 8):
        assert eng.tokens[f"r{i}"] == hf_greedy_cuda(d, p, 24), i


@pytest.mark.parametrize("mtp", [False, True])
def test_inproc_parity_cuda_depth2(ckpts, mtp):
    """``--overlap-depth 2`` (the tests above run the default, 3): two steps launched before the
    oldest result is read."""
    d = ckpts["gemma4"]
    eng = InProcEngine(d, draft=ckpts["assistant"] if mtp else None, steps=3, depth=2, device="cuda",
                       dtype="float32", chunked_prefill_size=16, max_total_tokens=65536)
    for i, p in enumerate(PROMPTS * 4):
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True)
    eng.run()
    for i, p in enumerate(PROMPTS * 4):
        assert eng.tokens[f"r{i}"] == hf_greedy_cuda(d, p, 24), i


@pytest.mark.parametrize("mtp", [False, True])
def test_server_parity_cuda(ckpts, mtp):
    d = ckpts["gemma4"]
    extra = ["--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-draft-model-path", ckpts["assistant"]] \
        if mtp else []
    with Server(d, "--dtype", "float32", *extra, device="cuda") as srv:
        client = OpenAI(base_url=srv.base_url, api_key="x")
        for p in PROMPTS:
            r = client.completions.create(model=d, prompt=p, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
            ref = hf_greedy_cuda(d, p, 16)
            assert r.usage.completion_tokens == 16
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(f"{d}/tokenizer.json")
            assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
