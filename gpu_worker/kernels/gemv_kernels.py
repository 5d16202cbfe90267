"""The GEMV kernels behind ``kernels/gemv.py`` (which holds the launcher, the shapes each one
takes and why): the FMA kernel (M fp32 accumulators, one reduction per K tile) and the
tensor-core kernel (x padded to MP rows), each with the gated epilogue (``ACT`` >= 0: W is
``[gate; up]`` and the output ``act(gate) * up``) and split-K (``SPLITS`` > 1: fp32 partials,
summed in split order by the last program of a column tile, which takes a ticket)."""

from __future__ import annotations

from gpu_worker.kernels.gdc import gdc_enter, prefetch_l2

try:
    import triton
    import triton.language as tl

    from gpu_worker.kernels.activation import gated_value
except ImportError:  # CPU-only installs: kernels/gemv.py then never launches these
    triton = None

if triton is not None:

    @triton.jit
    def mma(a, b, acc, F32: tl.constexpr):
        """acc + a @ b; float32 operands (``F32``: the interpreter, and a float32 model on the
        GPU) multiply exactly, not in TF32."""
        if F32:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _dot_row(w, x_ptr, k, km):
        """W_tile . x[k] for one row (float32 [BLOCK_N])."""
        x = tl.load(x_ptr + k, mask=km, other=0.0).to(tl.float32)
        return tl.sum(w * x[None, :], axis=1)

    @triton.jit
    def _accumulate(w, x_ptr, sxm, k, km, M: tl.constexpr, a0, a1, a2, a3):
        """a_m += W_tile . x[m, k] for each of the M rows."""
        a0 += _dot_row(w, x_ptr, k, km)
        if M > 1:
            a1 += _dot_row(w, x_ptr + sxm, k, km)
        if M > 2:
            a2 += _dot_row(w, x_ptr + 2 * sxm, k, km)
        if M > 3:
            a3 += _dot_row(w, x_ptr + 3 * sxm, k, km)
        return a0, a1, a2, a3

    @triton.jit
    def _finish(a, b, ACT: tl.constexpr, DT: tl.constexpr):
        """The output value of one row: the sum, or act(gate) * up from the gate and up sums."""
        if ACT >= 0:
            return gated_value(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), ACT, DT).to(DT)
        return a.to(DT)

    @triton.jit
    def _store_row(y_ptr, ws_ptr, m, n, nm, a, b, N, SPLITS: tl.constexpr, ACT: tl.constexpr):
        """Row m's result, or (split-K) its fp32 partials: ws[split, m, 0:N] gate, [N:2N] up."""
        if SPLITS == 1:
            tl.store(y_ptr + n, _finish(a, b, ACT, y_ptr.dtype.element_ty), mask=nm)
        else:
            tl.store(ws_ptr + m * 2 * N + n, a, mask=nm)
            if ACT >= 0:
                tl.store(ws_ptr + m * 2 * N + N + n, b, mask=nm)

    @triton.jit
    def _reduce_row(y_ptr, ws_ptr, m, n, nm, N, M: tl.constexpr, SPLITS: tl.constexpr, ACT: tl.constexpr):
        """The last program of a tile: partials summed in split order (deterministic)."""
        a = tl.zeros(n.shape, tl.float32)
        b = tl.zeros(n.shape, tl.float32)
        for s in tl.static_range(SPLITS):
            base = ws_ptr + (s * M + m) * 2 * N
            a += tl.load(base + n, mask=nm, other=0.0, cache_modifier=".cg")
            if ACT >= 0:
                b += tl.load(base + N + n, mask=nm, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + n, _finish(a, b, ACT, y_ptr.dtype.element_ty), mask=nm)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, tk_ptr, N, K, K_CHUNK, sxm, swn, sym,
                     M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr,
                     SPLITS: tl.constexpr, PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
        pid = tl.program_id(0)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(K, k_lo + K_CHUNK)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        g_rows = w_ptr + n.to(tl.int64)[:, None] * swn
        u_rows = w_ptr + (n + N).to(tl.int64)[:, None] * swn  # gated: the up half of [gate; up]
        if PREFETCH_K > 0:  # weights only, before the wait (one prefetch per 32-byte sector)
            sec = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 16) * 16, K - 1)
            prefetch_l2(w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * swn + sec[None, :], PDL)
        gdc_enter(PDL)
        k0 = tl.arange(0, BLOCK_K)
        a0 = tl.zeros([BLOCK_N], tl.float32)
        a1, a2, a3 = a0, a0, a0
        b0, b1, b2, b3 = a0, a0, a0, a0
        for start in range(k_lo, k_hi, BLOCK_K):
            k = start + k0
            km = k < k_hi
            wm = nm[:, None] & km[None, :]
            w = tl.load(g_rows + k[None, :], mask=wm, other=0.0).to(tl.float32)
            a0, a1, a2, a3 = _accumulate(w, x_ptr, sxm, k, km, M, a0, a1, a2, a3)
            if ACT >= 0:
                w = tl.load(u_rows + k[None, :], mask=wm, other=0.0).to(tl.float32)
                b0, b1, b2, b3 = _accumulate(w, x_ptr, sxm, k, km, M, b0, b1, b2, b3)
        ws = ws_ptr + tl.program_id(1) * M * 2 * N
        _store_row(y_ptr, ws, 0, n, nm, a0, b0, N, SPLITS, ACT)
        if M > 1:
            _store_row(y_ptr + sym, ws, 1, n, nm, a1, b1, N, SPLITS, ACT)
        if M > 2:
            _store_row(y_ptr + 2 * sym, ws, 2, n, nm, a2, b2, N, SPLITS, ACT)
        if M > 3:
            _store_row(y_ptr + 3 * sym, ws, 3, n, nm, a3, b3, N, SPLITS, ACT)
        if SPLITS > 1:
            # every thread's partial stores precede the ticket (the barrier), which releases them
            # at GPU scope; the last taker acquires them and bypasses L1 to read them
            tl.debug_barrier()
            if tl.atomic_add(tk_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                for m in tl.static_range(M):
                    _reduce_row(y_ptr + m * sym, ws_ptr, m, n, nm, N, M, SPLITS, ACT)
                tl.atomic_xchg(tk_ptr + pid, 0, sem="relaxed", scope="gpu")  # back to 0 for the next launch

    @triton.jit
    def _dot_rows(pid, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
        """The weight rows of a tensor-core program's tile and their mask. Gated (``ACT`` >= 0):
        W = [gate; up] [2N, K] and the tile is BLOCK_N / 2 gate rows then the matching up rows,
        so the program holds both halves of its outputs (no weight re-layout: the rows are
        gathered, each still read along K)."""
        i = tl.arange(0, BLOCK_N)
        if ACT >= 0:
            HALF: tl.constexpr = BLOCK_N // 2
            j = pid * HALF + (i % HALF)
            return j + (i // HALF) * N, j < N
        n = pid * BLOCK_N + i
        return n, n < N

    @triton.jit
    def dot_tile_out(acc, y_ptr, ws_ptr, tk_ptr, w_idx, nm, r, rm, N, sym, M: tl.constexpr, MP: tl.constexpr,
                     BLOCK_N: tl.constexpr, ACT: tl.constexpr, SPLITS: tl.constexpr):
        """A tensor-core GEMV program's epilogue: its [BLOCK_N, MP] sums (rows ``w_idx`` of W,
        ``_dot_rows``) to y, gated (``ACT`` >= 0: ``act(gate) * up``) or not; with split-K, the
        fp32 partials, then the ticket and the last taker's reduction in split order."""
        pid = tl.program_id(0)
        ws = ws_ptr + tl.program_id(1) * M * 2 * N  # the FMA kernel's partials layout: [split, m, 2N]
        if ACT >= 0:
            HALF: tl.constexpr = BLOCK_N // 2
            g, u = tl.split(tl.permute(tl.reshape(acc, [2, HALF, MP]), [1, 2, 0]))
            n = pid * HALF + tl.arange(0, HALF)
            out_m = rm[None, :] & (n < N)[:, None]
            if SPLITS == 1:
                tl.store(y_ptr + r[None, :] * sym + n[:, None], _finish(g, u, ACT, y_ptr.dtype.element_ty), mask=out_m)
            else:
                tl.store(ws + r[None, :] * 2 * N + n[:, None], g, mask=out_m)
                tl.store(ws + r[None, :] * 2 * N + N + n[:, None], u, mask=out_m)
        else:
            n = w_idx
            out_m = rm[None, :] & nm[:, None]
            if SPLITS == 1:
                tl.store(y_ptr + r[None, :] * sym + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=out_m)
            else:
                tl.store(ws + r[None, :] * 2 * N + n[:, None], acc, mask=out_m)
        if SPLITS > 1:
            tl.debug_barrier()  # as in _gemv_kernel: partials before the ticket
            if tl.atomic_add(tk_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
                for m in tl.static_range(M):
                    _reduce_row(y_ptr + m * sym, ws_ptr, m, n, n < N, N, M, SPLITS, ACT)
                tl.atomic_xchg(tk_ptr + pid, 0, sem="relaxed", scope="gpu")

    @triton.jit(do_not_specialize=["rows"])
    def _gemv_dot_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, tk_ptr, N, K, K_CHUNK, sxm, swn, sym, rows,
                         M: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ACT: tl.constexpr, SPLITS: tl.constexpr, ROWS_RT: tl.constexpr, F32: tl.constexpr,
                         PDL: tl.constexpr, PREFETCH_K: tl.constexpr):
        """Tensor-core variant for 1..DOT_MAX_M rows: acc [BLOCK_N, MP] += W tile @ x tile^T (x
        padded to MP rows, read as zeros). The FMA kernel above reduces every tile once per row, which at
        four rows makes it 2-3x slower than cuBLAS (docs/decisions/gemv.md).
        Gated (``ACT`` >= 0): the epilogue splits the accumulator into its gate and up halves and
        writes ``act(gate) * up`` [M, N] (the activation kernel's work, in registers).
        ``ROWS_RT``: the row count is the runtime ``rows`` (decode batches past GEMV_MAX_M share
        one compiled variant per MP), else the constexpr M (1-4 rows, split-K)."""
        pid = tl.program_id(0)
        k_lo = tl.program_id(1) * K_CHUNK
        k_hi = tl.minimum(K, k_lo + K_CHUNK)
        w_idx, nm = _dot_rows(pid, N, BLOCK_N, ACT)
        r = tl.arange(0, MP)
        if ROWS_RT:
            rm = r < rows
        else:
            rm = r < M
        w_rows = w_ptr + w_idx.to(tl.int64)[:, None] * swn
        if PREFETCH_K > 0:  # as in _gemv_kernel: weights only, before the wait
            sec = tl.minimum(k_lo + tl.arange(0, PREFETCH_K // 16) * 16, K - 1)
            prefetch_l2(w_ptr + tl.where(nm, w_idx, 0).to(tl.int64)[:, None] * swn + sec[None, :], PDL)
        gdc_enter(PDL)
        acc = tl.zeros([BLOCK_N, MP], tl.float32)
        for start in range(k_lo, k_hi, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            km = k < k_hi
            w = tl.load(w_rows + k[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            xt = tl.load(x_ptr + r[None, :] * sxm + k[:, None], mask=rm[None, :] & km[:, None], other=0.0)
            if F32:  # the interpreter's tl.dot on bf16 returns garbage (Triton 3.6): exact fp32 there
                w, xt = w.to(tl.float32), xt.to(tl.float32)
            acc = mma(w, xt, acc, F32)
        dot_tile_out(acc, y_ptr, ws_ptr, tk_ptr, w_idx, nm, r, rm, N, sym, M, MP, BLOCK_N, ACT, SPLITS)
