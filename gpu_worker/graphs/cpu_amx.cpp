// AMX GEMM for the compiled CPU steps: out [M, N] = x [M, K] @ W^T with W [N, K] bfloat16,
// row-major (F.linear's layout), x float32 or bfloat16 (out in x's dtype).
//
// Why: a float32 target whose checkpoint is bfloat16 holds weights that are exactly bfloat16
// values (models/cpu_layout.py keeps them so). Stored as bfloat16 they stream half the bytes, and
// AMX's tile dot products (TDPBF16PS: bfloat16 products, float32 sums) carry the verify's 32 rows
// at a fraction of the float32 FMA rate's time. A float32 activation is split into three bfloat16
// terms, hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid), whose sum is x (24 mantissa
// bits); each bfloat16 product is exact in float32, so out differs from a float32 GEMM only in
// the rounding of its sums. A bfloat16 activation (the draft) is one term.
//
// Roles: the weights are the tiles' left operand A (16 rows of W: 16 output columns, 32 k, read
// straight from W's rows, no repacking); the activation terms, packed pairwise (VNNI), are the
// right operand B (16 k pairs x 16 rows of x); C [16 columns, 16 rows] is stored transposed.
// Each pass takes 32 output columns down all of K (two A tiles; each B tile serves both).

#include <ATen/core/Tensor.h>  // the tensor type only: <ATen/ATen.h> declares every operator (slow to compile)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

namespace tandem_split {  // cpu_split.cpp
using Block = void (*)(const void* job, int64_t block);
void run(const void* job, Block fn, int64_t blocks);
}  // namespace tandem_split

namespace tandem_amx {

#ifdef HAVE_AMX
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t TN = 16;  // output columns an A tile (rows of W)
constexpr int64_t TK = 32;  // k a tile step
constexpr int64_t TM = 16;  // rows of x a B tile
constexpr int64_t ROWS_MAX = 2 * TM;  // rows of x a pass: C tiles 2 columns x 2 row blocks
constexpr int64_t TILE_WORDS = TM * TK / 2;  // 32-bit words (bfloat16 pairs) a B tile

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 = A (W rows [n, n + 16), [n + 16, n + 32)); 2, 7 = B; 3 + 2a + r = C for A tile a and
// row block r. Every tile is 16 rows of 64 bytes.
AMX_TARGET void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // (the whole struct as the operand: GCC's _tile_loadconfig names only its first 8 bytes, so the
  // compiler may drop the stores to the rest)
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

// A 16 x 16 block of 32-bit words transposed in place (r[i] becomes column i).
AMX_TARGET inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i + c]: rows 4i..4i+3 at column 4L + c
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i) {
    for (int c = 0; c < 4; ++c) {
      t[8 * i + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0x88);
      t[8 * i + 4 + c] = _mm512_shuffle_i32x4(r[8 * i + c], r[8 * i + 4 + c], 0xdd);
    }
  }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xdd);
  }
}

// The float32 value of each bfloat16 in h's low (half 0) or high (half 1) 256 bits.
AMX_TARGET inline __m512 widen(__m512i h, int half) {
  const __m256i b = half ? _mm512_extracti64x4_epi64(h, 1) : _mm512_castsi512_si256(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// x's rows [0, mc) as VNNI B tiles, [term][k step][row block]: word (p, j) of a tile is the
// bfloat16 pair (k0 + 2p, k0 + 2p + 1) of row j of the block; zeros past K and past mc. Each
// term is the remainder of x less the terms before it, rounded to bfloat16 (the remainders are
// exact in float32).
AMX_TARGET void pack_f32(const float* x, int64_t ldx, int64_t mc, int64_t K, int64_t rb, uint32_t* out) {
  const int64_t steps = (K + TK - 1) / TK;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t cnt = std::min(TK, K - s * TK);
    const __mmask16 m0 = _cvtu32_mask16(cnt >= 16 ? 0xffffu : (1u << cnt) - 1);
    const __mmask16 m1 = _cvtu32_mask16(cnt >= 32 ? 0xffffu : cnt > 16 ? (1u << (cnt - 16)) - 1 : 0u);
    for (int64_t r = 0; r < rb; ++r) {
      __m512i w[3][16];
      for (int64_t j = 0; j < TM; ++j) {
        const int64_t m = r * TM + j;
        __m512 a = m < mc ? _mm512_maskz_loadu_ps(m0, x + m * ldx + s * TK) : _mm512_setzero_ps();
        __m512 b = m < mc ? _mm512_maskz_loadu_ps(m1, x + m * ldx + s * TK + 16) : _mm512_setzero_ps();
        for (int t = 0; t < 3; ++t) {
          w[t][j] = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // word p: the pair (2p, 2p + 1)
          a = _mm512_sub_ps(a, widen(w[t][j], 0));
          b = _mm512_sub_ps(b, widen(w[t][j], 1));
        }
      }
      for (int t = 0; t < 3; ++t) {
        transpose16(w[t]);
        uint32_t* tile = out + ((t * steps + s) * rb + r) * TILE_WORDS;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * TM, w[t][p]);
      }
    }
  }
}

