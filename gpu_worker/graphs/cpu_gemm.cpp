// Few-row GEMM for the compiled CPU steps: out [M, N] = x [M, K] @ W^T, W [N, K] stored
// column-major (W^T [K, N] contiguous rows, models/cpu_layout.py), M up to 8 (float32) or 4 (bfloat16) rows, float32 or
// bfloat16 (x, W and out of one dtype; products and sums in float32, as MKL's float32 kernels and
// oneDNN's bfloat16 ones do). bfloat16 weights stored row-major (the layout where the CPU has AMX)
// go to the AMX kernel (cpu_amx.cpp) at any row count, under a float32 or a bfloat16 x.
//
// Why: at 2 to 8 rows MKL's kernel walks a block of output columns down all K rows of W^T (K
// streams at a stride of N elements), which the hardware prefetchers do not follow: with the
// weights out of the private cache (the draft ran in between, docs/decisions/cpu.md) the verify's
// GEMMs took twice the one-row step's. Here each pass reads KC consecutive rows of W^T from start
// to end (KC sequential streams) and adds their products into float32 sums that stay in L1/L2:
// the weights stream at the one-row GEMV's rate. Each output element is a sum over k in order.
//
// The compiled programs call it through its AOTInductor C shim (aoti_torch_cpu_rows_linear:
// graphs/cpu_ops.py); other shapes, dtypes and layouts fall back to at::mm.

// The tensor type and the two operators used, not <ATen/ATen.h>: declaring every operator is
// most of this file's compile time, paid on a machine's first start.
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// cpu_amx.cpp: whether this process may run AMX tiles; out = x @ w^T for row-major bf16 w.
bool amx_ready();
void amx_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& out);

namespace tandem_split {  // cpu_split.cpp
using Block = void (*)(const void* job, int64_t block);
void run(const void* job, Block fn, int64_t blocks);
bool shared();
}  // namespace tandem_split

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t COLS = 2 * V;  // output columns a block: one cache line of bfloat16 weights
constexpr int64_t KC = 16;  // rows of W^T a pass: 8 to 16 measured alike, 64 slower
// Past these rows MKL's float32 kernels and oneDNN's bfloat16 ones are as fast or faster.
constexpr int64_t ROWS_MAX_F32 = 8;
constexpr int64_t ROWS_MAX_BF16 = 4;
// Our kernels' column blocks on two threads: a few wide ones, each reading long runs of W^T's rows.
constexpr int64_t ROWS_COLS_MIN = 128;
constexpr int64_t ROWS_BLOCKS_MAX = 4;

// Weights [p, p + cnt) as two float32 vectors (zeros past cnt).
inline std::tuple<Vec, Vec> load_cols(const float* p, int64_t cnt) {
  if (cnt >= COLS) return {Vec::loadu(p), Vec::loadu(p + V)};
  return {cnt >= V ? Vec::loadu(p) : Vec::loadu(p, cnt), cnt > V ? Vec::loadu(p + V, cnt - V) : Vec(0.f)};
}

inline std::tuple<Vec, Vec> load_cols(const BFloat16* p, int64_t cnt) {
  using VecB = at::vec::Vectorized<BFloat16>;
  return at::vec::convert_to_float<BFloat16>(cnt >= COLS ? VecB::loadu(p) : VecB::loadu(p, cnt));
}

inline void store_cols(float* p, int64_t cnt, const Vec& lo, const Vec& hi) {
  if (cnt >= COLS) {
    lo.store(p);
    hi.store(p + V);
  } else {
    lo.store(p, std::min(cnt, V));
    if (cnt > V) hi.store(p + V, cnt - V);
  }
}

inline void store_cols(BFloat16* p, int64_t cnt, const Vec& lo, const Vec& hi) {
  const auto v = at::vec::convert_from_float<BFloat16>(lo, hi);
  if (cnt >= COLS) {
    v.store(p);
  } else {
    v.store(p, cnt);
  }
}

// The block's 2 * M sums, unrolled so that they stay in vector registers: an array of them that
// the compiler keeps in memory turns every multiply-add into a load and a store.
template <int M>
struct Sums {
  Vec lo[M], hi[M];
};

