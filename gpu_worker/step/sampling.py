"""Sampling: greedy, temperature, top-k / top-p / min-p, per-request seeded randomness.

Randomness is counter-based: the uniform used for a request's token at sequence position
``pos`` is a hash of (request seed, pos, salt). A seeded request therefore reproduces its
tokens whatever batch it shares, and nothing here needs a per-request generator or a
Python loop over rows. All functions are batched over rows and never sync with the host.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.argmax import argmax_last

MASK32 = 0xFFFFFFFF

SALT_SAMPLE = 0  # the token sampled at a position
SALT_ACCEPT = 1  # speculative acceptance coin for the draft at a position
SALT_RESIDUAL = 2  # resample after a rejection


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (values kept in [0, 2^32) inside int64, no overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, pos: torch.Tensor, salt: int) -> torch.Tensor:
    """U[0, 1) per element, a pure function of (seed, pos, salt). Shapes broadcast."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    h = _mix32(lo ^ _mix32(hi ^ _mix32((pos * 4 + salt) & MASK32)))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_filters: bool,
) -> torch.Tensor:
    """softmax(logits / T) with top-k, top-p and min-p applied and renormalised; [R, V] fp32.

    ``use_filters`` (host-known) skips the sort when no row asks for a filter.
    """
    probs = torch.softmax(logits.float() / temperature.clamp_min(1e-5)[:, None], dim=-1)
    if not use_filters:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    drop = rank >= k
    drop |= (sorted_p.cumsum(-1) - sorted_p) > top_p[:, None]  # keeps at least the top token
    drop |= sorted_p < (min_p[:, None] * sorted_p[:, :1])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with uniforms ``u`` [R]."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)


class RowSampling:
    """Sampling parameters gathered for the rows of one step (device tensors)."""

    def __init__(self, slots_state, slot_idx: torch.Tensor, any_random: bool, use_filters: bool):
        self.temperature = slots_state.temperature[slot_idx]
        self.top_k = slots_state.top_k[slot_idx]
        self.top_p = slots_state.top_p[slot_idx]
        self.min_p = slots_state.min_p[slot_idx]
        self.seed = slots_state.seed[slot_idx]
        self.greedy = (self.temperature <= 0) | (self.top_k == 1)
        self.any_random = any_random
        self.use_filters = use_filters

    def repeat(self, n: int) -> "RowSampling":
        """The same parameters for ``n`` consecutive positions of every row."""
        out = RowSampling.__new__(RowSampling)
        for name in ("temperature", "top_k", "top_p", "min_p", "seed", "greedy"):
            setattr(out, name, getattr(self, name).repeat_interleave(n))
        out.any_random, out.use_filters = self.any_random, self.use_filters
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return filtered_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p, self.use_filters)


def sample(logits: torch.Tensor, rs: RowSampling, pos: torch.Tensor) -> torch.Tensor:
    """One token per row; ``pos`` is the sequence position the token will occupy."""
    greedy = argmax_last(logits)
    if not rs.any_random:
        return greedy
    drawn = sample_from(rs.probs(logits), uniform(rs.seed, pos, SALT_SAMPLE))
    return torch.where(rs.greedy, greedy, drawn)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int):
    """Raw-model logprobs (before temperature, as vLLM reports): chosen token and top-k."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if top <= 0:
        return chosen, None, None
    vals, ids = lp.topk(top, dim=-1)
    return chosen, ids.to(torch.int32), vals
