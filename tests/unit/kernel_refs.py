"""Torch references for our Triton kernels (float64, written for clarity, not speed)."""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.quant.fp8_math import BLOCK, FP8_MAX, quantize_rows

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def ref_paged_attention(q, k_cache, v_cache, page_table, tok_slot, tok_kv_len, q_pos, page_size, scale,
                        window=None, softcap=None):
    """Per query token: keys j < kv_len, j <= q_pos, j > q_pos - window of its slot's pages."""
    n, hq, _ = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    out = torch.zeros(n, hq, v_cache.shape[-1], dtype=torch.float64)
    for i in range(n):
        kv, p, slot = int(tok_kv_len[i]), int(q_pos[i]), int(tok_slot[i])
        js = [j for j in range(kv) if j <= p and (window is None or j > p - window)]
        if not js:
            continue
        loc = torch.tensor([int(page_table[slot, j // page_size]) * page_size + j % page_size for j in js])
        k = k_cache[loc].double()  # [J, Hkv, D]
        v = v_cache[loc].double()
        for h in range(hq):
            s = (k[:, h // g] @ q[i, h].double()) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ v[:, h // g]
    return out


def ref_rms_norm(x, w, eps, gemma):
    """The model's own reference arithmetic (HF's rounding)."""
    x32 = x.float()
    if gemma:
        y = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
        return (y if w is None else y * w.float()).to(x.dtype)
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if w is None else w * y


def ref_rope(x, pos, inv_freq):
    freqs = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def ref_route(logits, top_k, renormalize, expert_scale=None, round_to=None):
    """MoE routing as HF's routers: float32 softmax, top-k, [renormalise], [round], [* scale]."""
    probs = torch.softmax(logits.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    if round_to is not None:
        w = w.to(round_to).float()
    if expert_scale is not None:
        w = w * expert_scale.float()[ids]
    return ids.int(), w


def ref_experts(x, gate_up, down, ids, weights, act):
    """sum_k w_k * down_e(act(gate_e x) * up_e x) per token, rounding to x's dtype where HF does
    (gate_up, act, product, down, weighted), the slots summed in float64."""
    import torch.nn.functional as F

    acts = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh")}
    dt = x.dtype
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = (gate_up[e].double() @ x[t].double()).to(dt)
            g, u = gu.chunk(2)
            h = (acts[act](g.float()).to(dt).float() * u.float()).to(dt)
            y = (down[e].double() @ h.double()).to(dt)
            out[t] += (y.float() * float(weights[t, k])).to(dt).double()
    return out


def page_table(n_slots, max_pages, n_pages, seed, device=DEV):
    """A page table whose slots hold their own shuffled pages (slot 0: the padding row)."""
    rng = np.random.default_rng(seed)
    pt = np.zeros((n_slots, max_pages), dtype=np.int32)
    for s in range(1, n_slots):  # every slot its own shuffled pages; slot 0 = padding row
        pt[s] = rng.choice(np.arange(1, n_pages), size=max_pages, replace=False)
    return torch.from_numpy(pt).to(device)


def rel_err(out, ref):
    return ((out.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


# A static activation scale for the FP8 tests: inputs up to 40 map onto e4m3's range.
INPUT_SCALE = torch.tensor([40.0 / FP8_MAX])


def fp8_weight(n: int, k: int, layout: str, seed: int = 0, rows: int = 1):
    """(e4m3 [N, K], scales, scale rows) with scales that differ per row (and per block)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) + 0.5)
    if layout == "channel":
        w8, s = quantize_rows(w)
        return w8.to(DEV), s.to(DEV), 1
    nb, kb = -(-n // rows), -(-k // BLOCK)
    s = (torch.rand(nb, kb, generator=g) + 0.5) / 100
    full = s.repeat_interleave(rows, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    w8 = (w / full / 10).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return w8.to(DEV), s.to(DEV), rows
