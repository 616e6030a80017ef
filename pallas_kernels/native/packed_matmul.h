// The packed matmul's kernels, shared by the native CPU matmul (matmul.cc) and the
// fused decoder layer (decoder_layer.cc): weights packed once as [N / kPanel, K, kPanel]
// column panels, and PackedPanel, all M rows of x against one panel; quantized weights' codes in
// the same panels and PackedQuantPanel (the "quantized panels" section); JobPanel, either.
#ifndef JSERVE_PACKED_MATMUL_H_
#define JSERVE_PACKED_MATMUL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "variant.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jserve_native {

// A float16 value's bits (a quantized weight's scales; distinct from bfloat16's uint16_t).
struct Half {
  uint16_t bits;
};

// float16 -> float32, exact (subnormals, infinities and NaNs too).
inline float HalfToFloat(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu, man = h.bits & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Why: at the decode step's few rows XLA:CPU's dots run the layer matmuls far below the machine's
// FLOP rate, as libraries pack the weight panel on every call; here the weights are packed once,
// at load.
// Layout: panel p holds columns kPanel*p .. kPanel*(p+1)-1 of w [K, N] as [K][kPanel] (N padded
// with zero columns to a multiple of kPanel; out has the padded width). kPanel is 3 vectors: 24
// columns with AVX2, 48 with AVX-512 (the build's -march=native picks; `JserveMatmulPanel()`
// tells Python, which packs to match).
// Micro-kernel: MR (<= kMR: 4 with AVX2, 8 with AVX-512) rows of x x one panel, 3 * MR
// accumulators + 3 W vectors + 1 broadcast; per k: 3 loads of W, MR broadcasts of x, 3 * MR FMAs.
// Loop order per task (a run of panels): for each panel, for each block of kKc rows of W, for
// each kMR-row block of x: micro-kernel. The [kKc, kPanel] block of W is read from memory once and
// re-read from L1 by the other row blocks; the rows kPrefetch ahead are software-prefetched into
// L2, the prefetches spread over the row blocks. Into L2 (T1) rather than L1 (T0): the same with
// AVX2, faster with AVX-512, where 128 rows ahead are 24 KB of a 48 KB L1. Tuned with AVX2 against
// XLA's dots: faster than them at M <= 64, the decode step's rows, slower than XLA's YNNPACK dot
// at M = 512 (docs/performance.md).

#if defined(__AVX512F__)
// 16 float lanes: a panel is 48 columns (3 zmm) and the micro-kernel takes up to 8 rows: 24
// accumulators + 3 W vectors + 1 broadcast of the 32 registers.
struct Simd {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMR = 8;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  // 16 bfloat16 weights as float32: widened, then shifted into the upper 16 bits (exact).
  static V Load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // 16 float16 scales as float32 (exact).
  static V Load(const Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // 16 int8 codes as float32.
  static V LoadI8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // 16 bytes of nibble pairs, zero-extended to 32-bit lanes; Low and High: their codes [0, 15]
  // as float32, looked up in a 16-float table (vpermps reads an index's low 4 bits: the low
  // nibble needs no mask, and the lookup is the conversion).
  using VI = __m512i;
  static VI LoadBytes(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V Nibbles() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static V Low(VI b) { return _mm512_permutexvar_ps(b, Nibbles()); }
  static V High(VI b) { return _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), Nibbles()); }
  static V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void StoreAligned(float* p, V v) { _mm512_store_ps(p, v); }
};
#define JSERVE_SIMD 1
#elif defined(__AVX2__)
// 8 float lanes: a panel is 24 columns (3 ymm) and the micro-kernel takes up to 4 rows: 12
// accumulators + 3 W vectors + 1 broadcast = the 16 registers.
struct Simd {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMR = 4;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  // 8 bfloat16 weights as float32: widened, then shifted into the upper 16 bits (exact).
  static V Load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // 8 float16 scales as float32 (F16C, part of x86-64-v3; exact).
  static V Load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // 8 int8 codes as float32.
  static V LoadI8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // 8 bytes of nibble pairs (see the AVX-512 ones).
  using VI = __m256i;
  static VI LoadBytes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static V Low(VI b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
  static V High(VI b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
  static V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void StoreAligned(float* p, V v) { _mm256_store_ps(p, v); }
};
#define JSERVE_SIMD 1
#endif

// A packed weight's codes: float32 or bfloat16 values, or a quantized weight's codes (below).
// kInt4: symmetric int4, each nibble its code + 8 ([0, 15] for [-8, 7]); kUint4: codes [0, 15].
enum class Codes : int { kFloat = 0, kInt8 = 1, kInt4 = 2, kUint4 = 3 };

#ifdef JSERVE_SIMD
constexpr int64_t kPanel = 3 * Simd::kLanes;
constexpr int kMR = Simd::kMR;
constexpr int64_t kKc = 128;         // rows of W per K block
constexpr int64_t kPrefetch = 128;   // software prefetch distance, rows of W
constexpr int64_t kTasksPerWorker = 8;
constexpr int64_t kLine = 16;        // floats per cache line

// o[MR, kPanel] (+)= x[MR, kl] @ w[kl, kPanel] (w: a block of a packed panel, rows kPanel values
// apart; x rows ldx apart, o rows ldo apart). Each k also prefetches into L2 the cache lines
// that begin in the next `share` floats at pf + k * share and before: each line once, at most
// three per k (share <= 48 floats), without an inner loop. A loop per k of one prefetch per 16
// floats plus one for the share's last float (at 16 rows, 3 prefetches for a share of 1.5 lines)
// streamed the weights more slowly at every row count (docs/performance.md).
template <int MR, typename T = float>
inline __attribute__((always_inline)) void Kernel(int64_t kl, const float* __restrict x,
                                                  int64_t ldx, const T* __restrict w,
                                                  float* __restrict o, int64_t ldo,
                                                  bool accumulate, const float* pf,
                                                  int64_t share) {
  using V = Simd::V;
  constexpr int L = Simd::kLanes;
  V acc[MR][3];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) acc[m][v] = accumulate ? Simd::Load(o + m * ldo + L * v) : Simd::Zero();
  const char* next = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(pf) & ~uintptr_t{63});
  const char* end = reinterpret_cast<const char*>(pf);
  for (int64_t k = 0; k < kl; ++k) {
    end += 4 * share;
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      if (i * kLine < share && next < end) {  // a k's share begins at most ceil(share / 16) lines
        _mm_prefetch(next, _MM_HINT_T1);
        next += 64;
      }
    }
    const T* wk = w + k * kPanel;
    V wv[3];
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      wv[v] = Simd::Load(wk + L * v);
      // Keep W in a register: otherwise GCC folds the load into every FMA (one load per FMA
      // instead of 3 per k), and the kernel becomes load-port bound.
      asm volatile("" : "+v"(wv[v]));
    }
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const V xb = Simd::Broadcast(x + m * ldx + k);
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) acc[m][v] = Simd::Fma(xb, wv[v], acc[m][v]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) Simd::Store(o + m * ldo + L * v, acc[m][v]);
}

