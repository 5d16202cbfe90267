"""A graph bucket's slot buffer is uploaded only when the step's rows differ from the last step
of that bucket (``DecodeGraphs.holds`` / ``run``), Checked with the eager twin of the graphs (CPU): every replay must see exactly
its step's slots, whatever the order of buckets and row changes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpu_worker.graphs.decode import DecodeGraphs


class _Body:
    """Records the slots each forward saw."""

    def __init__(self):
        self.state = SimpleNamespace(device=torch.device("cpu"))
        self.t, self.assistant, self.seen = 1, None, []

    def draft(self, slots, tokens):
        pass

    def forward(self, slots, tokens):
        self.seen.append(slots.tolist())
        return torch.zeros(slots.shape[0], 2), torch.zeros(slots.shape[0], 3)

    def tail(self, *args):
        pass


def _pad(rows, bucket):
    p = np.zeros(bucket, dtype=np.int64)
    p[: len(rows)] = rows
    return p


def test_slots_upload_only_when_the_rows_change():
    body = _Body()
    graphs = DecodeGraphs(body, [1, 4], emulate=True)
    steps = [[3], [3], [5, 2], [5, 2], [5, 2, 7], [5, 7], [3], [5, 7], [2, 5, 7]]
    uploads = 0
    for rows in steps:
        size = graphs.bucket(len(rows))
        pad = _pad(rows, size)
        dev = None
        if not graphs.holds(size, pad):
            dev, uploads = torch.from_numpy(pad.copy()), uploads + 1
        graphs.run(len(rows), pad, dev, lambda: None)
        assert body.seen[-1] == pad.tolist()
        assert graphs.slots(len(rows)).tolist() == list(rows)
    # [3] | held | [5,2] | held | [5,2,7] | [5,7] | [3]: bucket 1 still holds it | [5,7]: so does
    # bucket 4 | [2,5,7]
    assert uploads == 5


def test_run_refuses_slots_it_neither_holds_nor_receives():
    graphs = DecodeGraphs(_Body(), [2], emulate=True)
    assert graphs.holds(2, np.zeros(2, dtype=np.int64))  # a fresh buffer holds padding
    with pytest.raises(AssertionError):
        graphs.run(1, _pad([4], 2), None, lambda: None)

