// Few-row float32 GEMM for the compiled CPU steps: out [M, N] = x [M, K] @ W^T, W [N, K] stored
// column-major (W^T [K, N] contiguous rows, models/cpu_layout.py), for M up to ROWS_MAX.
//
// Why: at 2 to 8 rows MKL's kernel walks a block of output columns down all K rows of W^T (K
// streams at a stride of N floats), which the hardware prefetchers do not follow: with the
// weights out of the private cache (the draft ran in between, docs/decisions/cpu.md) the verify's
// GEMMs took twice the one-row step's. Here each pass reads KC consecutive rows of W^T from start
// to end (KC sequential streams) and adds their products into the output, which stays in L1/L2:
// the weights stream at the one-row GEMV's rate. Each output element is a sum over k in order,
// in float32 (fused multiply-adds), as a dot product is.
//
// The compiled programs call it through its AOTInductor C shim (aoti_torch_cpu_rows_linear:
// graphs/cpu_ops.py); other shapes, dtypes and layouts fall back to at::mm.

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t KC = 8;  // rows of W^T per pass: 4 to 16 measured within a few per cent
constexpr int64_t ROWS_MAX = 8;  // past 8 rows MKL's blocked kernels are as fast or faster

// One pass over rows [k0, k0 + kc) of W^T for output columns [n, n + cnt).
template <int M, bool FULL>
inline void columns(const float* x, int64_t ldx, const float* wt, int64_t ldw, float* c, int64_t N,
                    int64_t k0, int64_t kc, int64_t n, int64_t cnt) {
  Vec acc[M];
  for (int m = 0; m < M; ++m) {
    if (k0 == 0) {
      acc[m] = Vec(0.f);
    } else {
      acc[m] = FULL ? Vec::loadu(c + m * N + n) : Vec::loadu(c + m * N + n, cnt);
    }
  }
  for (int64_t j = 0; j < kc; ++j) {
    const float* row = wt + (k0 + j) * ldw + n;
    const Vec w = FULL ? Vec::loadu(row) : Vec::loadu(row, cnt);
    for (int m = 0; m < M; ++m) acc[m] = at::vec::fmadd(w, Vec(x[m * ldx + k0 + j]), acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    if (FULL) {
      acc[m].store(c + m * N + n);
    } else {
      acc[m].store(c + m * N + n, cnt);
    }
  }
}

template <int M>
void rows_kernel(const float* x, int64_t ldx, const float* wt, int64_t ldw, float* c, int64_t K, int64_t N) {
  constexpr int64_t V = Vec::size();
  const int64_t full = N - N % V;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int64_t n = 0; n < full; n += V) columns<M, true>(x, ldx, wt, ldw, c, N, k0, kc, n, V);
    if (full < N) columns<M, false>(x, ldx, wt, ldw, c, N, k0, kc, full, N - full);
  }
}

bool fits(const at::Tensor& x, const at::Tensor& w) {
  return x.dim() == 2 && w.dim() == 2 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
         x.size(0) >= 1 && x.size(0) <= ROWS_MAX && x.size(1) >= 1 && x.size(1) == w.size(1) &&
         x.stride(1) == 1 && w.stride(0) == 1;
}

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w) {
  if (!fits(x, w)) return at::mm(x, w.t());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldw = w.stride(1);
  switch (M) {
#define TANDEM_ROWS(R) \
  case R:              \
    rows_kernel<R>(xp, ldx, wp, ldw, op, K, N); \
    break;
    TANDEM_ROWS(1) TANDEM_ROWS(2) TANDEM_ROWS(3) TANDEM_ROWS(4)
    TANDEM_ROWS(5) TANDEM_ROWS(6) TANDEM_ROWS(7) TANDEM_ROWS(8)
#undef TANDEM_ROWS
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