// The 1 .. R-row kernel for `rows` <= R rows.
template <int R, typename T>
inline void TailKernel(int rows, int64_t kl, const float* x, int64_t ldx, const T* w, float* o,
                       int64_t ldo, bool accumulate, const float* pf, int64_t share) {
  if constexpr (R > 1) {
    if (rows < R) return TailKernel<R - 1, T>(rows, kl, x, ldx, w, o, ldo, accumulate, pf, share);
  }
  Kernel<R, T>(kl, x, ldx, w, o, ldo, accumulate, pf, share);
}

// All M rows of x against one [kl, kPanel] block of a panel: kMR-row blocks, then a shorter
// tail. The row blocks share the prefetch of the next kl panel rows at pf, each `row_floats`
// floats long (kPanel, or half that for a bfloat16 panel): block j fetches its 1/nb share, so the
// memory traffic is spread over all of them.
template <typename T = float>
inline void RowBlocks(int64_t M, int64_t K, int64_t kl, const float* x, const T* w, float* o,
                      int64_t ldo, bool accumulate, const float* pf, int64_t row_floats) {
  const int64_t nb = (M + kMR - 1) / kMR;
  const int64_t share = (row_floats + nb - 1) / nb;
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) {
    const float* p = pf + (m / kMR) * kl * share;
    Kernel<kMR, T>(kl, x + m * K, K, w, o + m * ldo, ldo, accumulate, p, share);
  }
  if (m < M) {  // a separate tail keeps the main loop's kernel alone (faster at M = 16)
    TailKernel<kMR - 1, T>(static_cast<int>(M - m), kl, x + m * K, K, w, o + m * ldo, ldo,
                           accumulate, pf + (m / kMR) * kl * share, share);
  }
}

