"""Parallel layers against their unsharded selves, run on every rank of a TP group.

Each check builds the full layer from one seeded generator (identical on every rank), cuts
this rank's shard with the layer's own ``checkpoint_shard`` (what the loader calls) and
compares outputs: returns {check: max abs error} (0.0 where the result must be exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.parallel import factory, shard
from gpu_worker.parallel.layers import lm_logits, vocab_rows_logits
from gpu_worker.parallel.state import agree_min, tp_rank, tp_size


def _load(mod, full: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shard of each full tensor, as the loader does."""
    for leaf, src in full.items():
        getattr(mod, leaf).data.copy_(mod.checkpoint_shard(leaf, src))


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def _check_experts(rnd, g) -> float:
    """MoE experts split on the intermediate dimension (each rank every expert's slice, loaded
    from the fused and from the per-expert layout), outputs all-reduced, vs the whole experts."""
    from gpu_worker.models.moe_config import MoESpec
    from gpu_worker.models.moe import Experts

    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=6, router="softmax", renormalize=True)
    gate_up, down, x = rnd(4, 12, 8), rnd(4, 8, 6), rnd(5, 8)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)]).int()
    w = torch.rand(5, 2, generator=g)
    whole = torch.zeros(5, 8)
    for t in range(5):
        for k in range(2):
            gate, up = F.linear(x[t], gate_up[ids[t, k]]).chunk(2)
            whole[t] += w[t, k] * F.linear(F.silu(gate) * up, down[ids[t, k]])
    fused = Experts(8, spec, "silu")
    _load(fused, {"gate_up_proj": gate_up, "down_proj": down})
    per_expert = Experts(8, spec, "silu")
    for e in range(4):
        for proj, src in (("gate_proj", gate_up[e, :6]), ("up_proj", gate_up[e, 6:]), ("down_proj", down[e])):
            per_expert.expert_view(e, proj).copy_(per_expert.checkpoint_shard("weight", src, proj))
    return max(_err(fused(x, ids, w), whole), _err(per_expert(x, ids, w), whole))


def check_layers() -> dict[str, float]:
    assert tp_size() > 1
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x8, x12 = rnd(5, 8), rnd(5, 12)
    out: dict[str, float] = {}
    with torch.inference_mode():
        # column: the output stays split; this rank's columns of the full output
        w, b = rnd(12, 8), rnd(12)
        rows = shard.even(12, "cols")
        col = factory.column(8, rows, bias=True)
        _load(col, {"weight": w, "bias": b})
        out["column"] = _err(col(x8), F.linear(x8, w, b)[:, rows.start : rows.start + rows.size])
        # row: partial sums all-reduced, bias once
        w, b = rnd(8, 12), rnd(8)
        row = factory.row(shard.even(12, "rows"), 8, bias=True)
        _load(row, {"weight": w, "bias": b})
        out["row"] = _err(row(x12[:, rows.start : rows.start + rows.size]), F.linear(x12, w, b))
        # merged q/k/v, with KV heads split (2) and replicated (1 < tp)
        for kv in (2, 1):
            d, heads = 3, 4
            full = {"q_proj": rnd(heads * d, 8), "k_proj": rnd(kv * d, 8), "v_proj": rnd(kv * d, 8)}
            parts = factory.qkv_parts(heads, kv, d)
            m = factory.merged(8, parts)
            for name, t in full.items():
                off, n = m.shard(name)
                m.weight.data[off : off + n] = m.checkpoint_shard("weight", t, name)
            got = m.split(m(x8))
            errs = [_err(y, F.linear(x8, full[name])[:, r.start : r.start + r.size])
                    for y, (name, r) in zip(got, parts.items())]
            out[f"merged_kv{kv}"] = max(errs)
            if kv == 1:  # replicated: every rank holds the whole (single) KV head
                out["kv1_replicated"] = float(parts["k_proj"].size != kv * d)
        # vocabulary: 11 rows over tp ranks (the last shard is padded)
        emb_w = rnd(11, 5)
        emb = factory.embedding(11, 5)
        _load(emb, {"weight": emb_w})
        ids = torch.arange(11).flip(0)
        out["embedding_exact"] = _err(emb(ids), F.embedding(ids, emb_w))
        h = rnd(4, 5)
        out["lm_logits"] = _err(lm_logits(h, emb.weight, 11), F.linear(h, emb_w))
        sel = torch.randint(0, 11, (4, 6), generator=g)
        full_pick = (h.unsqueeze(-2) @ emb_w[sel].transpose(-1, -2)).squeeze(-2)
        out["vocab_rows"] = _err(vocab_rows_logits(h, emb.weight, shard.vocab(11), sel), full_pick)
        out["experts"] = _check_experts(rnd, g)
    # start-up agreement: every rank sizes its pool to the smallest budget
    out["agree_min"] = float(agree_min(1000 + 7 * tp_rank()) != 1000)
    return out
