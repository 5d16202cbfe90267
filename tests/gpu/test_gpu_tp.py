"""TP=2 on two GPUs (NCCL): greedy tokens equal TP=1 on one GPU (float32), in-process through
the scheduler + runner for Llama, Qwen3, Gemma 4 and Gemma 4 + MTP, and through a real
`tandem serve --tp-size 2` against HF transformers. Skipped with fewer than two CUDA devices."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI
from tokenizers import Tokenizer

from tests.gpu.test_gpu_parity import hf_greedy_cuda
from tests.helpers.server import Server
from tests.helpers.tp import ENGINE_CASES, engine_tokens, rank_tokens, run_ranks
from tests.unit.test_tp_parity import tp_checkpoints

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nvidia-h200-x2)")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tp_checkpoints(tmp_path_factory.mktemp("gpu_tp_ckpts"))


@pytest.fixture(scope="module")
def ranks(ckpts):
    return run_ranks(rank_tokens, 2, ckpts, "cuda", device="cuda", timeout=600)


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_tp2_greedy_equals_tp1_cuda(ckpts, ranks, case):
    model, draft = ENGINE_CASES[case]
    ref = engine_tokens(ckpts[model], ckpts[draft] if draft else None, "cuda")
    assert ranks[0][case] == ranks[1][case], "ranks sampled different tokens"
    greedy = {rid: t for rid, t in ref.items() if rid.startswith("g")}
    assert {rid: ranks[0][case][rid] for rid in greedy} == greedy


@pytest.mark.parametrize("mtp", [False, True])
def test_server_tp2_parity_cuda(ckpts, mtp):
    d = ckpts["gemma4"]
    extra = ["--speculative-algorithm", "FROZEN-KV-MTP", "--speculative-draft-model-path", ckpts["assistant"]] \
        if mtp else []
    tok = Tokenizer.from_file(f"{d}/tokenizer.json")
    with Server(d, "--dtype", "float32", "--tp-size", "2", *extra, device="cuda") as srv:
        client = OpenAI(base_url=srv.base_url, api_key="x")
        for p in ([5, 17, 33, 99, 120, 7, 8, 9, 10, 11] * 3, [4, 5, 6], list(range(10, 60))):
            r = client.completions.create(model=d, prompt=p, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == tok.decode(hf_greedy_cuda(d, p, 16), skip_special_tokens=True)
    assert srv.proc.returncode == 0