// All M rows of x against one packed panel [K][kPanel]: o[:, 0:kPanel], rows ldo apart, K in
// blocks of kKc rows; the rows kPrefetch ahead are prefetched (past the panel's end that is the
// start of the next panel, which comes next; prefetches never fault). A bfloat16 panel is
// prefetched as its bfloat16 rows (half the bytes) and widened (one shift per vector): by the
// kernel as it loads each weight, or, from kBufferRows rows of x on, once per [kl, kPanel] block
// into a float32 buffer that the row blocks then read from L1. Widening in the kernel is faster
// at a few rows, the buffer from kBufferRows on; with the buffer a bfloat16 prefill chunk runs
// about as fast as float32, without it much slower (docs/performance.md).
constexpr int64_t kBufferRows = 16;

template <typename T>
void PackedPanel(int64_t M, int64_t K, const float* x, const T* panel, float* o, int64_t ldo) {
  constexpr int64_t row_floats = kPanel * sizeof(T) / sizeof(float);
  const bool buffer = !std::is_same<T, float>::value && M >= kBufferRows;
  alignas(64) float wide[kKc * kPanel];
  for (int64_t kb = 0; kb < K; kb += kKc) {
    const int64_t kl = std::min(kKc, K - kb);
    const T* wb = panel + kb * kPanel;
    const float* pf = reinterpret_cast<const float*>(wb + kPrefetch * kPanel);
    if (buffer) {
      for (int64_t i = 0; i < kl * kPanel; i += Simd::kLanes) {
        Simd::StoreAligned(wide + i, Simd::Load(wb + i));
      }
      RowBlocks(M, K, kl, x + kb, wide, o, ldo, kb > 0, pf, row_floats);
    } else {
      RowBlocks(M, K, kl, x + kb, wb, o, ldo, kb > 0, pf, row_floats);
    }
  }
}


// ---------------------------------------------------------------------------- quantized panels
// The same panels with a quantized weight's codes (matmul.py's pack_quantized): codes [N / kPanel,
// K, kPanel] int8, or [N / kPanel, K / 2, kPanel] uint8 for int4 (byte (i, j): row 2i of column j
// in the low nibble, 2i + 1 in the high one; unsigned [0, 15] with offsets, or symmetric codes
// [-8, 7] stored as code + 8), and scales [N / kPanel, K / G, S, kPanel] float32 or float16 (S = 1:
// the group's scale; S = 2: its scale, then its offset):
//   w[k, n] = scale[k / G][n] * code[k][n] (+ offset[k / G][n]).
// The kernel reads the codes and dequantizes in registers: per group, acc = sum_k x[k] * code[k]
// (codes converted to float32, exact), then o += scale * acc (+ offset * xs, xs = sum_k x[k] over
// the group; symmetric int4: scale * (acc - 8 * xs), its codes read as the unsigned nibbles, the
// cheaper conversion).
constexpr int64_t kQuantPrefetch = 8192;  // bytes of codes prefetched ahead

