"""Mixture-of-experts targets vs HF transformers, float32 on the CPU, through the paged KV pool:
Gemma 4 with ``enable_moe_block`` (sliding + full layers; PLE off and on, with KV-shared
layers) and Qwen3-MoE (``mlp_only_layers``, ``decoder_sparse_step``, ``norm_topk_prob`` on and
off). Each checkpoint loads from both expert layouts (fused 3-D tensors and per-expert modules,
sharded) to the same weights; the torch path and the kernel path (Triton's interpreter) give
HF's logits for a flat prefill and for chunked prefill then decode steps."""

from __future__ import annotations

import shutil

import pytest
import torch

from gpu_worker.models.config import load_config, parse_config
from gpu_worker.models.loader import load_model
from tests.helpers.checkpoints import VOCAB, build_gemma4_moe, build_qwen3_moe, hf_model, rewrite_experts
from tests.unit.model_harness import PagedHarness, hf_logits

pytest.importorskip("transformers")
ATOL = RTOL = 1e-4

CASES = {
    "gemma4_moe": lambda d: build_gemma4_moe(d),
    "gemma4_moe_ple_shared": lambda d: build_gemma4_moe(
        d, num_hidden_layers=5, num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"]),
    "qwen3_moe": lambda d: build_qwen3_moe(d),  # layer 1 dense (mlp_only_layers)
    "qwen3_moe_step2": lambda d: build_qwen3_moe(d, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[],
                                                 norm_topk_prob=False),
}
# Which layout each builder's save_pretrained writes; the other one is made by rewrite_experts.
SAVED = {"gemma4": "fused", "qwen3": "per_expert"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = CASES[name](str(tmp_path_factory.mktemp(name) / "ckpt"))
        return cache[name]

    return get


def _seqs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _check_prefill_then_decode(hf, ours, backend="torch"):
    steps = 3
    a_full, b_full = _seqs([20 + steps, 13 + steps], seed=2)
    ref_a, ref_b = hf_logits(hf, a_full), hf_logits(hf, b_full)
    h = PagedHarness(ours.kv_shapes, ours.sliding_windows, page_size=4, backend=backend)
    a, b = h.new_slot(), h.new_slot()
    plan = [([(a, a_full[:11]), (b, b_full[:6])], [ref_a[:11], ref_b[:6]]),
            ([(a, a_full[11:20]), (b, b_full[6:13])], [ref_a[11:20], ref_b[6:13]])]
    for k in range(steps):  # decode rows: the kernel path's 1-4 token experts
        plan.append(([(a, [a_full[20 + k]]), (b, [b_full[13 + k]])], [ref_a[20 + k:21 + k], ref_b[13 + k:14 + k]]))
    with torch.inference_mode():
        for i, (rows, refs) in enumerate(plan):
            logits = ours.compute_logits(h.extend(ours, rows)).cpu()
            torch.testing.assert_close(logits, torch.cat(refs), atol=ATOL, rtol=RTOL, msg=lambda m: f"step {i}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_moe_logits_match_hf(name, built):
    path = built(name)
    _check_prefill_then_decode(hf_model(path), load_model(path, dtype=torch.float32))


@pytest.mark.parametrize("name", ["gemma4_moe", "qwen3_moe"])
def test_both_expert_layouts_load_the_same_weights(name, built, tmp_path):
    path = built(name)
    other = "per_expert" if SAVED[name.split("_")[0]] == "fused" else "fused"
    copy = rewrite_experts(shutil.copytree(path, tmp_path / "copy"), other, shards=3)
    a, b = load_model(path, dtype=torch.float32), load_model(copy, dtype=torch.float32)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and any(k.endswith("experts.gate_up_proj") for k in sa)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("name", ["gemma4_moe", "gemma4_moe_ple_shared", "qwen3_moe"])
def test_kernel_path_matches_hf(name, built, monkeypatch):
    """The MoE kernels (routing, alignment + grouped GEMM on prefill chunks, the decode path on
    decode rows; Gemma 4's layer end fused with the slot sum, or with PLE the separate combine)
    under the interpreter, with the triton attention backend."""
    path = built(name)
    monkeypatch.setattr("gpu_worker.kernels._CPU_KERNELS", [True])
    ours = load_model(path, dtype=torch.float32)
    _check_prefill_then_decode(hf_model(path), ours, backend="triton")


def test_moe_layer_specs_follow_hf(built):
    q = parse_config(load_config(built("qwen3_moe")))
    assert [l.moe is not None for l in q.layers] == [True, False, True]
    assert q.layers[0].moe.renormalize and q.layers[0].moe.router == "softmax" and q.layers[0].moe.top_k == 2
    s = parse_config(load_config(built("qwen3_moe_step2")))
    assert [l.moe is not None for l in s.layers] == [False, True, False, True]
    g = parse_config(load_config(built("gemma4_moe")))
    assert all(l.moe is not None and l.moe.router == "gemma4" for l in g.layers)


def test_an_unsupported_moe_config_fails_at_load_naming_its_field(built, tmp_path):
    """What the worker reports as its one-line start-up error (a ValueError, no traceback)."""
    import json

    d = shutil.copytree(built("qwen3_moe"), tmp_path / "bad")
    cfg = json.load(open(d / "config.json"))
    cfg["scoring_func"] = "sigmoid"
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ValueError, match="scoring_func 'sigmoid' is not supported") as err:
        load_model(d, dtype=torch.float32)
    assert "\n" not in str(err.value)
