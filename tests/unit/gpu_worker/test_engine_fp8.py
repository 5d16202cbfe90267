"""FP8 weights and the FP8 KV cache through the scheduler + worker (in-process, CPU twin).

Tiny random checkpoints are quantized here into both FP8 layouts (tests/helpers/fp8_checkpoints.py).
Weight-only FP8 is HF transformers run on the dequantized checkpoint, token for token. Dynamic
and static activation quantization, online FP8 and the FP8 KV cache are compared with the same
engine on the unquantized checkpoint: greedy agreement and the largest log-probability error of
the reference continuation (teacher-forced, from prompt logprobs) are printed and bounded. MTP
with an FP8 target, an FP8 assistant and the FP8 KV cache is lossless against the same engine
without MTP. An unsupported method stops the worker at start with one line naming it.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from gpu_worker.models.loader import load_model
from common.args import ServerArgs
from proto.transport import ipc_endpoints, make_run_dir
from tests.helpers.checkpoints import build_assistant, build_gemma4, build_llama, hf_greedy
from tests.helpers.fp8_checkpoints import dequantized, quantize_checkpoint
from tests.helpers.fp8_compare import NEW, PROMPTS, generate, compare, fp8_bound
from tests.helpers.inproc import InProcEngine

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    # wide enough for several 128 x 128 blocks, a partial last block (320), and 128-row groups
    llama = build_llama(str(root / "llama"), hidden_size=256, intermediate_size=320, num_hidden_layers=2,
                        initializer_range=0.04)  # logits away from flat: greedy is not a coin toss
    g = build_gemma4(str(root / "g"))
    return {"llama": llama, "gemma4": g, "assistant": build_assistant(str(root / "a"), g), "root": root}


@pytest.mark.parametrize("arch,layout", [("llama", "ct-channel"), ("llama", "ct-tensor"), ("llama", "ct-block"),
                                         ("gemma4", "ct-channel")])
def test_weight_only_fp8_is_hf_on_the_dequantized_weights(models, arch, layout):
    q = quantize_checkpoint(models[arch], str(models["root"] / f"{arch}-{layout}"), layout, acts="none")
    want = [hf_greedy(dequantized(q), p, NEW, ignore_eos=True) for p in PROMPTS]
    assert generate(q) == want
    m = load_model(q, torch.float32, "cpu")
    attn = m.model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and attn.o_proj.quant is not None
    assert m.lm_head_weight().dtype == torch.float32  # heads and embeddings stay unquantized


def test_weight_only_fp8_on_the_kernel_path(models):
    """The same through the Triton kernels (interpreter): the FP8 GEMV for decode rows and the
    FP8 GEMM for prefill sum the same exact products in another order."""
    q = quantize_checkpoint(models["llama"], str(models["root"] / "llama-k"), "ct-block", acts="none")
    want = [hf_greedy(dequantized(q), p, 6, ignore_eos=True) for p in PROMPTS[:3]]
    assert generate(q, PROMPTS[:3], 6, attention_backend="triton") == want


@pytest.mark.parametrize("layout,acts", [("block", "dynamic"), ("ct-channel", "dynamic"), ("ct-channel", "static")])
def test_activation_quantization_tracks_the_unquantized_model(models, layout, acts):
    q = quantize_checkpoint(models["llama"], str(models["root"] / f"llama-{layout}-{acts}"), layout, acts)
    compare(models["llama"], q, fp8_bound(models["llama"], "llama"), f"{layout} weights, {acts} activations vs float32 (llama)")


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_online_fp8_and_fp8_kv_track_the_unquantized_model(models, arch):
    bound = fp8_bound(models[arch], arch)
    compare(models[arch], models[arch], bound, f"online FP8 vs float32 ({arch})", quantization="fp8")
    compare(models[arch], models[arch], bound, f"FP8 KV cache vs float32 ({arch})", kv_cache_dtype="fp8_e4m3")


def test_checkpoint_kv_scales_are_used(models, caplog):
    """k / v scales stored in the checkpoint reach the pool; the engine still tracks float32."""
    q = quantize_checkpoint(models["llama"], str(models["root"] / "llama-kv"), "ct-channel", "none",
                            kv_scales={0: (0.05, 0.02), 1: (0.04, 0.03)})
    with caplog.at_level(logging.INFO, logger="tandem.worker"):
        eng = InProcEngine(q, page_size=4, kv_cache_dtype="fp8_e4m3")
    pool = eng.runner.backend.pool
    assert pool.k_scale == pytest.approx([0.05, 0.04]) and pool.v_scale == pytest.approx([0.02, 0.03])
    assert any("k/v scales from the checkpoint for 2 of 2 layers" in r.message for r in caplog.records)
    assert eng.ready.kv_cache_dtype == "float8_e4m3fn"
    compare(dequantized(q), q, fp8_bound(models["llama"], "llama"), "FP8 KV with checkpoint scales (llama)",
            kv_cache_dtype="fp8_e4m3")


def test_fp8_kv_holds_twice_the_tokens(models, monkeypatch):
    """Half the bytes a token, so the same memory budget sizes twice the pages (the GPU rule,
    with the card's memory stubbed)."""
    from gpu_worker.sizing import plan_capacity

    m = load_model(models["llama"], torch.bfloat16, "cpu", load_format="dummy")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 << 30, 80 << 30))
    args = ServerArgs(model_path=models["llama"], context_length=256)
    pages = {dt: plan_capacity(args, m, torch.device("cuda"), dt, 1, 256).num_pages - 1
             for dt in (torch.bfloat16, torch.float8_e4m3fn)}
    assert pages[torch.float8_e4m3fn] in (2 * pages[torch.bfloat16], 2 * pages[torch.bfloat16] + 1)
    eng = InProcEngine(models["llama"], page_size=4, kv_cache_dtype="fp8_e4m3", dtype="bfloat16")
    plain = InProcEngine(models["llama"], page_size=4, dtype="bfloat16")
    assert eng.ready.kv_bytes_per_token * 2 == plain.ready.kv_bytes_per_token
    assert eng.runner.backend.pool.k[0].dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mtp_with_fp8_target_assistant_and_kv_is_lossless(models, backend, monkeypatch):
    """Greedy with MTP == greedy without, both FP8 (online: the assistant is quantized too) with
    the FP8 KV cache; the triton case runs the CUDA-graph decode path emulated."""
    if backend == "triton":
        monkeypatch.setenv("TANDEM_EMULATE_CUDA_GRAPHS", "1")
    kw = dict(quantization="fp8", kv_cache_dtype="fp8_e4m3", attention_backend=backend, cuda_graph_bs=(1, 2, 4))
    prompts, new = (PROMPTS, NEW) if backend == "torch" else (PROMPTS[1:3], 5)
    plain = generate(models["gemma4"], prompts, new, **kw)
    eng = InProcEngine(models["gemma4"], draft=models["assistant"], page_size=4, chunked_prefill_size=32, **kw)
    assert eng.runner.assistant.pre_projection.quant is not None
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new_tokens=new, ignore_eos=True)
    eng.run()
    assert [eng.tokens[f"r{i}"] for i in range(len(prompts))] == plain