template <int MR, Codes C, typename S>
inline __attribute__((always_inline)) void QuantKernel(
    int64_t ngroups, int64_t rows, const float* __restrict x, int64_t ldx, const uint8_t* __restrict codes,
    const S* __restrict scale, const S* __restrict offset, int64_t scale_stride,
    const float* __restrict xsum, int64_t ldxs, float* __restrict o, int64_t ldo,
    float* __restrict part, bool first, bool last, bool init, const char* pf) {
  using V = Simd::V;
  constexpr int L = Simd::kLanes;
  constexpr int64_t kHalves = C == Codes::kInt8 ? 1 : 2;  // rows per kPanel bytes of codes
  // `ngroups` whole groups of `rows` rows one after the other (first and last), or one segment
  // of a group (a group longer than a block of rows: its partial sums wait in `part`).
  for (int64_t gi = 0; gi < ngroups; ++gi, x += rows, codes += rows / kHalves * kPanel, scale += scale_stride,
               offset = offset ? offset + scale_stride : nullptr, xsum += 1, init = false,
               pf = pf ? pf + rows / kHalves * kPanel : nullptr) {
  // With one or two rows of x, 3 * MR accumulators are too few chains to hide the FMA's latency:
  // a second set takes the odd rows (int8) or the high nibbles (int4), added at the end.
  constexpr bool kSplit = MR <= 2;
  constexpr int kSets = kSplit ? 2 : 1;
  V acc[kSets][MR][3];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      acc[0][m][v] = first ? Simd::Zero() : Simd::Load(part + m * kPanel + L * v);
      if constexpr (kSplit) acc[kSets - 1][m][v] = Simd::Zero();
    }
  if constexpr (C == Codes::kInt8) {
    const int8_t* c = reinterpret_cast<const int8_t*>(codes);
    int64_t k = 0;
    auto row = [&](int64_t k, V (&a)[MR][3]) {
      V wv[3];
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) wv[v] = Simd::LoadI8(c + k * kPanel + L * v);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const V xb = Simd::Broadcast(x + m * ldx + k);
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) a[m][v] = Simd::Fma(xb, wv[v], a[m][v]);
      }
    };
    for (; k + 1 < rows; k += 2) {
      if (pf) _mm_prefetch(pf + k * kPanel, _MM_HINT_T1);
      if (pf) _mm_prefetch(pf + (k + 1) * kPanel, _MM_HINT_T1);
      row(k, acc[0]);
      row(k + 1, acc[kSets - 1]);
    }
    if (k < rows) row(k, acc[0]);
  } else {
    for (int64_t k = 0; k < rows; k += 2) {
      const uint8_t* ck = codes + (k / 2) * kPanel;
      if (pf) _mm_prefetch(pf + (k / 2) * kPanel, _MM_HINT_T1);
      // The low nibbles (row k) against every row of x, then the high ones (row k + 1): 3 * MR
      // accumulators, the 3 byte vectors and 3 weight vectors fit the registers at MR = 8.
      Simd::VI b[3];
      V wv[3];
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) {
        b[v] = Simd::LoadBytes(ck + L * v);
        wv[v] = Simd::Low(b[v]);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const V xl = Simd::Broadcast(x + m * ldx + k);
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) acc[0][m][v] = Simd::Fma(xl, wv[v], acc[0][m][v]);
      }
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) wv[v] = Simd::High(b[v]);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const V xh = Simd::Broadcast(x + m * ldx + k + 1);
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) acc[kSets - 1][m][v] = Simd::Fma(xh, wv[v], acc[kSets - 1][m][v]);
      }
    }
  }
  if constexpr (kSplit) {
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) acc[0][m][v] = Simd::Add(acc[0][m][v], acc[1][m][v]);
  }
  if (!last) {  // a group that goes on in the next block of rows
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) Simd::Store(part + m * kPanel + L * v, acc[0][m][v]);
    continue;
  }
  V sv[3], ov[3];
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) {
    sv[v] = Simd::Load(scale + L * v);
    if (offset) ov[v] = Simd::Load(offset + L * v);
  }
  const float minus8 = -8.0f;
  const V bias = Simd::Broadcast(&minus8);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const V xs = offset || C == Codes::kInt4 ? Simd::Broadcast(xsum + m * ldxs) : Simd::Zero();
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) {
      V r = acc[0][m][v];
      if constexpr (C == Codes::kInt4) r = Simd::Fma(bias, xs, r);  // the codes' + 8
      r = Simd::Mul(r, sv[v]);
      if (offset) r = Simd::Fma(ov[v], xs, r);
      if (!init) r = Simd::Add(r, Simd::Load(o + m * ldo + L * v));
      Simd::Store(o + m * ldo + L * v, r);
    }
  }
  }
}

