// Decode attention for the compiled CPU steps, reading keys and values where they lie in the paged
// pool: out [B*t, Hq, Dv] for float32 q [B*t, Hq, D], pool k [P, Hkv, D] and v [P, Hkv, Dv], the
// pool locations `loc` [B, K'] of the keys each row may read and the mask `ok` [B, t, K'] of the
// keys each query sees (graphs/cpu_attention.py builds both, once a step per window).
//
// Why: the same attention as tensor ops (cpu_attention.py's reference) copies every row's keys and
// values out of the pool each layer and multiplies them through 2 x B x Hkv small batched GEMMs;
// at 8 requests that was one of the costs that outgrew the step's GEMMs on a CPU with AMX.
//
// Here a block is one row: its keys are copied V at a time from the pool and transposed, so that
// each query's scores come V at once from multiply-adds with no horizontal sums; then a masked
// softmax in float32; then the values, read in place, weighed a few queries at a time in
// registers. Blocks go to the helper thread as the GEMMs' columns do (cpu_split.cpp): each block
// runs whole on one thread, so the result does not depend on the split.

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <algorithm>
#include <limits>
#include <vector>

namespace tandem_split {  // cpu_split.cpp
using Block = void (*)(const void* job, int64_t block);
void run(const void* job, Block fn, int64_t blocks);
}  // namespace tandem_split

namespace {

using Vec = at::vec::Vectorized<float>;

struct AttnJob {
  const float *q, *k, *v;
  const int64_t* loc;
  const bool* ok;
  float* out;
  int64_t t, hq, hkv, d, dv, keys;
  float scaling;
};

constexpr int QB = 8;  // queries scored together: one accumulator each, all in registers
constexpr int64_t V = Vec::size();  // keys a tile: one lane each

// tile [n, D] (keys in rows) -> kt [D, V]. Whole V x V blocks take the ISA's own transpose (AVX2
// has it for 8 x 8 only at compile time).
void transpose_keys(const float* tile, int64_t D, float* kt, int64_t n) {
  constexpr int W = static_cast<int>(V);
  if (n == V && D % V == 0) {
    for (int64_t d0 = 0; d0 < D; d0 += V) at::vec::transpose_mxn<float, W, W>(tile + d0, D, kt + d0 * V, V);
  } else {
    at::vec::transpose_mxn<float>(tile, D, kt, V, static_cast<int>(n), static_cast<int>(D));
  }
}

// Scores of QB queries (q[i], D floats each) against a tile of V keys transposed (kt [D, V]):
// out[i * ld + lane], before scaling. Keys in lanes: no horizontal sums.
void score_tile(const float* const* q, const float* kt, int64_t D, float* out, int64_t ld) {
  Vec acc[QB];
  for (int i = 0; i < QB; ++i) acc[i] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec kv = Vec::loadu(kt + d * V);
#pragma GCC unroll 8
    for (int i = 0; i < QB; ++i) acc[i] = at::vec::fmadd(Vec(q[i][d]), kv, acc[i]);
  }
  for (int i = 0; i < QB; ++i) acc[i].store(out + i * ld);
}

constexpr int QP = 4;  // queries weighing values together
constexpr int64_t VC = 4;  // value vectors a pass

// out[ids[i]] (row stride ldo) = sum over c < K of p[ids[i] * ld + c] x the n columns at
// v + loc[c] * ldv, for the ids >= 0.
void weigh_values(const float* p, int64_t ld, const int64_t* ids, const float* v, int64_t ldv, const int64_t* loc,
                  int64_t K, int64_t n, float* out, int64_t ldo) {
  Vec acc[QP][VC];
  for (int i = 0; i < QP; ++i) {
    for (int u = 0; u < VC; ++u) acc[i][u] = Vec(0.f);
  }
  const int64_t vecs = (n + V - 1) / V;
  for (int64_t c = 0; c < K; ++c) {
    const float* vr = v + loc[c] * ldv;
    Vec x[VC];
    for (int u = 0; u < VC; ++u) {
      x[u] = u < vecs ? Vec::loadu(vr + u * V, std::min(V, n - u * V)) : Vec(0.f);
    }
#pragma GCC unroll 4
    for (int i = 0; i < QP; ++i) {
      const Vec pr(ids[i] >= 0 ? p[ids[i] * ld + c] : 0.f);
      for (int u = 0; u < VC; ++u) acc[i][u] = at::vec::fmadd(x[u], pr, acc[i][u]);
    }
  }
  for (int i = 0; i < QP && ids[i] >= 0; ++i) {
    for (int u = 0; u < vecs; ++u) acc[i][u].store(out + ids[i] * ldo + u * V, std::min(V, n - u * V));
  }
}

