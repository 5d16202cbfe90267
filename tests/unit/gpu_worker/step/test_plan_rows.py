"""A plan's host rows (gpu_worker/step/batch.py: PlanRows) and the worker's host half of a step
(ModelRunner.stage, slots.advance_host): the decode-only fast path gives the same rows as the
general one, its shared empty arrays cannot be written, the result order is made once, and the
host lengths advance as before (prefill rows to their chunk's end, decode rows by one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.step.batch import PlanRows
from gpu_worker.step.slots import SlotState
from proto.arrays import pack_i32
from proto.messages import ExtendRow, StepPlan


def test_decode_only_rows_match_the_general_path():
    plan = StepPlan(3, decode_slots=pack_i32([4, 2, 7]))
    rows = PlanRows.from_plan(plan)
    assert rows.decode_only and rows.dec_slots.dtype == np.int64 and rows.dec_slots.tolist() == [4, 2, 7]
    for a in (rows.ext_slots, rows.ext_start, rows.ext_len, rows.ext_tokens):
        assert a.dtype == np.int64 and a.size == 0
    assert rows.ext_sample.dtype == bool and rows.ext_sample.size == 0
    assert rows.sampled_ext_rows().size == 0 and rows.num_ext_tokens == 0
    assert rows.q_lens(4).tolist() == [4, 4, 4]
    with pytest.raises(ValueError):
        rows.ext_slots[rows.ext_slots] = 1  # shared by every decode-only step: read-only
    assert rows.result_slots() is rows.result_slots()  # made once
    assert rows.result_slots().tolist() == [4, 2, 7]


def test_mixed_rows_and_result_order():
    plan = StepPlan(1, extend=[ExtendRow(5, 0, pack_i32([1, 2, 3]), True), ExtendRow(6, 8, pack_i32([9]), False)],
                    decode_slots=pack_i32([2]))
    rows = PlanRows.from_plan(plan)
    assert not rows.decode_only
    assert rows.ext_len.tolist() == [3, 1] and rows.ext_tokens.tolist() == [1, 2, 3, 9]
    assert rows.result_slots().tolist() == [5, 2]  # sampled extend rows, then decode rows


def test_advance_host():
    st = SlotState(8, 4, 16, "cpu", torch.float32)
    st.seq_host[:] = [0, 0, 5, 0, 0, 0, 0, 0, 0]
    mixed = PlanRows.from_plan(StepPlan(1, extend=[ExtendRow(5, 8, pack_i32([1, 2, 3]), True)],
                                        decode_slots=pack_i32([2])))
    st.advance_host(mixed)
    assert st.seq_host[5] == 11 and st.seq_host[2] == 6
    st.advance_host(PlanRows.from_plan(StepPlan(2, decode_slots=pack_i32([2, 5]))))
    assert st.seq_host[5] == 12 and st.seq_host[2] == 7
    st.free([])  # nothing to free: no change
    assert st.seq_host[5] == 12