template <int R, Codes C, typename S>
inline void QuantRows(int rows_of_x, int64_t ngroups, int64_t rows, const float* x, int64_t ldx,
                      const uint8_t* codes, const S* scale, const S* offset, int64_t scale_stride,
                      const float* xsum, int64_t ldxs, float* o, int64_t ldo, float* part, bool first,
                      bool last, bool init, const char* pf) {
  if constexpr (R > 1) {
    if (rows_of_x < R) {
      return QuantRows<R - 1, C, S>(rows_of_x, ngroups, rows, x, ldx, codes, scale, offset, scale_stride, xsum,
                                    ldxs, o, ldo, part, first, last, init, pf);
    }
  }
  QuantKernel<R, C, S>(ngroups, rows, x, ldx, codes, scale, offset, scale_stride, xsum, ldxs, o, ldo, part, first,
                       last, init, pf);
}
#else
// Without AVX2: plain loops (auto-vectorised), 24-column panels.
constexpr int64_t kPanel = 24;
constexpr int64_t kTasksPerWorker = 8;
inline float Value(float w) { return w; }
inline float Value(uint16_t w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <typename T>
void PackedPanel(int64_t M, int64_t K, const float* x, const T* panel, float* o, int64_t ldo) {
  for (int64_t m = 0; m < M; ++m) {
    float* om = o + m * ldo;
    for (int64_t j = 0; j < kPanel; ++j) om[j] = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * K + k];
      for (int64_t j = 0; j < kPanel; ++j) om[j] += xv * Value(panel[k * kPanel + j]);
    }
  }
}

// Without AVX2: plain loops over the same quantized panels (see the SIMD section's comment).
inline float Value(Half h) { return HalfToFloat(h); }

template <Codes C>
inline float Code(const uint8_t* codes, int64_t k, int64_t j) {
  if constexpr (C == Codes::kInt8) {
    return static_cast<float>(reinterpret_cast<const int8_t*>(codes)[k * kPanel + j]);
  } else {
    const uint8_t b = codes[(k / 2) * kPanel + j];
    const int nib = (k & 1) ? b >> 4 : b & 15;
    return static_cast<float>(C == Codes::kInt4 ? nib - 8 : nib);
  }
}
#endif  // JSERVE_SIMD

// The sums of x's rows over each group of G columns: xsum [M, K / G] (an offset's share is
// offset * the group's sum of x).
inline void GroupSums(int64_t M, int64_t K, int64_t G, const float* x, float* xsum) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < K / G; ++g) {
      const float* xg = x + m * K + g * G;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < G; ++k) sum += xg[k];
      xsum[m * (K / G) + g] = sum;
    }
  }
}

