"""The greedy decode tail (kernels/decode_tail.py) against the eager path it replaces: argmax
token selection, MTP's greedy accept (``spec.verify``) and the slot-state update
(``ModelRunner._commit``); padding rows (slot 0) leave every slot untouched."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import enable_cpu_kernels
from gpu_worker.kernels.decode_tail import greedy_tail, greedy_tail_reference
from gpu_worker.step.sampling import RowSampling
from gpu_worker.spec.mtp import verify

pytest.importorskip("triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS, H, V = 9, 40, 7


def _state(g):
    return (torch.randint(0, 100, (SLOTS,), generator=g).to(DEV), torch.randint(0, V, (SLOTS,), generator=g).to(DEV),
            torch.randn(SLOTS, H, generator=g).to(torch.bfloat16).to(DEV))


def _eager(slots, n, tokens, logits, hidden, seq, last, state):
    """The runner's path for the n real rows: verify (t > 1) or argmax, then the state update."""
    t = tokens.shape[1]
    real = slots[:n]
    if t == 1:
        out, acc = logits[:n].argmax(-1)[:, None], torch.ones(n, dtype=torch.int64, device=DEV)
    else:
        rs = RowSampling.__new__(RowSampling)
        rs.any_random = False
        out, acc = verify(logits[: n * t], tokens[:n, 1:], rs, seq[real])
    seq[real] += acc
    last[real] = out.gather(1, (acc - 1)[:, None]).squeeze(1)
    state[real] = hidden[torch.arange(n, device=DEV) * t + acc - 1]
    return out, acc


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("t", [1, 2, 4])
def test_tail_equals_eager_path(kernel, t):
    g = torch.Generator().manual_seed(t)
    n, b = 3, 5  # three real rows in a bucket of five: two padding rows at slot 0
    slots = torch.tensor([4, 1, 7, 0, 0], device=DEV)
    logits = torch.randn(b * t, V, generator=g).to(DEV)
    greedy = logits.argmax(-1)
    # drafts that match the target's argmax for a while, then miss (row 0 all, row 2 none)
    tokens = torch.randint(0, V, (b, t), generator=g).to(DEV)
    tokens[0, 1:] = greedy.view(b, t)[0, : t - 1]
    if t > 2:
        tokens[1, 1:2] = greedy.view(b, t)[1, :1]
        tokens[1, 2] = (greedy.view(b, t)[1, 1] + 1) % V
    hidden = torch.randn(b * t, H, generator=g).to(torch.bfloat16).to(DEV)
    seq, last, state = _state(g)
    want_state = [x.clone() for x in (seq, last, state)]
    out, acc = _eager(slots, n, tokens, logits, hidden, *want_state)
    result = torch.full((b, t + 1), -1, dtype=torch.int32, device=DEV)
    enable_cpu_kernels(kernel)
    try:
        (greedy_tail if kernel else greedy_tail_reference)(slots, tokens, greedy, hidden, seq, last, state, result)
    finally:
        enable_cpu_kernels(False)
    assert torch.equal(result[:n, :t], out.to(torch.int32)) and torch.equal(result[:n, t], acc.to(torch.int32))
    for got, want in zip((seq, last, state), want_state):
        assert torch.equal(got, want)  # real rows updated as the eager path does; slot 0 untouched
    if t == 4:  # every draft accepted (row 0), one then a miss (row 1)
        assert result[0, t] == 4 and result[1, t] == 2