// s += x[:, j] * W^T[j, n : n + cnt] for the kc rows of W^T from wk; WHOLE: cnt == COLS, so
// the loads need no mask.
template <int M, bool WHOLE, typename T>
__attribute__((always_inline)) inline void multiply_add(Sums<M>& s, const T* xk, int64_t ldx, const T* wk,
                                                        int64_t ldw, int64_t kc, int64_t cnt) {
  for (int64_t j = 0; j < kc; ++j, wk += ldw) {
    const auto [wlo, whi] = load_cols(wk, WHOLE ? COLS : cnt);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const Vec xv(static_cast<float>(xk[m * ldx + j]));
      s.lo[m] = at::vec::fmadd(wlo, xv, s.lo[m]);
      s.hi[m] = at::vec::fmadd(whi, xv, s.hi[m]);
    }
  }
}

// Rows [0, M) of the float32 sums `acc` (ldc N) for columns [n, n + cnt) += x @ W^T rows
// [k0, k0 + kc); the last pass writes the result into `out` (which may be `acc` itself).
template <int M, typename T>
inline void block(const T* x, int64_t ldx, const T* wt, int64_t ldw, float* acc, T* out, int64_t N,
                  int64_t k0, int64_t kc, bool last, int64_t n, int64_t cnt) {
  Sums<M> s;
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    if (k0 == 0) {
      s.lo[m] = s.hi[m] = Vec(0.f);
    } else {
      std::tie(s.lo[m], s.hi[m]) = load_cols(acc + m * N + n, cnt);
    }
  }
  if (cnt == COLS) {  // the common case
    multiply_add<M, true>(s, x + k0, ldx, wt + k0 * ldw + n, ldw, kc, cnt);
  } else {
    multiply_add<M, false>(s, x + k0, ldx, wt + k0 * ldw + n, ldw, kc, cnt);
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    if (last) {
      store_cols(out + m * N + n, cnt, s.lo[m], s.hi[m]);
    } else {
      store_cols(acc + m * N + n, cnt, s.lo[m], s.hi[m]);
    }
  }
}

// Vector registers: 32 with AVX-512 (16 floats a vector), 16 with AVX2. A block keeps 2 * M
// sums, two weight vectors and x's broadcast in them.
constexpr int VREGS = V >= 16 ? 32 : 16;

