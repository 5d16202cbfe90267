"""Final-logit softcapping in one kernel (kernels/softcap.py) against torch's float copy, divide,
tanh and multiply: model dtypes in, float32 out, rows that are a strided view (the decode rows
after the prefill rows), a ragged vocabulary over several blocks, logits large enough to
saturate; no cap is the float copy; the torch path where Triton does not run. Compiled on the
GPU the kernel is bitwise torch (tests/gpu/test_gpu_step_inputs.py); the interpreter has no
libdevice and writes tanh with exp, so here within 1e-5 of values below 30, argmax equal."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.kernels.softcap import BLOCK, softcap_float, softcap_reference

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 300), (4, 2 * BLOCK + 17)])
def test_kernel_equals_torch(dtype, rows, vocab):
    g = torch.Generator().manual_seed(rows + vocab)
    full = (torch.randn(rows + 2, vocab, generator=g) * 40).to(dtype).to(DEV)
    full[-1, 5] = 900.0  # saturates: tanh -> 1
    x = full[2:]  # a view past two prefill rows
    enable_cpu_kernels(True)
    try:
        got = softcap_float(x, 30.0)
    finally:
        enable_cpu_kernels(False)
    want = softcap_reference(x, 30.0)
    assert got.dtype == torch.float32 and got.shape == (rows, vocab) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)  # |values| < 30
    assert torch.equal(got.argmax(-1), want.argmax(-1)) and got.abs().max() <= 30.0


def test_no_cap_torch_path_and_empty():
    x = torch.randn(3, 50, dtype=torch.bfloat16)
    assert torch.equal(softcap_float(x, None), x.float())
    assert torch.equal(softcap_float(x, 30.0), torch.tanh(x.float() / 30.0) * 30.0)  # kernels off
    enable_cpu_kernels(True)
    try:
        assert softcap_float(x[:0], 30.0).shape == (0, 50)
    finally:
        enable_cpu_kernels(False)
