"""Toy-scale checks of the tiny-pair recipe (models/train_tiny_pair.py, models/recipe/).

The draft module must be exactly what the engine serves and what HF transformers computes:
Gemma4AssistantForCausalLM reading the target's KV over [0, c) at one RoPE position.
"""

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "models"))

transformers = pytest.importorskip("transformers")

from recipe import arch as A  # noqa: E402
from recipe import data as D  # noqa: E402
from recipe.draft import (DraftTrainCfg, draft_loss, make_prompts, simulate_chain,  # noqa: E402
                          train_assistant)
from recipe.export import export_pair, verify_with_hf  # noqa: E402
from recipe.target import generate  # noqa: E402

TEXT = (D.CHAT_TEMPLATE + "\n") * 3 + """
FIRST WITCH.
When shall we three meet again?
In thunder, lightning, or in rain?

SECOND WITCH.
When the hurlyburly's done,
When the battle's lost and won.

THIRD WITCH.
That will be ere the set of sun.
""" * 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Toy shapes: extra intra-op threads only spin (20x slower on a loaded CI machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = D.train_tokenizer([TEXT], vocab_size=320)
    tok.save(str(d / "raw.json"))
    D.write_tokenizer_files(d / "raw.json", d, 256)
    return d


def tiny_pair(vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    ta = A.TextArch(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, layer_types=[A.SLIDING, A.FULL, A.SLIDING, A.FULL],
                    sliding_window=8, max_position_embeddings=256)
    da = A.draft_arch_from(ta, 24, 48, 2, [A.SLIDING, A.FULL])
    tgt, ast = A.TargetLM(ta).eval(), A.Assistant(da, ta.hidden_size).eval()
    with torch.no_grad():  # non-trivial norm scales so the check sees them
        for m in (tgt, ast):
            for n, p in m.named_parameters():
                if "norm" in n:
                    p.add_(torch.randn_like(p) * 0.3)
    return ta, da, tgt, ast


def test_frozen_kv_masks_semantics():
    m = A.frozen_kv_masks(12, 4, "cpu")
    for c in range(1, 12):
        assert m[A.FULL][c].nonzero().flatten().tolist() == list(range(c))
        assert m[A.SLIDING][c].nonzero().flatten().tolist() == list(range(max(0, c - 4), c))
    assert A.POSITION_OFFSETS[A.DRAFT_POSITION] == 0  # HF convention: RoPE position = committed_len


def test_export_loads_in_hf_and_draft_matches_hf_assistant(tok_dir, tmp_path):
    vocab = json.loads((tok_dir / "tokenizer.json").read_text())["model"]["vocab"]
    ta, da, tgt, ast = tiny_pair(len(vocab))
    export_pair(tmp_path, tgt, ast, tok_dir, num_assistant_tokens=3)
    cfg = json.loads((tmp_path / "target/config.json").read_text())
    assert cfg["global_head_dim"] == cfg["head_dim"] and cfg["per_layer_config"]
    assert json.loads((tmp_path / "assistant/generation_config.json").read_text())["num_assistant_tokens"] == 3
    row = np.random.default_rng(0).integers(7, len(vocab), size=40)
    res = verify_with_hf(tmp_path, ta, da, row, steps=3, device=torch.device("cpu"), gen_tokens=12)
    assert res["target_load_problems"] == {} and res["assistant_load_problems"] == {}
    assert res["target_logits_max_abs_diff"] < 1e-4 and res["target_argmax_equal"]
    assert res["assistant_logits_max_abs_diff"] < 1e-4 and res["assistant_argmax_equal"]
    assert max(res["assistant_committed_lengths_checked"]) > ta.sliding_window  # window exercised
    assert res["greedy_generate_equal"] and res["hf_assisted_generate_equal"] is True
    assert res["tokenizer_libraries_agree"]
    assert res["chat_template_sample"] == "<bos><start_of_turn>user\nWho is there?<end_of_turn>\n<start_of_turn>model\n"


def test_chat_template_hf_matches_render(tok_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    msgs = [{"role": "system", "content": "Verse."}, {"role": "user", "content": "Who's there?"},
            {"role": "assistant", "content": "Nay, answer me."},
            {"role": "user", "content": [{"type": "text", "text": "Stand."}]}]
    for gen in (False, True):
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == D.render_chat(msgs, gen)
    assert tok("When shall")["input_ids"][0] == D.BOS_ID
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [D.SOT_ID, D.EOT_ID]


def test_clean_text_strips_gutenberg_boilerplate():
    raw = ("header\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\nA\t line  \r\n\n\n\n\n\nB\n"
           "*** END OF X\nlicence\n")
    text, dropped = D.clean_text(raw)
    assert text == "A     line\n\n\nB\n" and dropped == 5


def test_cached_generate_matches_full_forward():
    ta, _, tgt, _ = tiny_pair(64)
    prompt = torch.randint(7, 64, (2, 5))
    ids = generate(tgt, prompt, torch.tensor([5, 3]), 30, torch.zeros(2, 30))
    assert torch.equal(ids[0, :5], prompt[0]) and torch.equal(ids[1, :3], prompt[1, :3])
    logits, _, _ = tgt(ids)
    assert torch.equal(logits[0, 4:-1].argmax(-1), ids[0, 5:])
    assert torch.equal(logits[1, 2:-1].argmax(-1), ids[1, 3:])


def test_simulate_chain_counts_bonus():
    s, n, length = 3, 1, 20
    match = np.zeros((s, n, length), dtype=bool)
    match[:, 0, 4] = True            # c=4: all 3 drafts accepted -> accept length 4, next c=8
    match[0, 0, 8] = True            # c=8: one accepted -> 2, next c=10; c=10, 11: none
    res = simulate_chain(match, np.array([4]), np.array([12]))  # no verify at c=12 (the stop)
    assert res["accept_length_histogram"] == [2, 1, 0, 1]
    assert res["mean_accept_length"] == pytest.approx((4 + 2 + 1 + 1) / 4)
    assert res["rate_at_position"] == pytest.approx([2 / 4, 1 / 4, 1 / 4])
    assert res["conditional_rate_at_position"] == pytest.approx([2 / 4, 1 / 2, 1 / 1])


def test_assistant_training_loop_runs_and_learns():
    ta, da, tgt, ast = tiny_pair(64, seed=1)
    cfg = DraftTrainCfg(batch_size=8, steps=30, lr=1e-2, warmup=2, log_every=100, eval_every=1000)
    rng = np.random.default_rng(0)
    text = rng.integers(7, 64, size=500)
    cfg.rollout_len, cfg.prompt_min, cfg.prompt_max = 32, 4, 8
    given, glen, start, temps = make_prompts(8, 32, text, [], cfg, rng)
    ids = generate(tgt, torch.from_numpy(given), torch.from_numpy(glen), 32, torch.from_numpy(temps))
    roll = {"ids": ids.numpy(), "start": start}

    def loss_now():
        with torch.no_grad():
            t_logits, h, kvs = tgt(ids, kv_layers=tuple(tgt.kv_source.values()))
            d = A.draft_all_positions(tgt, ast, ids, h, A.target_kv_for_draft(tgt, kvs), 3)
            return draft_loss(t_logits, d, torch.from_numpy(start), 0.2)[0].item()

    before = loss_now()
    res = train_assistant(tgt, ast, roll, cfg, torch.device("cpu"), time.time() + 300, seed=0)
    assert res["steps_run"] == 30 and loss_now() < 0.85 * before
