"""The Gemma 4 assistant (frozen-KV MTP draft) vs HF ``Gemma4AssistantForCausalLM``.

HF's reference draft step (``SinglePositionMultiTokenCandidateGenerator``): inputs_embeds =
cat(target embed(token), target hidden), position_ids = [[committed_len]], shared_kv_states =
the target's KV of its last layer of each type over [0, committed_len). Ours runs the same step
Q-only over the target's paged KV with q_pos = kv_len - 1.

One documented difference: on sliding layers HF's bidirectional mask keeps keys within distance
<= window (window + 1 keys); ours keeps the last ``window`` keys, like the target's own sliding
layers. We hand HF only the last ``window`` sliding keys so both see the same set.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.models.loader import load_model
from tests.unit.model_harness import TEST_DEVICE, PagedHarness, randomize_hf_

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4_assistant import (  # noqa: E402
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
)

VOCAB = 256
WINDOW = 6
STEPS = 3
FULL, SLIDING = "full_attention", "sliding_attention"

_TARGET = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    attention_k_eq_v=True,
    num_global_key_value_heads=1,
    layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
    num_kv_shared_layers=1,  # the last full layer reads layer 1's KV: the draft must too
    sliding_window=WINDOW,
    final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=VOCAB,
    max_position_embeddings=256,
    pad_token_id=0,
)


def _assistant_text_config(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,  # must match the target's sliding KV heads
        head_dim=16,
        global_head_dim=32,  # and its full-layer head_dim / kv heads
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        layer_types=[SLIDING, FULL],
        sliding_window=WINDOW,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    return transformers.Gemma4TextConfig(**{**base, **kw})


@pytest.fixture(autouse=True)
def _assistant_kv_sharing_modes(monkeypatch):
    """Some transformers releases raise from ``kv_sharing_modes`` when every layer is shared
    (the assistant). Patch it to "reuse" everywhere then; 5.17 has no such property at all."""
    cls = transformers.Gemma4TextConfig
    if not hasattr(cls, "kv_sharing_modes"):
        return
    original = cls.kv_sharing_modes

    def modes(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    monkeypatch.setattr(cls, "kv_sharing_modes", property(modes))


def _build_pair(tmp_path, ordered: bool):
    torch.manual_seed(0)
    hf_target = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**_TARGET)).eval()
    randomize_hf_(hf_target, seed=1)
    extra = dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4) if ordered else {}
    acfg = Gemma4AssistantConfig(text_config=_assistant_text_config(), backbone_hidden_size=64, **extra)
    hf_draft = Gemma4AssistantForCausalLM(acfg).eval()
    randomize_hf_(hf_draft, seed=2)
    if ordered:
        g = torch.Generator().manual_seed(3)
        hf_draft.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=g))
    hf_target.save_pretrained(tmp_path / "target")
    hf_draft.save_pretrained(tmp_path / "draft")
    target = load_model(tmp_path / "target", dtype=torch.float32, device=TEST_DEVICE)
    draft = load_model(tmp_path / "draft", dtype=torch.float32, device=TEST_DEVICE, target=target)
    return hf_target, hf_draft, target, draft


def _hf_draft_steps(hf_target, hf_draft, prompt: list[int], bonus: int, tokens: list[int]):
    """HF reference: per step (logits [V], next hidden [Ht]); step i feeds tokens[i-1]."""
    n = len(prompt)
    with torch.inference_mode():
        out = hf_target(
            input_ids=torch.tensor([prompt]), use_cache=False, output_hidden_states=True, return_shared_kv_states=True
        )
        kv = {t: (k[:, :, :n], v[:, :, :n]) for t, (k, v) in out.shared_kv_states.items()}
        kv[SLIDING] = tuple(x[:, :, -WINDOW:] for x in kv[SLIDING])  # see module docstring
        hidden = out.hidden_states[-1][:, -1:]  # post-norm hidden of the last committed token
        results = []
        for tok in [bonus, *tokens]:
            embeds = torch.cat([hf_target.model.embed_tokens(torch.tensor([[tok]])), hidden], dim=-1)
            step = hf_draft(
                inputs_embeds=embeds, position_ids=torch.tensor([[n]]), shared_kv_states=kv, use_cache=False
            )
            hidden = step.last_hidden_state
            results.append((step.logits[0, 0].float(), hidden[0, 0]))
    return results


@pytest.mark.parametrize("ordered", [False, True], ids=["lm_head", "centroid_head"])
def test_draft_steps_match_hf(tmp_path, ordered):
    hf_target, hf_draft, target, draft = _build_pair(tmp_path, ordered)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 19)]  # <, ~, > window
    bonus = torch.randint(3, VOCAB, (3,), generator=g).tolist()
    feed = torch.randint(3, VOCAB, (STEPS - 1, 3), generator=g).tolist()  # tokens fed on later steps
    refs = [_hf_draft_steps(hf_target, hf_draft, p, bonus[r], [f[r] for f in feed]) for r, p in enumerate(prompts)]

    h = PagedHarness(target.kv_shapes, target.sliding_windows + draft.sliding_windows)
    rows = [(h.new_slot(), p) for p in prompts]
    with torch.inference_mode():
        hidden = h.extend(target, rows)[PagedHarness.last_rows(rows)]
        tokens = torch.tensor(bonus, device=TEST_DEVICE)
        fb = h.draft_batch([slot for slot, _ in rows])  # constant for every step: frozen KV
        for step in range(STEPS):
            # the engine's greedy step (one input kernel, argmax over model-dtype logits)
            picked, step_hidden = draft.draft_step(tokens, hidden, fb, h.backend)
            last_pick, no_hidden = draft.draft_step(tokens, hidden, fb, h.backend, last=True)
            logits, hidden = draft(draft.embed(tokens), hidden, fb, h.backend)
            assert torch.equal(step_hidden, hidden) and torch.equal(picked, logits.argmax(-1))
            assert no_hidden is None and torch.equal(last_pick, picked)  # a chain's last step: no post-projection
            assert logits.dtype == torch.float32 and logits.shape == (3, VOCAB)
            ref_logits = torch.stack([refs[r][step][0] for r in range(3)])
            ref_hidden = torch.stack([refs[r][step][1] for r in range(3)])
            torch.testing.assert_close(hidden.cpu(), ref_hidden, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits.cpu(), ref_logits, atol=1e-4, rtol=1e-4)
            if step < STEPS - 1:
                tokens = torch.tensor(feed[step], device=TEST_DEVICE)


def test_draft_maps_layers_to_target_kv_owners(tmp_path):
    _, _, target, draft = _build_pair(tmp_path, ordered=False)
    # target layers s0 f1 s2 s3 | f4 shared(->1): owners per type are pool layers 3 (s3) and 1 (f1)
    attn = [layer.self_attn.attn for layer in draft.model.layers]
    assert [(a.kv_layer, a.writes_kv, a.sliding_window) for a in attn] == [(3, False, WINDOW), (1, False, None)]
    assert draft.kv_shapes == [] and draft.hidden_size == 64 and draft.draft_hidden_size == 32


def test_centroid_head_argmax_is_a_selected_token(tmp_path):
    """Masked filler sits below every selected logit, per row, without a host sync."""
    _, _, _, draft = _build_pair(tmp_path, ordered=True)
    torch.manual_seed(5)
    h = torch.randn(4, draft.draft_hidden_size).to(TEST_DEVICE)
    with torch.inference_mode():
        logits = draft.compute_logits(h).cpu()
        top = torch.topk(draft.masked_embedding.centroids(h), k=4, dim=-1).indices.cpu()
    clusters = draft.masked_embedding.token_ordering.view(16, VOCAB // 16).cpu()
    for r in range(4):
        selected = clusters[top[r]].reshape(-1)
        others = torch.ones(VOCAB, dtype=torch.bool)
        others[selected] = False
        assert int(logits[r].argmax()) in selected.tolist()
        assert logits[r][others].max() < logits[r][selected].min()


def test_bind_rejects_mismatched_pair(tmp_path):
    torch.manual_seed(0)
    hf_target = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**_TARGET))
    hf_target.save_pretrained(tmp_path / "target")
    target = load_model(tmp_path / "target", dtype=torch.float32, device=TEST_DEVICE)
    bad = [
        (dict(backbone_hidden_size=48), {}, "draft backbone_hidden_size 48 does not match target hidden_size 64"),
        ({}, dict(vocab_size=128), "draft vocab_size 128 does not match target vocab_size 256"),
        ({}, dict(head_dim=8), "expects KV heads/head_dim"),
    ]
    for i, (outer, text, message) in enumerate(bad):
        cfg = Gemma4AssistantConfig(text_config=_assistant_text_config(**text), **{"backbone_hidden_size": 64, **outer})
        path = tmp_path / f"draft{i}"
        Gemma4AssistantForCausalLM(cfg).save_pretrained(path)
        with pytest.raises(ValueError, match=message):
            load_model(path, dtype=torch.float32, device=TEST_DEVICE, target=target)
    with pytest.raises(ValueError, match="draft model"):
        load_model(tmp_path / "draft0", dtype=torch.float32, device=TEST_DEVICE)


def test_draft_projections_go_through_the_gemv_dispatch(tmp_path):
    """Every projection of the draft's forward (its layers and the pre / post projections) is
    ``parallel.linear.Linear``, whose one-row GEMMs may take the GEMV (kernels/gemv.py ``linear``): inside
    the draft graph a cuBLAS kernel would break the PDL chain. The LM head (cuBLAS or the
    centroid head) and the centroid scorer are the exceptions."""
    from gpu_worker.parallel.linear import Linear

    _, _, _, draft = _build_pair(tmp_path, ordered=True)
    plain = [name for name, m in draft.named_modules() if type(m) is torch.nn.Linear]
    assert set(plain) <= {"lm_head", "masked_embedding.centroids"}, plain
    assert isinstance(draft.pre_projection, Linear) and isinstance(draft.post_projection, Linear)
