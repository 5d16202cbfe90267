"""The verify/accept rule of frozen-KV MTP, in isolation.

Greedy: accept while the draft equals the target argmax. Sampling: target-only rejection
sampling must emit tokens distributed exactly as the target, whatever the draft proposes.
The chi-square tests use fixed seeds (one per row) and a critical value at p = 0.001, so a
correct sampler fails them with probability 0.1% per test and a wrong one almost surely.
"""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.step.sampling import RowSampling
from gpu_worker.spec.mtp import verify

# chi-square critical values at p = 0.001 for the degrees of freedom used below
CHI2_CRIT_P001 = {4: 18.467, 5: 20.515}


class _State:
    def __init__(self, n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
        self.temperature = torch.full((n,), temperature)
        self.top_k = torch.full((n,), top_k, dtype=torch.int64)
        self.top_p = torch.full((n,), top_p)
        self.min_p = torch.full((n,), min_p)
        self.seed = torch.arange(n, dtype=torch.int64) * 7919 + 12345


def _rs(n, greedy=False, **kw):
    st = _State(n, temperature=0.0 if greedy else 1.0, **kw)
    return RowSampling(st, torch.arange(n), any_random=not greedy, use_filters=bool(kw))


def test_greedy_accepts_matching_prefix():
    v, s = 8, 3
    target = torch.tensor([[3, 5, 1, 6], [3, 5, 1, 6], [3, 5, 1, 6], [2, 0, 0, 0]])  # argmax per position
    logits = torch.nn.functional.one_hot(target, v).float().view(-1, v) * 5
    drafts = torch.tensor([[3, 5, 1], [3, 4, 1], [0, 5, 1], [2, 0, 7]])
    out, acc = verify(logits, drafts, _rs(4, greedy=True), torch.zeros(4, dtype=torch.int64))
    assert acc.tolist() == [4, 2, 1, 3]
    assert out[0].tolist() == [3, 5, 1, 6]
    assert out[1, :2].tolist() == [3, 5]
    assert out[2, :1].tolist() == [3]
    assert out[3, :3].tolist() == [2, 0, 0]


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def test_rejection_sampling_preserves_target_distribution():
    v, s, n = 6, 2, 40000
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
    p1 = torch.tensor([0.05, 0.15, 0.40, 0.20, 0.10, 0.10])
    p2 = torch.tensor([0.20, 0.20, 0.20, 0.20, 0.10, 0.10])
    logits = torch.stack([p0.log(), p1.log(), p2.log()]).repeat(n, 1)
    drafts = torch.tensor([[1, 4]]).repeat(n, 1)  # a draft the target only partly agrees with
    out, acc = verify(logits, drafts, _rs(n), torch.zeros(n, dtype=torch.int64))
    first = torch.bincount(out[:, 0], minlength=v).numpy()
    assert _chi2(first, p0.numpy()) < CHI2_CRIT_P001[v - 1]
    # Given the first token equals the draft (then row 1 is the target's conditional), the
    # second token must follow p1, whether it came from acceptance or the residual.
    sel = (out[:, 0] == 1) & (acc >= 2)
    second = torch.bincount(out[sel, 1], minlength=v).numpy()
    assert _chi2(second, p1.numpy()) < CHI2_CRIT_P001[v - 1]
    assert (acc[out[:, 0] != 1] == 1).all()


def test_rejection_sampling_with_top_k_matches_filtered_target():
    v, n = 6, 40000
    p0 = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.10, 0.05])
    logits = torch.stack([p0.log(), p0.log()]).repeat(n, 1)
    drafts = torch.tensor([[5]]).repeat(n, 1)  # outside the top-k: never accepted
    out, acc = verify(logits, drafts, _rs(n, top_k=3), torch.zeros(n, dtype=torch.int64))
    counts = torch.bincount(out[:, 0], minlength=v).numpy()
    assert counts[3:].sum() == 0 and (acc == 1).all()
    q = np.array([0.30, 0.25, 0.20]) / 0.75
    exp = q * n
    assert float(((counts[:3] - exp) ** 2 / exp).sum()) < 13.816  # df 2, p = 0.001
