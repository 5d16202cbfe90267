"""``TANDEM_FUSED_GLUE`` (gpu_worker/kernels/__init__.py): on by default; with ``0`` the draft
loop's head, Gemma's scaled embedding and final softcap run torch's ops even where Triton runs
the tensors (the kernels are replaced by None here: a launch would fail), with the same results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import decode_inputs as DI
from gpu_worker.kernels import embed as E
from gpu_worker.kernels import enable_cpu_kernels, fused_glue
from gpu_worker.kernels import softcap as S

pytest.importorskip("triton")


def test_off_runs_torch_ops(monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED_GLUE", "0")
    assert not fused_glue()
    for mod, name in ((DI, "_draft_inputs_kernel"), (E, "_embed_cat_kernel"), (S, "_softcap_kernel")):
        monkeypatch.setattr(mod, name, None)
    enable_cpu_kernels(True)
    try:
        slots = torch.tensor([2, 0])
        seq_len, last, hidden = torch.tensor([0, 4, 9]), torch.tensor([0, 11, 12]), torch.randn(3, 8)
        tokens = torch.zeros(2, 4, dtype=torch.int64)
        seq, q_pos, rope, hid = DI.draft_inputs(slots, seq_len, last, hidden, tokens, 0)
        assert seq.tolist() == [9, 0] and q_pos.tolist() == [8, -1] and rope.tolist() == [9, 0]
        assert torch.equal(hid, hidden[slots]) and tokens[:, 0].tolist() == [12, 0]
        table, ids = torch.randn(5, 8, dtype=torch.bfloat16), torch.tensor([4, 1])
        assert torch.equal(E.embed_scaled(ids, table, 2.5), F.embedding(ids, table) * 2.5)
        x = torch.randn(2, 30, dtype=torch.bfloat16)
        assert torch.equal(S.softcap_float(x, 30.0), torch.tanh(x.float() / 30.0) * 30.0)
    finally:
        enable_cpu_kernels(False)


@pytest.mark.parametrize("value", [None, "1"])
def test_on_by_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TANDEM_FUSED_GLUE", raising=False)
    else:
        monkeypatch.setenv("TANDEM_FUSED_GLUE", value)
    assert fused_glue()
