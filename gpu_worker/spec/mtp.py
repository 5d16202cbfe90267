"""Frozen-KV MTP: the draft chain and the verify/accept rule (docs/design.md §5, a chain).

Seed for a decoding slot = (bonus token = last_token[s], target post-norm hidden at the last
committed position = hidden[s]). Each of the S draft steps is one assistant forward that reads
the target's KV over exactly the committed keys [0, seq_len) and writes none; every step uses
the same RoPE position, ``seq_len + DRAFT_ROPE_OFFSET``.

Verify: the target runs [bonus, d1..dS] at positions seq_len..seq_len+S in the same forward as
the step's prefill chunks, writing their KV. Greedy rows accept while d_i == argmax; sampled
rows use target-only rejection (accept d with probability p(d); on rejection sample p with d
removed; after S acceptances sample the bonus from p). accept_len counts the final token, and
rejected KV stays past seq_len to be overwritten by the next verify.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels.argmax import argmax_last
from gpu_worker.step.sampling import SALT_ACCEPT, SALT_RESIDUAL, SALT_SAMPLE, RowSampling, sample_from, uniform

# HF transformers' reference (SinglePositionMultiTokenCandidateGenerator) places every draft
# query at the bonus token's own index, i.e. committed_len; sglang's text path uses
# committed_len - 1. We follow HF's authors; the bundled pair is trained with the same constant.
DRAFT_ROPE_OFFSET = 0


def draft_chain(assistant, backend, fb, tokens: torch.Tensor, hidden: torch.Tensor, steps: int) -> None:
    """S greedy drafts per row into ``tokens[:, 1:steps + 1]``, from the bonus in ``tokens[:, 0]``
    (each step reads its input column and writes the next: no stack, no copy; the last step
    skips the post-projection nobody reads). The draft is a deterministic proposer."""
    for i in range(steps):
        _, hidden = assistant.draft_step(tokens[:, i], hidden, fb, backend, out=tokens[:, i + 1], last=i == steps - 1)


def verify(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    rs: RowSampling,
    seq_len: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [D*N, V] for tokens [bonus, d1..dS] of each row -> (out [D, N], accept_len [D]).

    ``out[r, :accept_len[r]]`` are the new tokens: accepted drafts, then the final token.
    """
    d, s = drafts.shape
    n = s + 1
    lg = logits.view(d, n, -1)
    greedy_tok = argmax_last(lg)  # [D, N]
    pos_next = seq_len[:, None] + 1 + torch.arange(n, device=logits.device)[None, :]  # where each lands
    if rs.any_random:
        probs = rs.repeat(n).probs(logits).view(d, n, -1)
        p_draft = probs[:, :s].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [D, S]
        coin = uniform(rs.seed[:, None], pos_next[:, :s], SALT_ACCEPT)
        ok = torch.where(rs.greedy[:, None], drafts == greedy_tok[:, :s], coin < p_draft)
    else:
        ok = drafts == greedy_tok[:, :s]
    n_ok = accepted_drafts(ok)
    final = greedy_tok.gather(1, n_ok[:, None]).squeeze(1)
    if rs.any_random:
        final = torch.where(rs.greedy, final, _resample(probs, drafts, n_ok, rs, pos_next))
    return new_tokens(drafts, n_ok, final), n_ok + 1


def accepted_drafts(ok: torch.Tensor) -> torch.Tensor:
    """ok [D, S] (draft i accepted on its own) -> accepted drafts per row: the leading run."""
    return ok.to(torch.int64).cumprod(dim=1).sum(dim=1)


def new_tokens(drafts: torch.Tensor, n_ok: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """[D, S + 1]: the n_ok accepted drafts, then ``final`` (the columns past it repeat it)."""
    col = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, final[:, None]], dim=1)
    return torch.where(col < n_ok[:, None], padded, final[:, None])


def _resample(probs, drafts, n_ok, rs: RowSampling, pos_next) -> torch.Tensor:
    """The final token of a sampled row: from p with the rejected draft removed, or the bonus
    from p when every draft was accepted."""
    d, n, _ = probs.shape
    s = n - 1
    p = probs[torch.arange(d, device=probs.device), n_ok]  # [D, V]
    rejected = n_ok < s
    reject_tok = drafts.gather(1, n_ok.clamp_max(s - 1)[:, None]).squeeze(1)
    residual = p.scatter(1, reject_tok[:, None], 0.0)
    residual = torch.where(rejected[:, None], residual, p)
    pos = pos_next.gather(1, n_ok[:, None]).squeeze(1)
    u = torch.where(rejected, uniform(rs.seed, pos, SALT_RESIDUAL), uniform(rs.seed, pos, SALT_SAMPLE))
    return sample_from(residual, u)
