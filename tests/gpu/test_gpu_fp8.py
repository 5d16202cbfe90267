"""FP8 on CUDA. The kernels against their torch references at Llama-8B's projection shapes, and
inside a CUDA graph; then the engine with CUDA graphs: weight-only FP8 equals HF (float32 on the
GPU) run on the dequantized checkpoint, token for token; MTP with an FP8 target, an FP8
assistant and the FP8 KV cache is lossless against the same engine without MTP; in bf16 at 8B
widths the FP8 engine's graphs decode its eager tokens up to near-ties, and so does the
flashinfer backend reading the FP8 KV cache. (The CPU twin of each: tests/unit/gpu_worker/test_engine_fp8.py;
tests/unit/gpu_worker/kernels/test_kernels_fp8.py and test_kv_fp8.py also run here on CUDA.)"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.fp8_linear import fp8_linear
from gpu_worker.kernels.fp8_quant import quantize_acts
from gpu_worker.quant.fp8_math import BLOCK, dequantize, qdq_acts, quantize_groups, quantize_rows
from tests.gpu.test_gpu_decode_chain import PROMPTS as WIDE_PROMPTS
from tests.gpu.test_gpu_decode_chain import _assert_tracks, _llama_8b_width
from tests.gpu.test_gpu_parity import PROMPTS, hf_greedy_cuda
from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama
from tests.helpers.fp8_checkpoints import dequantized, quantize_checkpoint
from tests.helpers.inproc import InProcEngine

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down (split K)


def _weight(n: int, k: int, layout: str):
    w = torch.randn(n, k, device="cuda") * 0.02
    if layout == "channel":
        w8, s = quantize_rows(w)
        return w8, s, 1
    s = torch.rand(-(-n // BLOCK), -(-k // BLOCK), device="cuda") / 2000 + 1e-4
    full = s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), s, BLOCK


def _close(y: torch.Tensor, x, w8, s, rows, acts) -> None:
    ref = (qdq_acts(x, acts, None).double() @ dequantize(w8, s, rows).double().t()).float()
    tol = ref.abs() * 2.0**-7 + 2e-3 * ref.abs().max()
    assert ((y.float() - ref).abs() <= tol).all(), ((y.float() - ref).abs() - tol).max().item()


@pytest.mark.parametrize("acts", ["none", "dynamic"])
@pytest.mark.parametrize("layout", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 4, 64, 1024])
def test_fp8_linear_at_8b_shapes(m, layout, acts):
    """The one-row GEMV (split K through down), the GEMM (4, 64, 1024 rows): within a bf16
    rounding of the exact products."""
    torch.manual_seed(m)  # a failure reproduces
    for n, k in SHAPES_8B:
        w8, s, rows = _weight(n, k, layout)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        _close(fp8_linear(x, w8, s, rows, acts), x, w8, s, rows, acts)
        del w8
    torch.cuda.empty_cache()


def test_activation_quantization_is_bitwise_the_reference_on_cuda():
    x = torch.randn(300, 14336, device="cuda").to(torch.bfloat16) * 3
    q, s = quantize_acts(x)
    rq, rs = quantize_groups(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_fp8_linears_replay_in_a_cuda_graph():
    """Captured once, replayed on fresh inputs: the eager bits every time (split-K tickets,
    activation scales and the GEMM's workspace all rewritten in place)."""
    w8, s, _ = _weight(4096, 14336, "channel")
    gu8, gs, _ = _weight(28672, 4096, "channel")
    xs = {m: torch.zeros(m, 14336, device="cuda", dtype=torch.bfloat16) for m in (1, 4, 64, 256)}
    hs = {m: torch.zeros(m, 4096, device="cuda", dtype=torch.bfloat16) for m in xs}

    def step():
        return {m: (fp8_linear(xs[m], w8, s, 1, "dynamic"), fp8_linear(hs[m], gu8, gs, 1, "dynamic")) for m in xs}

    step()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        for m in xs:
            xs[m].copy_(torch.randn_like(xs[m], dtype=torch.float32))
            hs[m].copy_(torch.randn_like(hs[m], dtype=torch.float32))
        graph.replay()
        eager = step()
        for m in xs:
            assert torch.equal(out[m][0], eager[m][0]) and torch.equal(out[m][1], eager[m][1])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_gpu")
    llama = build_llama(str(root / "llama"), hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                        initializer_range=0.04)
    g = build_gemma4(str(root / "gemma4"))
    return {"llama": llama, "gemma4": g, "assistant": build_assistant(str(root / "assistant"), g), "root": root}


def _tokens(path, draft=None, prompts=PROMPTS, new=24, **kw) -> list[list[int]]:
    eng = InProcEngine(path, draft=draft, device="cuda", chunked_prefill_size=16, max_total_tokens=65536, **kw)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=new, ignore_eos=True)
    eng.run()
    return [eng.tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("arch,layout", [("llama", "ct-channel"), ("llama", "ct-block"), ("gemma4", "ct-channel")])
def test_weight_only_fp8_is_hf_on_the_dequantized_weights_with_graphs(ckpts, arch, layout):
    q = quantize_checkpoint(ckpts[arch], str(ckpts["root"] / f"{arch}-{layout}"), layout, acts="none")
    got = _tokens(q, dtype="float32")
    assert got == [hf_greedy_cuda(dequantized(q), p, 24) for p in PROMPTS]


def test_mtp_with_fp8_target_assistant_and_kv_is_lossless_with_graphs(ckpts):
    kw = dict(dtype="float32", quantization="fp8", kv_cache_dtype="fp8_e4m3")
    plain = _tokens(ckpts["gemma4"], prompts=PROMPTS * 4, **kw)
    assert _tokens(ckpts["gemma4"], draft=ckpts["assistant"], prompts=PROMPTS * 4, **kw) == plain


def _wide(d, **kw) -> InProcEngine:
    kw = {"quantization": "fp8", **kw}
    eng = InProcEngine(d, device="cuda", dtype="bfloat16", load_format="dummy",
                       kv_cache_dtype="fp8_e4m3", tokenizer_path="models/tiny-shakespeare/target",
                       max_total_tokens=8192, max_running_requests=4, cuda_graph_max_bs=4, **kw)
    for i, p in enumerate(WIDE_PROMPTS):
        # dummy weights at 8B width give flat distributions (top logprob ~-6.4): a near-tie can
        # hold more than two tokens, so the check reads five alternatives
        eng.submit(f"r{i}", p, max_new_tokens=24, ignore_eos=True, logprobs=5)
    eng.run()
    return eng


def test_bf16_fp8_engine_at_8b_width_graphs_track_eager(tmp_path):
    d = _llama_8b_width(str(tmp_path), 14336)
    _assert_tracks(_wide(d), _wide(d, disable_cuda_graph=True))


def test_flashinfer_reads_the_fp8_kv_cache(tmp_path):
    """FlashInfer's decode over the FP8 pool tracks triton's. bf16 weights: with FP8 activations
    a 1e-3 difference in an attention output can flip an activation's e4m3 rounding, a jump of
    one e4m3 step (1/8 of its value), so two W8A8 engines part at ties far wider than the near-tie bound (the
    kernels themselves: ``test_gpu_flashinfer.py``, both within 1e-3 of fp32 over the FP8 pool)."""
    pytest.importorskip("flashinfer")
    d = _llama_8b_width(str(tmp_path), 4096)
    kw = dict(quantization=None)
    _assert_tracks(_wide(d, attention_backend="flashinfer", **kw), _wide(d, attention_backend="triton", **kw))
