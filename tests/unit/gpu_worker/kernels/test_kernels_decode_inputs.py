"""A decode step's inputs from slot state (kernels/decode_inputs.py): the kernel equals its torch
twin exactly, for plain decode (t = 1, the bonus written) and MTP verify (t = 4, no bonus),
rows whose tokens cross a page boundary, padding rows (slot 0), a page table wider than the
rows use; the torch path where Triton does not run."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.kernels.decode_inputs import decode_inputs, decode_inputs_reference, draft_inputs, draft_inputs_reference

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _state(page: int, slots: int = 6, cols: int = 9):
    g = torch.Generator().manual_seed(page)
    seq_len = torch.tensor([0, 5, page - 1, 3 * page - 2, 1, 2 * page], dtype=torch.int64)[:slots]
    last_token = torch.randint(0, 1000, (slots,), generator=g)
    last_token[0] = 0
    page_table = torch.randint(1, 500, (slots, cols), generator=g, dtype=torch.int64).to(torch.int32)
    page_table[0] = 0  # the padding row's pages are page 0
    return seq_len.to(DEV), last_token.to(DEV), page_table.to(DEV)


def _run(fn, slots, state, page, t, with_tokens):
    seq_len, last_token, page_table = state
    tokens = torch.full((slots.shape[0], t), -7, dtype=torch.int64, device=DEV) if with_tokens else None
    outs = fn(slots, seq_len, last_token, page_table, page, t, tokens)
    return outs, tokens


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("t,with_tokens", [(1, True), (4, False), (4, True)])
def test_kernel_equals_torch(page, t, with_tokens):
    state = _state(page)
    slots = torch.tensor([3, 1, 5, 2, 0, 0], dtype=torch.int64, device=DEV)  # two padding rows
    enable_cpu_kernels(True)
    try:
        got, got_tok = _run(decode_inputs, slots, state, page, t, with_tokens)
    finally:
        enable_cpu_kernels(False)
    want, want_tok = _run(decode_inputs_reference, slots, state, page, t, with_tokens)
    for g, w, name in zip(got, want, ("seq", "pos", "out_loc", "kv_len")):
        assert g.dtype == torch.int64 and torch.equal(g, w), name
    if with_tokens:
        assert torch.equal(got_tok, want_tok)
        assert torch.equal(got_tok[:, 1:], torch.full_like(got_tok[:, 1:], -7))  # only column 0 written


def test_reference_values():
    """The torch twin by hand: row of slot 3 (length 3*16-2) crosses into its page column 3."""
    seq_len, last_token, page_table = _state(16)
    slots = torch.tensor([3, 0], dtype=torch.int64, device=DEV)
    tokens = torch.zeros(2, 4, dtype=torch.int64, device=DEV)
    seq, pos, loc, kv = decode_inputs_reference(slots, seq_len, last_token, page_table, 16, 4, tokens)
    assert seq.tolist() == [46, 0] and kv.tolist() == [50, 4]
    assert pos.tolist() == [46, 47, 48, 49, 0, 1, 2, 3]
    pt = page_table[3].long()
    assert loc[:4].tolist() == [int(pt[2]) * 16 + 14, int(pt[2]) * 16 + 15, int(pt[3]) * 16, int(pt[3]) * 16 + 1]
    assert loc[4:].tolist() == [0, 1, 2, 3]  # padding: page 0
    assert tokens[:, 0].tolist() == [int(last_token[3]), 0]


def test_torch_path_without_kernels():
    """CPU tensors with the kernels off take the reference (no interpreter needed)."""
    state = _state(16)
    slots = torch.tensor([1, 2], dtype=torch.int64, device=DEV)
    got, _ = _run(decode_inputs, slots, state, 16, 2, True)
    want, _ = _run(decode_inputs_reference, slots, state, 16, 2, True)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("h", [40, 1024 + 24])  # one block, and past one
@pytest.mark.parametrize("offset", [0, 3])
def test_draft_inputs_kernel_equals_torch(h, offset):
    """The MTP draft loop's head: the bonus into column 0 only, lengths and both positions, each
    row's hidden seed (padding rows read slot 0)."""
    seq_len, last_token, _ = _state(16)
    g = torch.Generator().manual_seed(h)
    hidden = torch.randn(seq_len.shape[0], h, generator=g).to(torch.bfloat16).to(DEV)
    slots = torch.tensor([3, 1, 5, 0], dtype=torch.int64, device=DEV)
    outs = []
    for fn, kernels in ((draft_inputs, True), (draft_inputs_reference, False)):
        tokens = torch.full((4, 4), -7, dtype=torch.int64, device=DEV)
        enable_cpu_kernels(kernels)
        try:
            outs.append((fn(slots, seq_len, last_token, hidden, tokens, offset), tokens))
        finally:
            enable_cpu_kernels(False)
    (got, got_tok), (want, want_tok) = outs
    for g_, w, name in zip(got, want, ("seq", "q_pos", "rope_pos", "hidden")):
        assert g_.dtype == w.dtype and torch.equal(g_, w), name
    assert torch.equal(got_tok, want_tok) and (got_tok[:, 1:] == -7).all()
    assert want[1].tolist() == [v - 1 for v in want[0].tolist()]
    assert want[2].tolist() == [v + offset for v in want[0].tolist()]
    assert torch.equal(want[3][1], hidden[1]) and got_tok[:, 0].tolist() == last_token[slots].tolist()