def _write_config(src: str, dst, **extra) -> str:
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if os.path.isfile(os.path.join(src, f)):
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    os.remove(os.path.join(dst, "config.json"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(extra)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_unsupported_quantization_stops_the_worker_with_one_line(models, caplog):
    from gpu_worker.main import run

    bad = _write_config(models["llama"], models["root"] / "awq", quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 128})
    args = ServerArgs(model_path=bad, device="cpu", log_level="warning")
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_info:
        run(args, ipc_endpoints(make_run_dir()))
    assert exit_info.value.code == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0] and "'awq'" in errors[0] and "not supported" in errors[0]


@pytest.mark.parametrize("qc,words", [
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}},
     "4-bit int"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
])
def test_unsupported_formats_name_what_is_wrong(models, qc, words):
    bad = _write_config(models["llama"], models["root"] / f"bad-{abs(hash(str(qc)))}", quantization_config=qc)
    with pytest.raises(ValueError, match="quantization_config") as err:
        load_model(bad)
    assert words in str(err.value)


def test_float8_weights_without_a_config_are_refused(models):
    q = quantize_checkpoint(models["llama"], str(models["root"] / "noconfig"), "ct-channel", "none")
    cfg_path = os.path.join(q, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="float8 weights .* no quantization_config"):
        load_model(q)
    with pytest.raises(ValueError, match="--quantization compressed-tensors"):
        load_model(models["llama"], quantization="compressed-tensors")


def test_the_flag_names_the_methods_the_worker_serves():
    from common.args import QUANTIZATION_METHODS as FLAG_METHODS
    from gpu_worker.quant import QUANTIZATION_METHODS

    assert FLAG_METHODS == QUANTIZATION_METHODS


def test_flashinfer_backend_reads_the_fp8_kv_cache(ckpts, monkeypatch):
    """Decode rows through FlashInfer's decode wrapper (CPU stand-in: it checks the planned KV
    dtype and applies the k / v scales as the real kernel does), extend rows through triton:
    the tokens of the torch backend on the same FP8 pool."""
    import sys

    from gpu_worker.attention import flashinfer_backend as fib
    from tests.helpers import fake_flashinfer

    want = generate(ckpts["llama"], PROMPTS[:3], 5, kv_cache_dtype="fp8_e4m3")
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    monkeypatch.setattr("gpu_worker.main.resolve_backend", lambda name, dev: "flashinfer")
    monkeypatch.setattr(fib, "FI_DTYPES", fib.FI_DTYPES + (torch.float32,))
    monkeypatch.setattr(fib, "FI_HEAD_DIMS", (16,))  # the test models' heads
    eng = InProcEngine(ckpts["llama"], page_size=4, chunked_prefill_size=32, kv_cache_dtype="fp8_e4m3",
                       attention_backend="triton")
    for i, p in enumerate(PROMPTS[:3]):
        eng.submit(f"r{i}", p, max_new_tokens=5, ignore_eos=True)
    eng.run()
    assert [eng.tokens[f"r{i}"] for i in range(3)] == want
    be = eng.runner.backend
    assert isinstance(be, fib.FlashInferBackend)
    assert sum(p.w.plans for (mode, _), p in be._eager.items() if mode == "decode") > 0
    assert not any(mode == "prefill" for mode, _ in be._eager)  # extend rows: triton
