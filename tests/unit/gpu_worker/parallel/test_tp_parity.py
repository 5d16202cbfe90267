"""Tensor parallelism on the CPU: two gloo ranks against one process (TP=1).

One spawn of two ranks runs everything (start-up dominates): parallel layers vs unsharded,
full-model logits vs TP=1 within float32 tolerance (the all-reduce sums in another order,
so bits may differ; MoE targets too, their experts split on the intermediate dimension; FP8
checkpoints too: weights and their scales cut per rank), and greedy tokens through the scheduler
+ runner (overlap depth 2,
chunked prefill, frozen-KV MTP with both assistant heads) equal to TP=1's. Both ranks must
produce the same tokens, including for a seeded sampled request.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from common.args import ArgError
from common.serve_cli import parse_server_args
from tests.helpers.checkpoints import (
    VOCAB,
    build_assistant,
    build_gemma4,
    build_gemma4_moe,
    build_llama,
    build_qwen3,
    build_qwen3_moe,
)
from tests.helpers.fp8_checkpoints import quantize_checkpoint
from tests.helpers.server import ROOT
from tests.helpers.tp import ENGINE_CASES, LOGIT_CASES, engine_tokens, model_logits, rank_workload, run_ranks


def tp_checkpoints(root) -> dict:
    g = build_gemma4(os.path.join(root, "gemma4"))
    g_moe = build_gemma4_moe(os.path.join(root, "gemma4_moe"))
    # FP8 checkpoints wide enough that each rank's input features are whole 128-column groups
    wide = build_llama(os.path.join(root, "llama_wide"), hidden_size=256, intermediate_size=512)
    return {
        # MoE: experts split on their intermediate dimension (24 -> 12 a rank)
        "gemma4_moe": g_moe,
        "assistant_moe": build_assistant(os.path.join(root, "assistant_moe"), g_moe),
        "qwen3_moe": build_qwen3_moe(os.path.join(root, "qwen3_moe")),
        "llama_fp8_block": quantize_checkpoint(wide, os.path.join(root, "llama_fp8_block"), "ct-block", "none"),
        "llama_fp8_tensor": quantize_checkpoint(wide, os.path.join(root, "llama_fp8_tensor"), "ct-tensor", "none"),
        # FP8 experts, block scales: each rank's down projection reads whole 128-column groups
        "qwen3_moe_fp8_block": quantize_checkpoint(
            build_qwen3_moe(os.path.join(root, "qwen3_moe_wide"), hidden_size=256, moe_intermediate_size=256,
                            num_hidden_layers=2), os.path.join(root, "qwen3_moe_fp8_block"), "ct-block", "none"),
        "llama": build_llama(os.path.join(root, "llama")),
        "qwen3": build_qwen3(os.path.join(root, "qwen3")),
        "gemma4": g,
        "assistant": build_assistant(os.path.join(root, "assistant"), g),
        "assistant_ordered": build_assistant(os.path.join(root, "assistant_ordered"), g, ordered=True),
        # logits only: row-parallel biases and a tied head; Gemma 4 PLE + KV-shared layers
        "llama_bias_tied": build_llama(os.path.join(root, "llama_bias_tied"), attention_bias=True, mlp_bias=True,
                                       tie_word_embeddings=True),
        "gemma4_ple_shared": build_gemma4(
            os.path.join(root, "gemma4_ple_shared"), num_hidden_layers=5, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "full_attention"],
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True),
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tp_checkpoints(tmp_path_factory.mktemp("tp_ckpts"))


@pytest.fixture(scope="module")
def ranks(ckpts):
    return run_ranks(rank_workload, 2, ckpts)


def test_parallel_layers_match_unsharded(ranks):
    for rank, res in enumerate(ranks):
        layers = res["layers"]
        assert layers["embedding_exact"] == 0.0, rank  # one non-zero term per id: exact
        assert layers["kv1_replicated"] == 0.0, rank
        assert layers["agree_min"] == 0.0, rank  # ranks agree on the smallest KV budget
        for name in ("column", "row", "merged_kv2", "merged_kv1", "lm_logits", "vocab_rows", "experts"):
            assert layers[name] < 1e-5, (rank, name, layers[name])


@pytest.mark.parametrize("arch", LOGIT_CASES)
def test_tp2_logits_match_tp1(ckpts, ranks, arch):
    ref, ref_heads = model_logits(ckpts[arch])
    for rank, res in enumerate(ranks):
        got, heads = res["logits"][arch]
        # each rank's pool holds half the KV heads; a single KV head (Gemma's full layers) is replicated
        assert heads == [max(h // 2, 1) for h in ref_heads], (rank, heads, ref_heads)
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=f"rank {rank}")
    # the logits are gathered before sampling: every rank holds the very same ones
    np.testing.assert_array_equal(ranks[0]["logits"][arch][0], ranks[1]["logits"][arch][0])


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_tp2_greedy_tokens_equal_tp1(ckpts, ranks, case):
    model, draft = ENGINE_CASES[case]
    ref = engine_tokens(ckpts[model], ckpts[draft] if draft else None)
    got0, got1 = ranks[0]["tokens"][case], ranks[1]["tokens"][case]
    assert got0 == got1, "ranks sampled different tokens"  # incl. the seeded sampled request
    greedy = {rid: t for rid, t in ref.items() if rid.startswith("g")}
    assert {rid: got0[rid] for rid in greedy} == greedy
    assert all(len(t) == 12 for t in got0.values())


def test_tp_size_flag():
    model = os.path.join(ROOT, "models", "tiny-shakespeare", "target")
    assert parse_server_args(["--tp-size", "2"]).tp_size == 2
    assert parse_server_args(["--tensor-parallel-size", "2"]).tp_size == 2
    assert parse_server_args([]).tp_size == 1
    with pytest.raises(ArgError, match="--tp-size"):
        parse_server_args(["--model-path", model, "--tp-size", "0"])