AMX_TARGET void pack_bf16(const at::BFloat16* x, int64_t ldx, int64_t mc, int64_t K, int64_t rb, uint32_t* out) {
  const int64_t steps = (K + TK - 1) / TK;
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t cnt = std::min(TK, K - s * TK);
    const __mmask32 mask = _cvtu32_mask32(cnt >= 32 ? ~0u : (1u << cnt) - 1);
    for (int64_t r = 0; r < rb; ++r) {
      __m512i w[16];
      for (int64_t j = 0; j < TM; ++j) {
        const int64_t m = r * TM + j;
        w[j] = m < mc ? _mm512_maskz_loadu_epi16(mask, x + m * ldx + s * TK) : _mm512_setzero_si512();
      }
      transpose16(w);
      uint32_t* tile = out + (s * rb + r) * TILE_WORDS;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * TM, w[p]);
    }
  }
}

// A tile source for W rows [n, n + 16) at k step s: W itself where the tile lies inside it, else
// a zero-padded copy in `edge` (no read past W's rows or end).
inline const uint16_t* a_source(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, int64_t n, int64_t s,
                                uint16_t* edge, int64_t& stride) {
  const int64_t k0 = s * TK;
  if (n + TN <= N && k0 + TK <= K) {
    stride = ldw * 2;
    return w + n * ldw + k0;
  }
  std::memset(edge, 0, TN * TK * 2);
  for (int64_t i = 0; i < TN && n + i < N; ++i) {
    std::memcpy(edge + i * TK, w + (n + i) * ldw + k0, 2 * std::min(TK, K - k0));
  }
  stride = TK * 2;
  return edge;
}

