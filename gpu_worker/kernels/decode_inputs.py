"""A decode step's inputs from slot state in one launch.

A graph-replayed decode step starts from slot ids alone (``cuda_graphs.py``). Per row b (slot
``slots[b]``, committed length ``seq = seq_len[slot]``) and each of its ``t`` tokens i:

    pos[b*t + i]     = seq + i
    out_loc[b*t + i] = page_table[slot, pos // page] * page + pos % page   (where its KV goes)
    kv_len[b]        = seq + t                                            (keys it attends to)
    seq_out[b]       = seq
    tokens[b, 0]     = last_token[slot]            (plain decode: the bonus is the input token)

In torch that is about a dozen gathers and elementwise ops, each a launch before the first
layer of a one-row step; here it is one. Padding rows (slot 0, length 0, page 0) get positions 0..t-1 on page 0.

``draft_inputs`` is the same for the head of the MTP draft loop (``cuda_graphs.DecodeBody.draft``):
the bonus into ``tokens[:, 0]``, the committed length, the Q-only position ``seq - 1``, the draft's
RoPE position ``seq + offset`` and each row's hidden seed ``hidden[slot]``: six torch kernels in
one.
"""

from __future__ import annotations

import torch

from gpu_worker.kernels import next_pow2, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path below
    triton = None

if triton is not None:

    @triton.jit
    def _decode_inputs_kernel(slots_ptr, seq_ptr, last_ptr, pt_ptr, tok_ptr, pos_ptr, loc_ptr, kv_ptr, seq_out_ptr,
                              s_pt, s_tok, T: tl.constexpr, BLOCK_T: tl.constexpr, PAGE: tl.constexpr,
                              BONUS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        seq = tl.load(seq_ptr + slot).to(tl.int64)
        i = tl.arange(0, BLOCK_T)
        m = i < T
        pos = seq + i
        page = tl.load(pt_ptr + slot * s_pt + pos // PAGE, mask=m, other=0).to(tl.int64)
        tl.store(pos_ptr + b * T + i, pos, mask=m)
        tl.store(loc_ptr + b * T + i, page * PAGE + pos % PAGE, mask=m)
        tl.store(kv_ptr + b, seq + T)
        tl.store(seq_out_ptr + b, seq)
        if BONUS:
            tl.store(tok_ptr + b * s_tok, tl.load(last_ptr + slot))


    @triton.jit
    def _draft_inputs_kernel(slots_ptr, seq_ptr, last_ptr, hid_ptr, tok_ptr, seq_out_ptr, qpos_ptr, rope_ptr,
                             hid_out_ptr, H, s_hid, s_hid_out, s_tok, OFFSET, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        seq = tl.load(seq_ptr + slot).to(tl.int64)
        tl.store(tok_ptr + b * s_tok, tl.load(last_ptr + slot))
        tl.store(seq_out_ptr + b, seq)
        tl.store(qpos_ptr + b, seq - 1)
        tl.store(rope_ptr + b, seq + OFFSET)
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, H, BLOCK):
            c = c0 + cols
            tl.store(hid_out_ptr + b * s_hid_out + c, tl.load(hid_ptr + slot * s_hid + c, mask=c < H), mask=c < H)


def draft_inputs_reference(slots, seq_len, last_token, hidden, tokens, offset: int):
    """The torch twin of ``draft_inputs``."""
    seq = seq_len[slots]
    tokens[:, 0] = last_token[slots]
    return seq, seq - 1, seq + offset, hidden[slots]


def draft_inputs(slots: torch.Tensor, seq_len: torch.Tensor, last_token: torch.Tensor, hidden: torch.Tensor,
                 tokens: torch.Tensor, offset: int):
    """slots [B] -> (seq [B], q_pos = seq - 1 [B], rope_pos = seq + offset [B], hidden[slots] [B, H]),
    and ``tokens[:, 0] = last_token[slots]``. Graph-capturable (fixed shapes, no host reads).
    The kernel where Triton runs the tensors, the torch twin elsewhere."""
    if not use_triton(slots) or hidden.stride(1) != 1:
        return draft_inputs_reference(slots, seq_len, last_token, hidden, tokens, offset)
    b, h = slots.shape[0], hidden.shape[1]
    seq = torch.empty(b, dtype=torch.int64, device=slots.device)
    q_pos, rope = torch.empty_like(seq), torch.empty_like(seq)
    hid = torch.empty((b, h), dtype=hidden.dtype, device=hidden.device)
    if b:
        _draft_inputs_kernel[(b,)](slots, seq_len, last_token, hidden, tokens, seq, q_pos, rope, hid, h,
                                   hidden.stride(0), hid.stride(0), tokens.stride(0), offset,
                                   BLOCK=min(1024, next_pow2(h)), num_warps=4)
    return seq, q_pos, rope, hid


def decode_inputs_reference(slots, seq_len, last_token, page_table, page_size: int, t: int, tokens=None):
    """The torch twin: the same outputs (see the module docstring)."""
    seq = seq_len[slots]
    pos = (seq[:, None] + torch.arange(t, device=slots.device)[None, :]).reshape(-1)
    tok_slot = slots[:, None].expand(-1, t).reshape(-1)
    out_loc = page_table[tok_slot, pos // page_size].long() * page_size + pos % page_size
    if tokens is not None:
        tokens[:, 0] = last_token[slots]
    return seq, pos, out_loc, seq + t


def decode_inputs(slots: torch.Tensor, seq_len: torch.Tensor, last_token: torch.Tensor, page_table: torch.Tensor,
                  page_size: int, t: int, tokens: torch.Tensor | None = None):
    """slots [B] int64 -> (seq [B], pos [B*t], out_loc [B*t], kv_len [B]), all int64; with
    ``tokens`` [B, >=1] also writes each row's bonus (``last_token[slot]``) into column 0.
    Graph-capturable (fixed shapes, no host reads)."""
    if not use_triton(slots) or page_table.stride(1) != 1:
        return decode_inputs_reference(slots, seq_len, last_token, page_table, page_size, t, tokens)
    b = slots.shape[0]
    seq = torch.empty(b, dtype=torch.int64, device=slots.device)
    kv = torch.empty_like(seq)
    pos = torch.empty(b * t, dtype=torch.int64, device=slots.device)
    loc = torch.empty_like(pos)
    if b:
        _decode_inputs_kernel[(b,)](slots, seq_len, last_token, page_table, tokens if tokens is not None else pos,
                                    pos, loc, kv, seq, page_table.stride(0),
                                    tokens.stride(0) if tokens is not None else 0, T=t,
                                    BLOCK_T=max(2, next_pow2(t)), PAGE=page_size, BONUS=tokens is not None,
                                    num_warps=1)
    return seq, pos, loc, kv
