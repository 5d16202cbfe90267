"""L2 warm-up of the next projection's weights on the GPU (weight_prefetch.py, kernels/l2_warm.py):
the read kernel at a real projection's size gives its torch reference with both eviction hints,
and an engine at Llama-8B widths, whose decode graphs fork the warm-ups on a side branch,
decodes exactly (tokens and logprobs) what it decodes with the warm-ups off."""

from __future__ import annotations

from functools import reduce

import numpy as np
import pytest
import torch

from gpu_worker import weight_prefetch as WP
from gpu_worker.kernels import l2_warm as L2
from tests.gpu.test_gpu_decode_chain import PROMPTS, _llama_8b_width, _run


@pytest.mark.parametrize("evict_last", [True, False])
def test_warm_kernel_at_o_proj_size(evict_last):
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.full((WP.PROGRAMS,), -7, dtype=torch.int32, device="cuda")
    budget = 32 << 20
    assert L2.warm_l2(w, budget, out, evict_last=evict_last)
    words = L2.warm_words(w, budget)
    programs, chunk = L2.plan(words.numel(), WP.PROGRAMS)
    if evict_last:  # prefetches return nothing: each program stores 0
        assert out[:programs].tolist() == [0] * programs
        return
    a = words.cpu().numpy()
    want = [int(reduce(np.bitwise_xor, a[p * chunk:(p + 1) * chunk], np.int32(0))) for p in range(programs)]
    assert out[:programs].tolist() == want


def test_engine_decodes_the_same_with_and_without_warm_ups(tmp_path, monkeypatch):
    d = _llama_8b_width(str(tmp_path), 14336)
    runs = []
    for mb, evict in (("32,8", "last"), ("32", "normal"), ("0", "normal")):
        monkeypatch.setenv("TANDEM_L2_PREFETCH_MB", mb)
        monkeypatch.setenv("TANDEM_L2_PREFETCH_EVICT", evict)
        before = WP.launched_total()
        eng = _run(d, overlap=True, logprobs=2)
        launched = WP.launched_total() - before
        assert (launched > 0) == (mb != "0"), launched  # the graphs forked warm-ups only when on
        runs.append([[(o.token_ids, o.logprobs) for o in eng.outputs[f"r{i}"]] for i in range(len(PROMPTS))])
        del eng
        torch.cuda.empty_cache()
    assert runs[0] == runs[1] == runs[2]