// C [16 columns x 16 rows] (row-major scratch) into out rows [0, mc), columns [n, n + nc): a
// transpose, or a gather a row where there are few (the transpose's cost does not shrink with mc).
constexpr int64_t GATHER_ROWS = 4;
template <typename T>
AMX_TARGET void store_c(const float* c, T* out, int64_t ldo, int64_t mc, int64_t n, int64_t nc) {
  __m512i r[16];
  if (mc > GATHER_ROWS) {
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + i * TM);
    transpose16(r);  // r[m]: row m's 16 columns
  } else {
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(TM));
    for (int64_t m = 0; m < mc; ++m) r[m] = _mm512_castps_si512(_mm512_i32gather_ps(idx, c + m, 4));
  }
  const __mmask16 mask = _cvtu32_mask16(nc >= 16 ? 0xffffu : (1u << nc) - 1);
  for (int64_t m = 0; m < mc; ++m) {
    const __m512 v = _mm512_castsi512_ps(r[m]);
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(out + m * ldo + n, mask, v);
    } else {
      _mm256_mask_storeu_epi16(out + m * ldo + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// One pass: output columns [n, n + 32) for x rows in RB row blocks, `terms` B tiles each.
template <int RB, typename T>
AMX_TARGET void pass(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, const uint32_t* xb, int terms,
                     T* out, int64_t ldo, int64_t mc, int64_t n, uint16_t* edge) {
  const int64_t steps = (K + TK - 1) / TK;
  _tile_zero(3);
  _tile_zero(4);
  if (RB == 2) {
    _tile_zero(5);
    _tile_zero(6);
  }
  for (int64_t s = 0; s < steps; ++s) {
    int64_t sa, sb;
    const uint16_t* a0 = a_source(w, ldw, N, K, n, s, edge, sa);
    _tile_loadd(0, a0, sa);
    const uint16_t* a1 = a_source(w, ldw, N, K, n + TN, s, edge + TN * TK, sb);
    _tile_loadd(1, a1, sb);
    const uint32_t* b = xb + s * RB * TILE_WORDS;
    const int64_t term = steps * RB * TILE_WORDS;
    for (int t = 0; t < terms; ++t, b += term) {
      // B tiles alternate between 2 and 7: a load does not wait on the dot products reading the other
      _tile_loadd(2, b, TM * 4);
      _tile_dpbf16ps(3, 0, 2);
      _tile_dpbf16ps(4, 1, 2);
      if (RB == 2) {
        _tile_loadd(7, b + TILE_WORDS, TM * 4);
        _tile_dpbf16ps(5, 0, 7);
        _tile_dpbf16ps(6, 1, 7);
      }
    }
  }
  alignas(64) float c[4][TN * TM];
  _tile_stored(3, c[0], TM * 4);
  _tile_stored(4, c[1], TM * 4);
  if (RB == 2) {
    _tile_stored(5, c[2], TM * 4);
    _tile_stored(6, c[3], TM * 4);
  }
  for (int r = 0; r < RB; ++r) {
    const int64_t rows = std::min(TM, mc - r * TM);
    for (int a = 0; a < 2 && n + a * TN < N; ++a) {
      store_c(c[2 * r + a], out + r * TM * ldo, ldo, rows, n + a * TN, std::min(TN, N - n - a * TN));
    }
  }
}

// One GEMM's share of work after x is packed: blocks of BLOCK_COLS output columns, each run whole
// on one thread (cpu_split.cpp), its tiles configured there.
constexpr int64_t BLOCK_COLS = 4 * 2 * TN;
template <typename T>
struct Job {
  const uint16_t* w;
  int64_t ldw, N, K;
  const uint32_t* xb;
  int terms;
  T* out;
  int64_t ldo, mc, rb;
};

template <typename T>
AMX_TARGET void run_block(const void* p, int64_t block) {
  const Job<T>& j = *static_cast<const Job<T>*>(p);
  configure();
  alignas(64) uint16_t edge[2 * TN * TK];
  for (int64_t n = block * BLOCK_COLS; n < std::min(j.N, (block + 1) * BLOCK_COLS); n += 2 * TN) {
    if (j.rb == 1) {
      pass<1>(j.w, j.ldw, j.N, j.K, j.xb, j.terms, j.out, j.ldo, j.mc, n, edge);
    } else {
      pass<2>(j.w, j.ldw, j.N, j.K, j.xb, j.terms, j.out, j.ldo, j.mc, n, edge);
    }
  }
  _tile_release();  // tiles back to their initial state: between calls a context switch saves none
}

template <typename T>
AMX_TARGET void rows_block(const T* x, int64_t ldx, const uint16_t* w, int64_t ldw, T* out, int64_t ldo,
                           int64_t mc, int64_t K, int64_t N, std::vector<uint32_t>& xb) {
  const int64_t rb = (mc + TM - 1) / TM, steps = (K + TK - 1) / TK;
  const int terms = std::is_same_v<T, float> ? 3 : 1;
  xb.resize(terms * steps * rb * TILE_WORDS);
  if constexpr (std::is_same_v<T, float>) {
    pack_f32(x, ldx, mc, K, rb, xb.data());
  } else {
    pack_bf16(x, ldx, mc, K, rb, xb.data());
  }
  const Job<T> job{w, ldw, N, K, xb.data(), terms, out, ldo, mc, rb};
  tandem_split::run(&job, run_block<T>, (N + BLOCK_COLS - 1) / BLOCK_COLS);
}

bool request_tiles() {
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
      !__builtin_cpu_supports("avx512bf16")) {
    return false;
  }
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

// The packed activation: 3 terms x K/32 steps x 2 row blocks x 1 KB (192 KB at K = 1024).
thread_local std::vector<uint32_t> xb;

AMX_TARGET void linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; m += ROWS_MAX) {
    const int64_t mc = std::min(ROWS_MAX, M - m);
    if (x.scalar_type() == at::kFloat) {
      rows_block(x.data_ptr<float>() + m * x.stride(0), x.stride(0), wp, w.stride(0),
                 out.data_ptr<float>() + m * N, N, mc, K, N, xb);
    } else {
      rows_block(x.data_ptr<at::BFloat16>() + m * x.stride(0), x.stride(0), wp, w.stride(0),
                 out.data_ptr<at::BFloat16>() + m * N, N, mc, K, N, xb);
    }
  }
}
#endif

}  // namespace tandem_amx

// Whether this process may run AMX tiles (the CPU has AMX-BF16 and the kernel granted the tile
// state); asked once.
bool amx_ready() {
#ifdef HAVE_AMX
  static const bool ok = tandem_amx::request_tiles();
  return ok;
#else
  return false;
#endif
}

// out = x @ w^T for w [N, K] bfloat16 row-major and x [M, K] float32 or bfloat16 (unit stride
// along K); out [M, N] in x's dtype. Requires amx_ready().
void amx_linear(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
#ifdef HAVE_AMX
  tandem_amx::linear(x, w, out);
#endif
}

// Whether the AMX path runs in this process (tests assert it where the CPU has AMX-BF16).
extern "C" int tandem_cpu_amx_ready() { return amx_ready() ? 1 : 0; }
