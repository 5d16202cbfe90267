"""Torch references for our Triton kernels (float64, written for clarity, not speed)."""

from __future__ import annotations

import torch


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
