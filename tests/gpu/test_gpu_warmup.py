"""The start-up prefill warm-up on CUDA: no slot state or real page touched, tokens still equal
HF's (float32 on the GPU)."""

from __future__ import annotations

import pytest

from tests.gpu.test_gpu_parity import hf_greedy_cuda
from tests.unit.gpu_worker.graphs.test_worker_warmup import check_warmup


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_warmup_on_cuda(tmp_path, arch):
    check_warmup(str(tmp_path / arch), arch, "triton", "cuda", hf=hf_greedy_cuda)