// Columns [n0, n1) of out [M, N] (N also the row stride of `acc` and `out`).
template <int M, typename T>
void rows_kernel(const T* x, int64_t ldx, const T* wt, int64_t ldw, float* acc, T* out, int64_t K, int64_t N,
                 int64_t n0, int64_t n1) {
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool last = k0 + kc == K;
    for (int64_t n = n0; n < n1; n += COLS) {
      const int64_t cnt = std::min(COLS, n1 - n);
      if constexpr (2 * M + 3 <= VREGS) {
        block<M>(x, ldx, wt, ldw, acc, out, N, k0, kc, last, n, cnt);
      } else {  // the rows in two halves, each in registers; the second reads the weights from L1
        constexpr int H = M / 2;
        block<H>(x, ldx, wt, ldw, acc, out, N, k0, kc, last, n, cnt);
        block<M - H>(x + H * ldx, ldx, wt, ldw, acc + H * N, out + H * N, N, k0, kc, last, n, cnt);
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__x86_64__)
#define HAVE_DPBF16 1
// bfloat16 with AVX512-BF16: a dot-product instruction multiplies two k at once (pairs of rows
// k, k + 1 of W^T interleaved), half the instructions of converting to float32 and multiplying:
// at 8 rows the GEMMs are bound by instructions, not by the weights' bytes. Each 128-bit lane of
// the interleaved pairs holds 4 columns of the low or the high half: the sums keep that order in
// the scratch (a whole block of COLS) and are put back in column order at the last store.
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

BF16_TARGET inline __m512i load_pair_row(const BFloat16* p, int64_t cnt) {
  const __mmask32 mask = cnt >= 32 ? ~__mmask32(0) : ((__mmask32(1) << cnt) - 1);
  return _mm512_maskz_loadu_epi16(mask, p);
}

// xp: x as (k, k + 1) pairs, [M, ldxp] 32-bit words (the broadcast operand of the dot products).
template <int M>
BF16_TARGET void dp_block(const int32_t* xp, int64_t ldxp, const BFloat16* wt, int64_t ldw, float* acc,
                                 BFloat16* out, int64_t N, int64_t ldacc, int64_t k0, int64_t kc, bool last,
                                 int64_t n, int64_t cnt) {
  __m512 lo[M], hi[M];
  for (int m = 0; m < M; ++m) {
    lo[m] = k0 ? _mm512_loadu_ps(acc + m * ldacc + n) : _mm512_setzero_ps();
    hi[m] = k0 ? _mm512_loadu_ps(acc + m * ldacc + n + 16) : _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < kc; j += 2) {
    const bool pair = j + 1 < kc;
    const __m512i a = load_pair_row(wt + (k0 + j) * ldw + n, cnt);
    const __m512i b = pair ? load_pair_row(wt + (k0 + j + 1) * ldw + n, cnt) : _mm512_setzero_si512();
    const __m512bh p0 = (__m512bh)_mm512_unpacklo_epi16(a, b), p1 = (__m512bh)_mm512_unpackhi_epi16(a, b);
    for (int m = 0; m < M; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[m * ldxp + (k0 + j) / 2]);
      lo[m] = _mm512_dpbf16_ps(lo[m], p0, xb);
      hi[m] = _mm512_dpbf16_ps(hi[m], p1, xb);
    }
  }
  if (!last) {
    for (int m = 0; m < M; ++m) {
      _mm512_storeu_ps(acc + m * ldacc + n, lo[m]);
      _mm512_storeu_ps(acc + m * ldacc + n + 16, hi[m]);
    }
    return;
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __mmask32 mask = cnt >= 32 ? ~__mmask32(0) : ((__mmask32(1) << cnt) - 1);
  for (int m = 0; m < M; ++m) {
    const __m512 c0 = _mm512_permutex2var_ps(lo[m], first, hi[m]);
    const __m512 c1 = _mm512_permutex2var_ps(lo[m], second, hi[m]);
    _mm512_mask_storeu_epi16(out + m * N + n, mask, (__m512i)_mm512_cvtne2ps_pbh(c1, c0));
  }
}

// x as (k, k + 1) pairs of bfloat16, [M, (K + 1) / 2] 32-bit words.
std::vector<int32_t> pairs_of(const BFloat16* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t ldxp = (K + 1) / 2;
  std::vector<int32_t> pairs(M * ldxp);
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(x);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 2) {
      const uint32_t lo = xs[m * ldx + k], hi = k + 1 < K ? xs[m * ldx + k + 1] : 0;
      pairs[m * ldxp + k / 2] = int32_t(lo | (hi << 16));
    }
  }
  return pairs;
}

// Columns [n0, n1) (n0 a multiple of 32: the sums' lane order is per block of 32).
template <int M>
BF16_TARGET void dp_kernel(const int32_t* xp, const BFloat16* wt, int64_t ldw, float* acc, BFloat16* out,
                           int64_t K, int64_t N, int64_t ldacc, int64_t n0, int64_t n1) {
  const int64_t ldxp = (K + 1) / 2;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int64_t n = n0; n < n1; n += 32) {
      dp_block<M>(xp, ldxp, wt, ldw, acc, out, N, ldacc, k0, kc, k0 + kc == K, n, std::min<int64_t>(32, n1 - n));
    }
  }
}

bool has_dpbf16() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}
#endif

// One GEMM for rows_block: the operands, and the columns a block takes.
template <typename T>
struct RowsJob {
  const T* x;
  int64_t ldx;
  const T* wt;
  int64_t ldw;
  float* acc;
  T* out;
  int64_t M, K, N, cols;
  const int32_t* pairs;  // x as bfloat16 pairs where the dot-product kernel runs, else null
  int64_t ldacc;
};

