"""A stand-in for ``flashinfer``'s two paged wrappers, for CPU tests of our flashinfer backend.

Same constructor, ``plan()`` and ``run()`` signatures as flashinfer 0.6.6 (positional order
included). ``run`` computes attention in torch from exactly what the real kernels read: the
device-side ``indptr`` / ``indices`` / ``last_page_len`` (the CUDA-graph buffers when the wrapper
has them), the causal rule ``j <= kv_len - qo_len + i``, ``window_left``, the soft cap and
``sm_scale``. It also checks what the real kernels trust but do not check: every row's device
length equals the length ``plan()`` saw on the host (a shorter row underflows a split there).
"""

from __future__ import annotations

import math
import types

import torch


class _Paged:
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **bufs):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.bufs = bufs
        self.plans = 0

    def _store(self, name: str, host_or_dev: torch.Tensor) -> torch.Tensor:
        buf = self.bufs.get(name)
        if self.graph:
            assert buf is not None, f"{name}: cuda-graph wrappers need their buffers"
            buf[: len(host_or_dev)].copy_(host_or_dev)
            return buf
        return host_or_dev.clone()

    def _plan(self, qo_indptr, indptr, indices, last, q_heads, kv_heads, head_dim, page_size, causal,
              window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type=None):
        for t in (qo_indptr, indptr, last):
            assert t.device.type == "cpu" and t.dtype == torch.int32, "plan() reads these on the host"
        assert indices.dtype == torch.int32 and q_heads % kv_heads == 0 and len(indptr) == len(last) + 1
        self.plans += 1
        self.qo_indptr = qo_indptr.clone()
        self.indptr = self._store("paged_kv_indptr_buffer", indptr)
        self.indices = self._store("paged_kv_indices_buffer", indices)
        self.last = self._store("paged_kv_last_page_len_buffer", last)
        self.planned_kv = ((indptr[1:] - indptr[:-1] - 1) * page_size + last).tolist()
        self.shape = (q_heads, kv_heads, head_dim, page_size)
        self.causal, self.window_left = causal, window_left
        self.softcap = logits_soft_cap or 0.0
        self.scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dtype = q_data_type
        self.kv_dtype = kv_data_type or q_data_type

    def run(self, q, paged_kv_cache, *args, k_scale=None, v_scale=None, out=None, **kwargs):
        """``k_scale`` / ``v_scale``: an FP8 cache's scales (the real kernels fold k's into the
        softmax scale and v's into the output: the same as reading dequantized values)."""
        k_cache, v_cache = paged_kv_cache
        q_heads, kv_heads, head_dim, ps = self.shape
        assert q.dtype == self.dtype and q.shape[1:] == (q_heads, head_dim) and k_cache.shape[1:] == (ps, kv_heads, head_dim)
        assert k_cache.dtype == self.kv_dtype, f"planned for {self.kv_dtype} KV, ran on {k_cache.dtype}"
        qo = self.qo_indptr.tolist()
        assert qo[-1] == q.shape[0]
        indptr, last = self.indptr.tolist(), self.last.tolist()
        res = torch.empty(q.shape[0], q_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)
        group = q_heads // kv_heads
        for b in range(len(qo) - 1):
            kv_len = (indptr[b + 1] - indptr[b] - 1) * ps + last[b]
            assert kv_len == self.planned_kv[b], f"row {b}: device KV length {kv_len}, planned {self.planned_kv[b]}"
            pages = self.indices[indptr[b]: indptr[b + 1]].long()
            k = k_cache[pages].reshape(-1, kv_heads, head_dim)[:kv_len].float().repeat_interleave(group, 1)
            v = v_cache[pages].reshape(-1, kv_heads, v_cache.shape[-1])[:kv_len].float().repeat_interleave(group, 1)
            k, v = k * (k_scale or 1.0), v * (v_scale or 1.0)
            qb = q[qo[b]: qo[b + 1]].float()
            s = torch.einsum("qhd,khd->hqk", qb, k) * self.scale
            if self.softcap:
                s = self.softcap * torch.tanh(s / self.softcap)
            i = torch.arange(qb.shape[0])[:, None] + (kv_len - qb.shape[0])  # the query's position
            j = torch.arange(kv_len)[None, :]
            mask = j <= i if self.causal else torch.ones_like(j <= i)
            if self.window_left >= 0:
                mask &= j >= i - self.window_left
            s = s.masked_fill(~mask[None], float("-inf"))
            res[qo[b]: qo[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)
        if out is not None:
            out.copy_(res)
            return out
        return res


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        assert backend in ("auto", "fa2", "fa3")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         paged_kv_indptr_buffer=paged_kv_indptr_buf, paged_kv_indices_buffer=paged_kv_indices_buf,
                         paged_kv_last_page_len_buffer=paged_kv_last_page_len_buf)

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             **kwargs):
        self._plan(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                   num_kv_heads, head_dim_qk, page_size, causal, window_left, logits_soft_cap, sm_scale, q_data_type,
                   kv_data_type)


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        self.use_tensor_cores = use_tensor_cores
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph,
                         paged_kv_indptr_buffer=paged_kv_indptr_buffer, paged_kv_indices_buffer=paged_kv_indices_buffer,
                         paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, **kwargs):
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, False,
                   window_left, logits_soft_cap, sm_scale, q_data_type, kv_data_type)


def module() -> types.ModuleType:
    m = types.ModuleType("flashinfer")
    m.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper
    m.BatchDecodeWithPagedKVCacheWrapper = BatchDecodeWithPagedKVCacheWrapper
    m.__version__ = "fake"
    return m
