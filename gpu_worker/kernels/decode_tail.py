"""The greedy decode tail: token selection, MTP's greedy accept and the slot-state update of a
decode step in one kernel, so that a graph-replayed step needs no eager ops after its replay.

Per row b of a decode batch (slot ``slots[b]``, ``t`` tokens fed: the bonus and t - 1 drafts,
``greedy[b*t + i]`` the target's argmax after token i):

    n_ok   = the number of leading drafts equal to the target's argmax before them
    final  = greedy[b*t + n_ok]            (the correction, or the bonus after every draft)
    out[j] = drafts[j] for j < n_ok, else final;  accept = n_ok + 1
    seq_len[slot] += accept;  last_token[slot] = final;  hidden[slot] = hidden_rows[b*t + n_ok]

Exactly ``TokenSelector.tokens`` + ``spec.mtp.verify`` + ``ModelRunner._commit`` for all-greedy rows (t = 1
is plain decode: out = [argmax], accept = 1). Padding rows (slot 0) change no state: slot 0's
length must stay 0. ``result`` [B, t + 1] int32 gets out and accept, the step's one copy home.

Invariant: real rows hold distinct slots (the scheduler never batches a slot twice), so no two
programs update the same slot.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import next_pow2, use_triton
from gpu_worker.spec.mtp import accepted_drafts, new_tokens

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _greedy_tail_kernel(slots_ptr, tokens_ptr, greedy_ptr, rows_ptr, seq_ptr, last_ptr, state_ptr, res_ptr,
                            H, s_rows, s_state, T: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + b)
        j = tl.arange(0, BLOCK_T)
        drafts = tl.load(tokens_ptr + b * T + 1 + j, mask=j < T - 1, other=-1)
        greedy = tl.load(greedy_ptr + b * T + j, mask=j < T, other=-2)
        miss = (drafts != greedy) & (j < T - 1)
        n_ok = tl.min(tl.where(miss | (j >= T - 1), j, T - 1), axis=0)  # first mismatch, else T - 1
        final = tl.sum(tl.where(j == n_ok, greedy, 0), axis=0)
        out = tl.where(j < n_ok, drafts, final)
        tl.store(res_ptr + b * (T + 1) + j, out.to(tl.int32), mask=j < T)
        tl.store(res_ptr + b * (T + 1) + T, (n_ok + 1).to(tl.int32))
        if slot != 0:
            tl.store(seq_ptr + slot, tl.load(seq_ptr + slot) + n_ok + 1)
            tl.store(last_ptr + slot, final)
            src = rows_ptr + (b * T + n_ok) * s_rows
            dst = state_ptr + slot * s_state
            for h0 in range(0, H, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                tl.store(dst + h, tl.load(src + h, mask=h < H).to(state_ptr.dtype.element_ty), mask=h < H)


def greedy_tail_reference(slots, tokens, greedy, hidden_rows, seq_len, last_token, state_hidden, result) -> None:
    """The torch twin (CPU without the interpreter): the same updates, in place."""
    b, t = tokens.shape
    g, drafts = greedy.view(b, t), tokens[:, 1:]
    n_ok = accepted_drafts(drafts == g[:, : t - 1])
    final = g.gather(1, n_ok[:, None]).squeeze(1)
    out = new_tokens(drafts, n_ok, final)
    acc = n_ok + 1
    real = slots != 0
    seq_len[slots] = seq_len[slots] + torch.where(real, acc, 0)
    last_token[slots] = torch.where(real, final, last_token[slots])
    seed = hidden_rows[torch.arange(b, device=tokens.device) * t + n_ok].to(state_hidden.dtype)
    state_hidden[slots] = torch.where(real[:, None], seed, state_hidden[slots])
    result[:b, :t] = out.to(torch.int32)
    result[:b, t] = acc.to(torch.int32)


def greedy_tail(slots: torch.Tensor, tokens: torch.Tensor, greedy: torch.Tensor, hidden_rows: torch.Tensor,
                seq_len: torch.Tensor, last_token: torch.Tensor, state_hidden: torch.Tensor,
                result: torch.Tensor) -> None:
    """slots [B] int64, tokens [B, t] (bonus + drafts), greedy [B*t] int64, hidden_rows [B*t, H]
    -> state updated for the real rows, result [B, t + 1] int32 (tokens, accept)."""
    b, t = tokens.shape
    if not use_triton(tokens):
        greedy_tail_reference(slots, tokens, greedy, hidden_rows, seq_len, last_token, state_hidden, result)
        return
    assert tokens.is_contiguous() and result.is_contiguous() and hidden_rows.stride(1) == 1, "contiguous rows"
    h = hidden_rows.shape[1]
    _greedy_tail_kernel[(b,)](slots, tokens, greedy, hidden_rows, seq_len, last_token, state_hidden, result, h,
                              hidden_rows.stride(0), state_hidden.stride(0), T=t, BLOCK_T=max(2, next_pow2(t)),
                              BLOCK_H=min(1024, next_pow2(h)), num_warps=4)
