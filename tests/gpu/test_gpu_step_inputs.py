"""The per-step work outside the layers on the GPU: the decode inputs kernel compiled (equal to
its torch twin, in a CUDA-graph replay too, where the graph reads slot state written after
capture), and a staging batch with nothing to copy consuming no pinned buffer."""

from __future__ import annotations

import numpy as np
import torch

from gpu_worker.kernels.decode_inputs import decode_inputs, decode_inputs_reference
from gpu_worker.staging import Staging


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


def test_empty_staging_batch_takes_no_buffer():
    stage = Staging(torch.device("cuda"))
    b = stage.batch()
    b.put("samp_ext_slots", np.zeros(0, dtype=np.int64))
    b.upload()
    assert b["samp_ext_slots"].numel() == 0 and stage._next == 0  # no pinned buffer, no copy
    b = stage.batch()
    b.put("x", np.arange(5))
    b.put("y", np.array([0.5, -2.0]))
    b.upload()
    assert b["x"].tolist() == list(range(5)) and b["y"].tolist() == [0.5, -2.0] and stage._next == 1
