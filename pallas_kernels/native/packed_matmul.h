// The packed matmul's kernels, shared by the native CPU matmul (matmul.cc) and the
// fused decoder layer (decoder_layer.cc): weights packed once as [N / kPanel, K, kPanel]
// column panels, and PackedPanel, all M rows of x against one panel.
#ifndef JSERVE_PACKED_MATMUL_H_
#define JSERVE_PACKED_MATMUL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jserve_native {

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
  static V Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
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
  static V Broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void StoreAligned(float* p, V v) { _mm256_store_ps(p, v); }
};
#define JSERVE_SIMD 1
#endif

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
#endif  // JSERVE_SIMD

// One weight of a call: its packed panels (float32 or bfloat16), how many, and where its
// [M, panels * kPanel] output goes.
struct Job {
  const void* w;
  bool bf16;
  int64_t panels;
  float* out;
};

// Panel p of a job: all M rows of x [M, K] into the panel's columns of job.out.
inline void JobPanel(const Job& job, int64_t p, int64_t M, int64_t K, const float* x) {
  if (job.bf16) {
    PackedPanel(M, K, x, static_cast<const uint16_t*>(job.w) + p * K * kPanel,
                job.out + p * kPanel, job.panels * kPanel);
  } else {
    PackedPanel(M, K, x, static_cast<const float*>(job.w) + p * K * kPanel,
                job.out + p * kPanel, job.panels * kPanel);
  }
}

}  // namespace jserve_native

#endif  // JSERVE_PACKED_MATMUL_H_