template <typename T>
void rows_block(const void* p, int64_t b) {
  const RowsJob<T>& j = *static_cast<const RowsJob<T>*>(p);
  const int64_t n0 = b * j.cols, n1 = std::min(j.N, n0 + j.cols);
#define ROWS_CASES(CALL) \
  switch (j.M) {          \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break; \
  }
#ifdef HAVE_DPBF16
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (j.pairs) {
#define DP(R) dp_kernel<R>(j.pairs, j.wt, j.ldw, j.acc, j.out, j.K, j.N, j.ldacc, n0, n1)
      ROWS_CASES(DP)
#undef DP
      return;
    }
  }
#endif
#define FMA(R) rows_kernel<R>(j.x, j.ldx, j.wt, j.ldw, j.acc, j.out, j.K, j.N, n0, n1)
  ROWS_CASES(FMA)
#undef FMA
#undef ROWS_CASES
}

template <typename T>
void rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  RowsJob<T> job{x.data_ptr<T>(), x.stride(0), w.data_ptr<T>(), w.stride(1), nullptr, out.data_ptr<T>(),
                 M, K, N, N, nullptr, N};
  at::Tensor acc;
  std::vector<int32_t> pairs;
#ifdef HAVE_DPBF16
  if constexpr (std::is_same_v<T, BFloat16>) {
    if (has_dpbf16()) {
      job.ldacc = (N + 31) / 32 * 32;  // whole blocks: the sums are kept in lane order
      acc = at::empty({M, job.ldacc}, out.options().dtype(at::kFloat));
      pairs = pairs_of(job.x, job.ldx, M, K);
      job.pairs = pairs.data();
    }
  }
#endif
  if (!acc.defined()) acc = out.scalar_type() == at::kFloat ? out : at::empty({M, N}, out.options().dtype(at::kFloat));
  job.acc = acc.data_ptr<float>();
  if (tandem_split::shared()) {
    const int64_t blocks = std::clamp<int64_t>(N / ROWS_COLS_MIN, 1, ROWS_BLOCKS_MAX);
    job.cols = ((N + blocks - 1) / blocks + 31) / 32 * 32;  // whole blocks of either kernel
  }
  tandem_split::run(&job, rows_block<T>, (N + job.cols - 1) / job.cols);
}

bool fits(const at::Tensor& x, const at::Tensor& w) {
  const auto dtype = x.scalar_type();
  const int64_t rows_max = dtype == at::kFloat ? ROWS_MAX_F32 : ROWS_MAX_BF16;
  return x.dim() == 2 && w.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16) &&
         w.scalar_type() == dtype && x.size(0) >= 1 && x.size(0) <= rows_max && x.size(1) >= 1 &&
         x.size(1) == w.size(1) && x.stride(1) == 1 && w.stride(0) == 1;
}

// bfloat16 weights in rows ([N, K], unit stride along K) under a float32 or bfloat16 x.
bool row_major_bf16(const at::Tensor& x, const at::Tensor& w) {
  const auto dtype = x.scalar_type();
  return x.dim() == 2 && w.dim() == 2 && w.scalar_type() == at::kBFloat16 &&
         (dtype == at::kFloat || dtype == at::kBFloat16) && x.size(0) >= 1 && x.size(1) >= 1 &&
         x.size(1) == w.size(1) && x.stride(1) == 1 && w.stride(1) == 1 && w.size(0) >= 1 &&
         (w.size(0) == 1 || w.stride(0) >= w.size(1));
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w) {
  if (row_major_bf16(x, w)) {
    if (!amx_ready()) return at::mm(x, w.t().to(x.scalar_type()));
    at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
    amx_linear(x, w, out);
    return out;
  }
  if (!fits(x, w)) return at::mm(x, w.scalar_type() == x.scalar_type() ? w.t() : w.t().to(x.scalar_type()));
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    rows<float>(x, w, out);
  } else {
    rows<BFloat16>(x, w, out);
  }
  return out;
}

}  // namespace

// The C shim AOTInductor's generated code calls for tandem_cpu::rows_linear (cpu_ops.SHIM).
extern "C" AOTITorchError aoti_torch_cpu_rows_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    at::Tensor out = rows_linear(*torch::aot_inductor::tensor_handle_to_tensor_pointer(x),
                                 *torch::aot_inductor::tensor_handle_to_tensor_pointer(w));
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}