// All M rows of x [M, K] against one quantized panel: codes (the panel's [K, kPanel] int8 or
// [K / 2, kPanel] nibble pairs) and scales ([K / G, S, kPanel]) into o[:, 0:kPanel], rows ldo apart.
template <Codes C, typename S>
void PackedQuantPanel(int64_t M, int64_t K, const float* x, const uint8_t* codes, const S* scales,
                      int64_t G, int64_t ns, float* o, int64_t ldo) {
  const int64_t groups = K / G;
  const bool asym = ns == 2;
  thread_local std::vector<float> xsum_buf, part_buf;
  if (asym || C == Codes::kInt4) {
    if (static_cast<int64_t>(xsum_buf.size()) < M * groups) xsum_buf.resize(M * groups);
    GroupSums(M, K, G, x, xsum_buf.data());
  }
  const float* xsum = xsum_buf.data();
#ifdef JSERVE_SIMD
  // Blocks of whole groups (the codes of a block are read from memory by the first kMR rows of x
  // and from L1 by the others), or of kKc rows of a longer group, whose partial sums wait in `part`.
  // With one block of rows of x no codes are re-read: a long group is one block too.
  const int64_t kc = G <= kKc ? G * (kKc / G) : M <= kMR ? G : kKc;
  if (G > kc && static_cast<int64_t>(part_buf.size()) < M * kPanel) part_buf.resize(M * kPanel);
  // The sums go to a tile of rows kPanel apart, copied to o at the end: o's rows can be a
  // multiple of 4 KB apart (the head's), and written once per group they would evict each other
  // from L1.
  thread_local std::vector<float> tile_buf;
  if (static_cast<int64_t>(tile_buf.size()) < M * kPanel) tile_buf.resize(M * kPanel);
  float* tile = tile_buf.data();
  constexpr int64_t kHalves = C == Codes::kInt8 ? 1 : 2;  // rows per kPanel bytes of codes
  for (int64_t kb = 0, g0 = 0; kb < K; kb += kc) {
    const int64_t kl = std::min(kc, K - kb);
    const uint8_t* c = codes + kb / kHalves * kPanel;
    const char* pf = reinterpret_cast<const char*>(c) + kQuantPrefetch;
    if (G <= kc) {  // whole groups: one call per kMR rows of x walks them all
      const int64_t g = kb / G;
      for (int64_t m = 0; m < M; m += kMR) {
        QuantRows<kMR, C, S>(static_cast<int>(std::min<int64_t>(kMR, M - m)), kl / G, G, x + m * K + kb, K, c,
                             scales + g * ns * kPanel, asym ? scales + g * ns * kPanel + kPanel : nullptr,
                             ns * kPanel, xsum + m * groups + g, groups, tile + m * kPanel, kPanel, nullptr, true,
                             true, g == 0, m == 0 ? pf : nullptr);
      }
      continue;
    }
    // A group longer than the block: the block's segments (at most two groups' parts).
    for (int64_t m = 0; m < M; m += kMR) {
      const int rows_of_x = static_cast<int>(std::min<int64_t>(kMR, M - m));
      int64_t g = g0;
      for (int64_t s0 = kb; s0 < kb + kl; ++g) {
        const int64_t s1 = std::min((g + 1) * G, kb + kl);
        const S* sc = scales + g * ns * kPanel;
        QuantRows<kMR, C, S>(rows_of_x, 1, s1 - s0, x + m * K + s0, K, codes + s0 / kHalves * kPanel, sc,
                             asym ? sc + kPanel : nullptr, 0, xsum + m * groups + g, groups, tile + m * kPanel,
                             kPanel, part_buf.data() + m * kPanel, s0 == g * G, s1 == (g + 1) * G, g == 0,
                             m == 0 ? pf + (s0 - kb) / kHalves * kPanel : nullptr);
        s0 = s1;
      }
    }
    while ((g0 + 1) * G <= kb + kl) ++g0;  // the group the next block starts in
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(o + m * ldo, tile + m * kPanel, kPanel * sizeof(float));
#else
  float acc[kPanel];
  for (int64_t m = 0; m < M; ++m) {
    float* om = o + m * ldo;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < kPanel; ++j) acc[j] = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) {
        const float xv = x[m * K + k];
        for (int64_t j = 0; j < kPanel; ++j) acc[j] += xv * Code<C>(codes, k, j);
      }
      const S* sc = scales + g * ns * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) {
        float r = acc[j] * Value(sc[j]);
        if (asym) r += Value(sc[kPanel + j]) * xsum[m * groups + g];
        om[j] = g == 0 ? r : om[j] + r;
      }
    }
  }
