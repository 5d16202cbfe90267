"""Bookkeeping of the GPU hot path that CI can check without a GPU: the step's typed upload,
graph buckets, split counts and backend resolution."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from gpu_worker.attention import resolve_backend
from gpu_worker.graphs.decode import DEFAULT_BUCKETS, graph_buckets
from gpu_worker.upload import PinnedRing, _padded, staged


@dataclass
class _Inner:
    flags: torch.Tensor = staged()


@dataclass
class _Outer:
    host: np.ndarray  # not staged: stays on the host
    slots: torch.Tensor = staged()
    temp: torch.Tensor = staged()
    table: torch.Tensor = staged()
    inner: _Inner | None = staged(default=None)
    absent: _Inner | None = staged(default=None)


def test_upload_round_trips_ints_floats_and_shapes():
    up = PinnedRing(torch.device("cpu")).upload()
    x = up.add(_Outer(host=np.arange(3), slots=np.array([3, 1, 2], dtype=np.int32), temp=np.array([0.5, 1.25]),
                      table=np.arange(6).reshape(2, 3), inner=_Inner(np.array([True, False]))))
    assert up.add(None) is None
    up.send()
    assert x.slots.dtype == torch.int64 and x.slots.tolist() == [3, 1, 2]
    assert x.temp.dtype == torch.float64 and x.temp.tolist() == [0.5, 1.25]
    assert x.table.shape == (2, 3) and x.table.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert x.inner.flags.tolist() == [1, 0] and x.absent is None
    assert isinstance(x.host, np.ndarray)


def test_staged_arrays_start_16_byte_aligned():
    # Triton specialises kernels on pointer alignment: odd-length arrays must not shift the next.
    assert [_padded(n) for n in (0, 1, 2, 3, 8)] == [0, 2, 2, 4, 8]


def test_graph_buckets_cover_the_largest_batch():
    assert graph_buckets(None, 256, 64)[-1] == 64
    assert graph_buckets(None, 100, 300)[-1] == 100
    assert set(graph_buckets(None, None, 256)) <= set(DEFAULT_BUCKETS) | {256}
    assert graph_buckets((1, 3, 500), None, 64) == [1, 3]  # explicit list, capped by the slots
    assert graph_buckets(None, 5, 64) == [1, 2, 4, 5]


def test_decode_split_count_depends_on_the_batch_only():
    pytest.importorskip("triton")
    from gpu_worker.attention.triton_backend import decode_splits

    assert decode_splits(1, 8, 132) == 16
    assert decode_splits(64, 8, 132) == 1
    assert all(decode_splits(b, 8, 132) & (decode_splits(b, 8, 132) - 1) == 0 for b in range(1, 300))


def test_launch_order_only_where_programs_outnumber_the_sms():
    pytest.importorskip("triton")
    import torch

    from gpu_worker.attention.triton_backend import launch_order

    lens = torch.tensor([5, 900, 40, 2000] * 10)
    order = launch_order(lens, 8, 1, 132)  # 40 rows x 8 heads > 264: more than one wave
    assert order is not None and sorted(order.tolist()) == list(range(40))
    assert lens[order].tolist() == sorted(lens.tolist(), reverse=True)
    assert launch_order(lens[:32], 8, 1, 132) is None  # 256 programs: one wave
    assert launch_order(lens, 8, 2, 132) is None  # split rows: few rows, one wave


def test_auto_on_cuda_is_triton_then_flashinfer(monkeypatch):
    import gpu_worker.attention as att
    import gpu_worker.kernels as k

    monkeypatch.setattr(k, "triton_available", lambda: True)
    assert resolve_backend("auto", "cuda") == "triton"  # faster for our decode shapes (docs/decisions/attention.md)
    monkeypatch.setattr(k, "triton_available", lambda: False)
    monkeypatch.setattr(att, "flashinfer_available", lambda: True)
    assert resolve_backend("auto", "cuda") == "flashinfer"
    monkeypatch.setattr(att, "flashinfer_available", lambda: False)
    assert resolve_backend("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match="flashinfer is not installed"):
        resolve_backend("flashinfer", "cuda")


@pytest.mark.parametrize("name,device,expect", [
    ("auto", "cpu", "torch"), ("torch", "cuda", "torch"), ("flashinfer", "cpu", None), ("triton", "cpu", "interp"),
])
def test_backend_resolution(name, device, expect, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if expect is None:
        with pytest.raises(ValueError, match="--attention-backend flashinfer"):
            resolve_backend(name, device)
    elif expect == "interp":
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            resolve_backend(name, device)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert resolve_backend(name, device) == "triton"
    else:
        assert resolve_backend(name, device) == expect


def test_decode_group_takes_only_the_engines_decode_query_counts():
    """Only a tail of rows with a decode count (1; S+1 with MTP) is a decode group; a short
    prefill row of another count goes to the extend kernel, whose launch shape does not depend
    on it (the decode kernel compiled a variant per new count while serving)."""
    import numpy as np

    from gpu_worker.attention.triton_backend import decode_start

    plain, mtp = frozenset({1}), frozenset({1, 4})
    assert decode_start(np.array([30, 1, 1]), plain) == 1
    assert decode_start(np.array([8]), plain) == 1  # an 8-token prompt alone: extend
    assert decode_start(np.array([30, 8]), plain) == 2
    assert decode_start(np.array([1]), plain) == 0  # a 1-token prompt: the T=1 decode variant
    assert decode_start(np.array([30, 4, 4]), mtp) == 1  # verify rows
    assert decode_start(np.array([4]), mtp) == 0  # a 4-token prompt shares verify's variant
    assert decode_start(np.array([30, 3]), mtp) == 2
    assert decode_start(np.array([20, 20]), frozenset({20})) == 2  # never past DECODE_MAX_Q