// Row b's queries, all heads. Query qi = (token r, head hh) = r * Hq + hh, row b * t + r of q,
// kv head hh / g; its scores, then probabilities, are P[qi * ld, qi * ld + K).
void attend(const void* p, int64_t b) {
  const AttnJob& j = *static_cast<const AttnJob*>(p);
  const int64_t g = j.hq / j.hkv, nq = j.t * j.hq, K = j.keys, D = j.d;
  const int64_t ld = (K + V - 1) / V * V;  // whole tiles of scores a query
  thread_local std::vector<float> probs, tile, kt, zeros, tmp;
  probs.resize(nq * ld);
  float* const P = probs.data();  // the thread-local's address once, not a TLS lookup an access
  tile.assign(V * D, 0.f);
  kt.resize(D * V);
  zeros.assign(D, 0.f);
  tmp.resize(QB * V);
  const int64_t* loc = j.loc + b * K;
  const float* q = j.q + b * nq * D;  // [t, Hq, D]
  for (int64_t h = 0; h < j.hkv; ++h) {
    for (int64_t c0 = 0; c0 < K; c0 += V) {
      const int64_t n = std::min(V, K - c0);
      for (int64_t i = 0; i < n; ++i) std::copy_n(j.k + (loc[c0 + i] * j.hkv + h) * D, D, tile.data() + i * D);
      transpose_keys(tile.data(), D, kt.data(), n);
      for (int64_t first = 0; first < j.t * g; first += QB) {  // this kv head's queries, QB at a time
        const float* qs[QB];
        int64_t ids[QB];
        for (int i = 0; i < QB; ++i) {
          const int64_t m = first + i;  // (token m / g, head h * g + m % g)
          ids[i] = m < j.t * g ? m / g * j.hq + h * g + m % g : -1;
          qs[i] = ids[i] >= 0 ? q + ids[i] * D : zeros.data();
        }
        score_tile(qs, kt.data(), D, tmp.data(), V);
        for (int i = 0; i < QB && ids[i] >= 0; ++i) {
          const bool* ok = j.ok + (b * j.t + ids[i] / j.hq) * K + c0;
          float* s = P + ids[i] * ld + c0;
          for (int64_t c = 0; c < n; ++c) {
            s[c] = ok[c] ? tmp[i * V + c] * j.scaling : -std::numeric_limits<float>::infinity();
          }
        }
      }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {  // softmax; no row is empty (cpu_attention.py): max is finite
    float* s = P + qi * ld;
    const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, K);
    at::vec::map([mx](Vec x) { return (x - Vec(mx)).exp(); }, s, s, K);
    const float inv = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, K);
    at::vec::map([inv](Vec x) { return x * Vec(inv); }, s, s, K);
  }
  // out[qi] = sum over c of p[qi, c] v[c], QP queries and VC vectors of columns in registers,
  // each value row read once per QP queries.
  float* out = j.out + b * nq * j.dv;
  for (int64_t h = 0; h < j.hkv; ++h) {
    for (int64_t first = 0; first < j.t * g; first += QP) {
      int64_t ids[QP];
      for (int i = 0; i < QP; ++i) {
        const int64_t m = first + i;
        ids[i] = m < j.t * g ? m / g * j.hq + h * g + m % g : -1;
      }
      for (int64_t d0 = 0; d0 < j.dv; d0 += VC * V) {
        weigh_values(P, ld, ids, j.v + h * j.dv + d0, j.hkv * j.dv, loc, K, std::min(VC * V, j.dv - d0), out + d0,
                     j.dv);
      }
    }
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& loc,
                           const at::Tensor& ok, double scaling) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "paged_attention: float32 q and pool");
  TORCH_CHECK(loc.scalar_type() == at::kLong && ok.scalar_type() == at::kBool, "paged_attention: int64 loc, bool ok");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor lc = loc.contiguous(), oc = ok.contiguous();
  const int64_t B = lc.size(0), keys = lc.size(1), t = oc.size(1), hq = qc.size(1), d = qc.size(2);
  const int64_t hkv = kc.size(1), dv = vc.size(2);
  TORCH_CHECK(qc.size(0) == B * t && oc.size(0) == B && oc.size(2) == keys && hq % hkv == 0 && kc.size(2) == d,
              "paged_attention: shapes do not agree");
  at::Tensor out = at::empty({B * t, hq, dv}, qc.options());
  const AttnJob job{qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), lc.data_ptr<int64_t>(),
                    oc.data_ptr<bool>(), out.data_ptr<float>(), t, hq, hkv, d, dv, keys,
                    static_cast<float>(scaling)};
  tandem_split::run(&job, attend, B);
  return out;
}

}  // namespace

// The C shim AOTInductor's generated code calls for tandem_cpu::paged_attention (cpu_ops.SHIMS).
extern "C" AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                                         AtenTensorHandle loc, AtenTensorHandle ok, double scaling,
                                                         AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using torch::aot_inductor::tensor_handle_to_tensor_pointer;
    at::Tensor out = paged_attention(*tensor_handle_to_tensor_pointer(q), *tensor_handle_to_tensor_pointer(k),
                                     *tensor_handle_to_tensor_pointer(v), *tensor_handle_to_tensor_pointer(loc),
                                     *tensor_handle_to_tensor_pointer(ok), scaling);
    *ret0 = torch::aot_inductor::new_tensor_handle(std::move(out));
  });
}
