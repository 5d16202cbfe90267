"""The per-step work outside the layers on the GPU: the decode and draft inputs kernels compiled
(equal to their torch twins, in a CUDA-graph replay too, where the graph reads slot state written
after capture); Gemma's scaled embedding kernel bitwise torch's ops, its final-logit softcap
within 2 ulp; an upload with nothing to copy consuming no pinned buffer."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.kernels.decode_inputs import (decode_inputs, decode_inputs_reference, draft_inputs,
                                              draft_inputs_reference)
from gpu_worker.kernels.embed import embed_scaled
from gpu_worker.kernels.softcap import softcap_float, softcap_reference
from gpu_worker.upload import PinnedRing


def _state(slots=40, cols=64, page=16):
    g = torch.Generator().manual_seed(0)
    seq_len = torch.randint(1, cols * page - 8, (slots,), generator=g)
    seq_len[0] = 0
    last = torch.randint(0, 150000, (slots,), generator=g)
    pt = torch.randint(1, 10000, (slots, cols), generator=g).to(torch.int32)
    pt[0] = 0
    return seq_len.cuda(), last.cuda(), pt.cuda()


def test_decode_inputs_compiled_and_replayed():
    seq_len, last, pt = _state()
    slots = torch.tensor([7, 3, 39, 1] + [0] * 4, device="cuda")
    for t, bonus in ((1, True), (4, False)):
        tok = torch.zeros(8, t, dtype=torch.int64, device="cuda") if bonus else None
        got = decode_inputs(slots, seq_len, last, pt, 16, t, tok)
        ref_tok = torch.zeros_like(tok) if bonus else None
        want = decode_inputs_reference(slots, seq_len, last, pt, 16, t, ref_tok)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        if bonus:
            assert torch.equal(tok, ref_tok)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = decode_inputs(slots, seq_len, last, pt, 16, t, tok)
        seq_len[7] += 17  # state changes after capture: the replay reads it
        slots[1] = 5
        graph.replay()
        torch.cuda.synchronize()
        want = decode_inputs_reference(slots, seq_len, last, pt, 16, t, ref_tok)
        assert all(torch.equal(a, b) for a, b in zip(outs, want))
        slots[1] = 3


def test_draft_inputs_compiled_and_replayed():
    seq_len, last, _ = _state()
    hidden = torch.randn(seq_len.shape[0], 3840, device="cuda").to(torch.bfloat16)
    slots = torch.tensor([7, 3, 39, 1] + [0] * 4, device="cuda")
    tok, ref_tok = (torch.zeros(8, 4, dtype=torch.int64, device="cuda") for _ in range(2))
    got = draft_inputs(slots, seq_len, last, hidden, tok, 0)
    want = draft_inputs_reference(slots, seq_len, last, hidden, ref_tok, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(tok, ref_tok)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = draft_inputs(slots, seq_len, last, hidden, tok, 0)
    seq_len[7] += 17  # state changes after capture: the replay reads it
    hidden[5] = 1.5
    slots[1] = 5
    graph.replay()
    torch.cuda.synchronize()
    want = draft_inputs_reference(slots, seq_len, last, hidden, ref_tok, 0)
    assert all(torch.equal(a, b) for a, b in zip(outs, want)) and torch.equal(tok, ref_tok)


def test_softcap_and_scaled_embedding_equal_torch():
    g = torch.Generator(device="cuda").manual_seed(0)
    full = (torch.randn(6, 262144, device="cuda", generator=g) * 40).to(torch.bfloat16)
    x = full[2:]  # the decode rows after two prefill rows
    got, want = softcap_float(x, 30.0), softcap_reference(x, 30.0)
    # The same float32 operations as torch's CUDA kernels; libdevice's tanh against the toolkit's
    # tanhf may differ in the last bits (|values| < 30: an ulp is at most 2**-19).
    torch.testing.assert_close(got, want, rtol=0, atol=2.0**-18)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    table = torch.randn(1000, 3840, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.tensor([[5, 0], [999, 0], [5, 0]], device="cuda")[:, 0]  # strided, a repeat
    scale = float(torch.tensor(3840**0.5).to(torch.bfloat16))
    assert torch.equal(embed_scaled(ids, table, scale), F.embedding(ids, table) * scale)


def test_empty_upload_takes_no_buffer():
    from gpu_worker.step.inputs import SampledRows

    ring = PinnedRing(torch.device("cuda"))
    up = ring.upload()
    empty = up.add(SampledRows(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)))
    up.send()
    assert empty.slots.numel() == 0 and ring._next == 0  # no pinned buffer, no copy
    up = ring.upload()
    rows = up.add(SampledRows(np.arange(5), np.array([0.5, -2.0])))
    up.send()
    assert rows.slots.tolist() == list(range(5)) and rows.pos.tolist() == [0.5, -2.0] and ring._next == 1