#endif
}

#include "quant_dot.h"  // the integer dot products at several rows (ActQuant, PackedQuantPanelInt)

// One weight of a call: its packed panels (float32 or bfloat16 values, or a quantized weight's
// codes and scales), how many, and where its [M, panels * kPanel] output goes.
struct Job {
  const void* w;
  bool bf16;
  int64_t panels;
  float* out;
  Codes codes = Codes::kFloat;
  const void* scales = nullptr;  // quantized: [panels, K / group, ns, kPanel]
  bool f16_scales = false;
  int64_t group = 0;
  int64_t ns = 1;  // 2: scales and offsets
  bool quads = false;  // int4 codes stored as quads (quant_dot.h's QuadCodes): the integer path only
};

template <Codes C>
inline void QuantJobPanel(const Job& job, int64_t p, int64_t M, int64_t K, const float* x, float* o,
                          int64_t ldo, int64_t code_rows, const ActQuant* aq) {
  const uint8_t* codes = static_cast<const uint8_t*>(job.w) + p * code_rows * kPanel;
  const int64_t per_panel = K / job.group * job.ns * kPanel;
#if JSERVE_INT_DOT
  if (aq && aq->M == M && aq->K == K && IntDotTakes(job.group, aq->B)) {
    if (job.f16_scales) {
      PackedQuantPanelInt<C>(*aq, codes, static_cast<const Half*>(job.scales) + p * per_panel, job.group,
                             job.ns, o, ldo, job.quads);
    } else {
      PackedQuantPanelInt<C>(*aq, codes, static_cast<const float*>(job.scales) + p * per_panel, job.group,
                             job.ns, o, ldo, job.quads);
    }
    return;
  }
#else
  (void)aq;
#endif
  if (job.f16_scales) {
    PackedQuantPanel<C>(M, K, x, codes, static_cast<const Half*>(job.scales) + p * per_panel, job.group,
                        job.ns, o, ldo);
  } else {
    PackedQuantPanel<C>(M, K, x, codes, static_cast<const float*>(job.scales) + p * per_panel, job.group,
                        job.ns, o, ldo);
  }
}

// Panel p of a job: all M rows of x [M, K] into the panel's columns of job.out. `aq`: x quantized
// (ActQuant, quant_dot.h) for a quantized weight's integer path where this build and the weight's
// group take it; null, or a float weight: the float path.
inline void JobPanel(const Job& job, int64_t p, int64_t M, int64_t K, const float* x,
                     const ActQuant* aq = nullptr) {
  float* o = job.out + p * kPanel;
  const int64_t ldo = job.panels * kPanel;
  switch (job.codes) {
    case Codes::kFloat:
      if (job.bf16) {
        PackedPanel(M, K, x, static_cast<const uint16_t*>(job.w) + p * K * kPanel, o, ldo);
      } else {
        PackedPanel(M, K, x, static_cast<const float*>(job.w) + p * K * kPanel, o, ldo);
      }
      return;
#if JSERVE_NATIVE_QUANT
    case Codes::kInt8:
      return QuantJobPanel<Codes::kInt8>(job, p, M, K, x, o, ldo, K, aq);
    case Codes::kInt4:
      return QuantJobPanel<Codes::kInt4>(job, p, M, K, x, o, ldo, K / 2, aq);
    case Codes::kUint4:
      return QuantJobPanel<Codes::kUint4>(job, p, M, K, x, o, ldo, K / 2, aq);
#else
    default:  // never: PackedJob refuses quantized weights in this build
      (void)aq;
      return;
#endif
  }
}

}  // namespace jserve_native

#endif  // JSERVE_PACKED_MATMUL_H_
