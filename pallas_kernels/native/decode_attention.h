// Decode attention over the paged KV cache, shared by the native CPU attention kernel
// (paged_attention.cc) and the fused decoder layer (decoder_layer.cc): the
// page layout, the 8-wide vector helpers, and DecodeWork, one token per row against its pages.
//
// Layouts (the contract of all the paged-attention kernels, pallas_kernels/paged_attention/ops.py;
// a page id outside the pool reads page 0, the null page):
//   q        f32 [batch, num_kv_heads, groups, head_dim]: the row's query heads k * groups + g
//   k_pages  f32|bf16 [num_kv_heads, num_pages, page_size, head_dim]; v_pages alike; or quantized
//            codes, int8 (int8_t) or float8_e4m3fn (Fp8, its bits), with f32 scales
//            [num_kv_heads, num_pages, page_size] per tensor: a row is codes * its token's scale
//   q_start  s32 [batch]: the row's position (its key is already in the pages)
//   q_lens   s32 [batch]: 1 for a live row, 0 for a padded one (its output is 0)
//   page_indices s32 [batch, max_pages]
#ifndef JSERVE_DECODE_ATTENTION_H_
#define JSERVE_DECODE_ATTENTION_H_

#include <algorithm>
#include <array>
#include <cmath>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "variant.h"

namespace jserve_native {

constexpr int kMaxGroups = 16;   // query heads per KV head
constexpr int kMaxHeadDim = 256;
// Finite (the library is built with -ffast-math): exp(kMinScore - m) is 0 for any real score m.
constexpr float kMinScore = -1e30f;

inline float Bf16ToF32(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float8_e4m3fn pages: the code's bits (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
// infinities, S.1111.111 is NaN).
struct Fp8 {
  uint8_t bits;
};

// The 256 float8_e4m3fn values, by bits.
inline const float* Fp8Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::nanf("");
      t[b] = b & 128 ? -x : x;
    }
    return t;
  }();
  return table.data();
}

// Quantized page codes: int8 or float8_e4m3fn, each row with a float32 scale.
template <typename T>
constexpr bool kQuantized = std::is_same<T, int8_t>::value || std::is_same<T, Fp8>::value;

template <typename T>
inline float Load(const T* p, int i);
template <>
inline float Load<float>(const float* p, int i) { return p[i]; }
template <>
inline float Load<uint16_t>(const uint16_t* p, int i) { return Bf16ToF32(p[i]); }
template <>
inline float Load<int8_t>(const int8_t* p, int i) { return p[i]; }
template <>
inline float Load<Fp8>(const Fp8* p, int i) { return Fp8Table()[p[i].bits]; }

struct Shape {
  int64_t batch, kv_heads, tokens, groups, head_dim, num_pages, page_size, max_pages;
};

typedef float v8 __attribute__((vector_size(32)));

inline v8 Ld(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void St(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline v8 Max(v8 a, v8 b) { return a > b ? a : b; }

constexpr int64_t kKeyBlock = 64;

#if defined(__AVX512F__)
// 16-wide vectors for the AVX-512 build's scores and V accumulation (JSERVE_V16): half the
// multiply-adds of the 8-wide loops: a little faster from memory, clearly over L2-resident K/V
// (docs/performance.md).
// Not in the AVX2 build: twice the registers would spill.
#define JSERVE_V16 1
typedef float v16 __attribute__((vector_size(64)));
// The two 8-wide halves of a, added.
inline v8 Fold(v16 a) {
  return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

// Loads, stores and broadcasts for either vector type (v8, or v16 in the AVX-512 build).
template <typename VT>
inline VT LdV(const float* p) {
  VT v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename VT>
inline void StV(float* p, VT v) { std::memcpy(p, &v, sizeof v); }
template <typename VT>
inline VT SplatV(float x) { return VT{} + x; }

// Accumulate's dims dc .. dc + 4 * lanes - 1 (4 vectors of VT per row).
template <typename VT, int NR>
inline void AccumulateDims(const float* pt, int64_t js, int64_t rs, const float* alpha,
                           const float* const* vrow, float* acc, int64_t n, int64_t D, int64_t r,
                           int64_t dc) {
  constexpr int kL = sizeof(VT) / sizeof(float);
  VT a[NR][4];
  for (int i = 0; i < NR; ++i) {
    const VT s = SplatV<VT>(alpha[r + i]);
    for (int v = 0; v < 4; ++v) a[i][v] = LdV<VT>(acc + (r + i) * D + dc + kL * v) * s;
  }
  for (int64_t j = 0; j < n; ++j) {
    // NR broadcasts, then each V vector loaded once for all NR rows: 12 accumulators + 3
    // broadcasts + 1 V vector = the 16 ymm registers at NR = 3 (v8). Row by row, GCC kept 4 V
    // vectors live and spilled an accumulator, a store-to-load chain through every key that
    // slowed decode over L2-resident K/V (from DRAM both run at the memory's pace;
    // docs/performance.md).
    const float* vj = vrow[j] + dc;
    VT p[NR];
    for (int i = 0; i < NR; ++i) p[i] = SplatV<VT>(pt[j * js + (r + i) * rs]);
    for (int v = 0; v < 4; ++v) {
      const VT x = LdV<VT>(vj + kL * v);
      for (int i = 0; i < NR; ++i) a[i][v] += p[i] * x;
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int v = 0; v < 4; ++v) StV<VT>(acc + (r + i) * D + dc + kL * v, a[i][v]);
}

// acc[r] = acc[r] * alpha[r] + sum_j P(j, r) * vrow[j] for NR rows from r, 32 dims at a time
// (64 in the AVX-512 build); P(j, r) = pt[j * js + r * rs] (tiles hold St [keys][rows], decode
// P [rows][keys]).
template <int NR>
inline void Accumulate(const float* pt, int64_t js, int64_t rs, const float* alpha,
                       const float* const* vrow, float* acc, int64_t n, int64_t D, int64_t r) {
  int64_t dc = 0;
#ifdef JSERVE_V16
  for (; dc + 64 <= D; dc += 64) AccumulateDims<v16, NR>(pt, js, rs, alpha, vrow, acc, n, D, r, dc);
#endif
  for (; dc + 32 <= D; dc += 32) AccumulateDims<v8, NR>(pt, js, rs, alpha, vrow, acc, n, D, r, dc);
  for (; dc < D; dc += 8) {  // head_dim % 32 != 0: the last 8-wide columns
    v8 a[NR];
    for (int i = 0; i < NR; ++i) a[i] = Ld(acc + (r + i) * D + dc) * Splat(alpha[r + i]);
    for (int64_t j = 0; j < n; ++j) {
      const v8 v0 = Ld(vrow[j] + dc);
      for (int i = 0; i < NR; ++i) a[i] += Splat(pt[j * js + (r + i) * rs]) * v0;
    }
    for (int i = 0; i < NR; ++i) St(acc + (r + i) * D + dc, a[i]);
  }
}

typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

// dst[0..D) = the bfloat16 row src widened to float32, 8 at a time (a zero-extension and a
// shift: vpmovzxwd + vpslld with AVX2). GCC left the element-by-element loop scalar, and decode
// over bfloat16 K/V took more than twice as long that way, from L2 and from DRAM
// (docs/performance.md).
inline void WidenRow(const uint16_t* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    u16x8 h;
    std::memcpy(&h, src + d, sizeof h);
    const u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    std::memcpy(dst + d, &w, sizeof w);
  }
  for (; d < D; ++d) dst[d] = Bf16ToF32(src[d]);
}

// dst[0..D) = the int8 codes src times scale, 8 at a time with AVX2 (vpmovsxbd, vcvtdq2ps, a
// multiply; GCC left the generic vector conversion of 8 bytes scalar).
inline void WidenRow(const int8_t* src, float* dst, int64_t D, float scale) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 s = _mm256_set1_ps(scale);
  for (; d + 8 <= D; d += 8) {
    const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s));
  }
#endif
  for (; d < D; ++d) dst[d] = src[d] * scale;
}

// dst[0..D) = the float8_e4m3fn codes src times scale. With AVX2 and F16C, 8 at a time: a code's
// bits moved into a float16's (sign to bit 15, exponent and mantissa to bits 13..7) are the
// code's value times 2^-8 (subnormals included, float16 having 5 exponent bits to e4m3's 4), so
// vcvtph2ps and a multiply by scale * 256 give it exactly (the NaN code, which writes never
// produce, reads as 480). Otherwise a table lookup per code.
inline void WidenRow(const Fp8* src, float* dst, int64_t D, float scale) {
  int64_t d = 0;
#if defined(__AVX2__) && defined(__F16C__)
  static_assert(sizeof(Fp8) == 1, "Fp8 is one byte");
  const __m256 s = _mm256_set1_ps(scale * 256.0f);
  const __m128i sign = _mm_set1_epi16(0x80), rest = _mm_set1_epi16(0x7F);
  for (; d + 8 <= D; d += 8) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d)));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, sign), 8),
                                      _mm_slli_epi16(_mm_and_si128(w, rest), 7));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(half), s));
  }
#endif
  const float* table = Fp8Table();
  for (; d < D; ++d) dst[d] = table[src[d].bits] * scale;
}

// Pointers to the K and V rows of keys j0 .. j0 + n - 1 (n <= kKeyBlock) of one KV head: into
// the pages for f32, widened into `wide` (2 * kKeyBlock rows of D) for bf16, and for quantized
// codes widened and multiplied by their scales (`k_scale_head`, `v_scale_head`: the KV head's
// scales, [num_pages][P]). A page id outside the pool reads page 0. Page by page: one division per call. A division per key (key / P with
// P known only at run time: a 64-bit idiv) took a large share of decode over L2-resident K/V,
// and a smaller one from memory (docs/performance.md).
template <typename T>
inline void GatherRows(const T* k_head, const T* v_head, const int32_t* table, int64_t num_pages,
                       int64_t P, int64_t D, int64_t j0, int64_t n, float* wide,
                       const float** krow, const float** vrow,
                       const float* k_scale_head = nullptr, const float* v_scale_head = nullptr) {
  int64_t slot = j0 / P, offset = j0 % P;
  const T *kp = nullptr, *vp = nullptr;
  const float *ksp = nullptr, *vsp = nullptr;  // quantized: the current key's scales
  for (int64_t j = 0; j < n; ++j, ++offset, kp += D, vp += D) {
    if (j == 0 || offset == P) {
      if (offset == P) ++slot, offset = 0;
      int64_t page = table[slot];
      if (page < 0 || page >= num_pages) page = 0;
      kp = k_head + (page * P + offset) * D;
      vp = v_head + (page * P + offset) * D;
      if constexpr (kQuantized<T>) {
        ksp = k_scale_head + page * P + offset;
        vsp = v_scale_head + page * P + offset;
      }
    }
    if constexpr (std::is_same<T, float>::value) {
      krow[j] = kp;
      vrow[j] = vp;
    } else if constexpr (kQuantized<T>) {
      float* kw = wide + j * D;
      float* vw = wide + (kKeyBlock + j) * D;
      WidenRow(kp, kw, D, *ksp++);
      WidenRow(vp, vw, D, *vsp++);
      krow[j] = kw;
      vrow[j] = vw;
    } else {
      float* kw = wide + j * D;
      float* vw = wide + (kKeyBlock + j) * D;
      WidenRow(kp, kw, D);
      WidenRow(vp, vw, D);
      krow[j] = kw;
      vrow[j] = vw;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decode: one token's `groups` queries (one KV head) against blocks of up to kKeyBlock keys
// gathered across pages. Scores come 4 keys x up to 3 query heads at a time (Dots4), from
// independent dot products summed by a transposition (no horizontal sum per key); the softmax
// runs over the block in 8-wide vectors; V accumulates for 3 queries x 32 dims in registers
// (Accumulate; 16-wide and 64 dims in the AVX-512 build, JSERVE_V16). Each K and V row comes from memory once per token and from L1 once per 3 query
// heads. Needs head_dim % 8 == 0.

// out[0..3] = the lane sums of a[0..3]: two rounds of pairwise adds, then the two halves.
inline __attribute__((always_inline)) void SumLanes4(const v8* a, float* out) {
  auto hadd = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8 h = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // each 128-bit half: partial s0..s3
  const v8 r = h + __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3);
  std::memcpy(out, &r, 4 * sizeof(float));
}

// p[g][j + i] = q_g . krow[j + i] for 4 keys and NG (<= 3) heads: each K vector loaded once for
// all the heads (12 accumulators + 3 queries + 1 K vector = the 16 ymm registers). One head x 8
// keys at a time, with K reloaded per head, was slower, over L2-resident K/V and from memory
// alike (docs/performance.md).
template <int NG, int HD>
inline void Dots4(const float* const* krow, const float* q, int64_t head_dim, float* p, int64_t j) {
  const int64_t D = HD > 0 ? HD : head_dim;
#ifdef JSERVE_V16
  if (D % 16 == 0) {  // 16 dims at a time, each key's 16 lanes folded to 8 before the sums
    v16 a[NG][4] = {};
    for (int64_t d = 0; d < D; d += 16) {
      v16 qv[NG];
      for (int g = 0; g < NG; ++g) qv[g] = LdV<v16>(q + g * D + d);
      for (int i = 0; i < 4; ++i) {
        const v16 k = LdV<v16>(krow[j + i] + d);
        for (int g = 0; g < NG; ++g) a[g][i] += qv[g] * k;
      }
    }
    for (int g = 0; g < NG; ++g) {
      const v8 folded[4] = {Fold(a[g][0]), Fold(a[g][1]), Fold(a[g][2]), Fold(a[g][3])};
      SumLanes4(folded, p + g * kKeyBlock + j);
    }
    return;
  }
#endif
  v8 a[NG][4] = {};
  for (int64_t d = 0; d < D; d += 8) {
    v8 qv[NG];
    for (int g = 0; g < NG; ++g) qv[g] = Ld(q + g * D + d);
    for (int i = 0; i < 4; ++i) {
      const v8 k = Ld(krow[j + i] + d);
      for (int g = 0; g < NG; ++g) a[g][i] += qv[g] * k;
    }
  }
  for (int g = 0; g < NG; ++g) SumLanes4(a[g], p + g * kKeyBlock + j);
}

// The K and V rows of keys j1 .. j1 + kKeyBlock - 1 (not past end) of one (row, KV head): where
// each starts and how many cache lines it covers; none when the block spans pages or is empty.
struct KeyBlockLines {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t lines = 0;
};

template <typename T>
KeyBlockLines KeyBlockAt(const Shape& s, int64_t kv_head, const int32_t* table, int64_t j1,
                         int64_t end, const T* k_pages, const T* v_pages) {
  KeyBlockLines block;
  const int64_t P = s.page_size, D = s.head_dim, n1 = std::min(kKeyBlock, end - j1);
  if (n1 <= 0 || j1 % P + n1 > P) return block;
  int64_t page = table[j1 / P];
  if (page < 0 || page >= s.num_pages) page = 0;
  const int64_t row = ((kv_head * s.num_pages + page) * P + j1 % P) * D;
  block.k = reinterpret_cast<const char*>(k_pages + row);
  block.v = reinterpret_cast<const char*>(v_pages + row);
  block.lines = (n1 * D * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  return block;
}

// Prefetches the block that comes next (the next 64 keys, or after a task's last block the next
// task's first: with ParallelFor's contiguous shares usually this thread's next task) into L2,
// in equal shares over the steps of this block's scores. Where memory is far, prefetching the
// next block shortens decode attention, most with the pages scattered over the pool as the engine
// leaves them; on some machines no prefetch variant changed it beyond the noise. The next task's
// first block helps on scattered pages only (on contiguous ones it made no difference); two
// blocks ahead as well was tried and not kept (docs/performance.md).
struct Prefetcher {
  Prefetcher(KeyBlockLines block, int64_t steps)
      : b(block), per_step((block.lines + steps - 1) / std::max<int64_t>(steps, 1)) {}
  void Step() {
    const int64_t stop = std::min(b.lines, done + per_step);
    for (; done < stop; ++done) {
      __builtin_prefetch(b.k + 64 * done, 0, 2);
      __builtin_prefetch(b.v + 64 * done, 0, 2);
    }
  }
  KeyBlockLines b;
  int64_t per_step, done = 0;
};

// Keys begin .. end - 1 of row `table`'s KV head k for one token's G queries (qs [G][D], scaled
// by sm_scale): leaves the running max m[g], sum l[g] and unnormalised acc[g][D]. `after`: the
// block to prefetch during the last one. Quantized pages: `k_scales`, `v_scales` (all heads').
template <typename T, int HD>
void DecodeRange(const Shape& s, int64_t k, const int32_t* table, int64_t begin, int64_t end,
                 const float* qs, const T* k_pages, const T* v_pages, float soft_cap, float* m,
                 float* l, float* acc, KeyBlockLines after, const float* k_scales = nullptr,
                 const float* v_scales = nullptr) {
  const int64_t D = s.head_dim, G = s.groups, P = s.page_size;
  const T* k_head = k_pages + k * s.num_pages * P * D;
  const T* v_head = v_pages + k * s.num_pages * P * D;
  const float* ks_head = k_scales ? k_scales + k * s.num_pages * P : nullptr;
  const float* vs_head = v_scales ? v_scales + k * s.num_pages * P : nullptr;
  alignas(64) float p[kMaxGroups * kKeyBlock];  // P [query][key] of the block
  float alpha[kMaxGroups];
  const float* krow[kKeyBlock + 8];  // + padding lanes of the last 8 keys
  const float* vrow[kKeyBlock];
  thread_local std::vector<float> wide;
  if (!std::is_same<T, float>::value) wide.resize(2 * kKeyBlock * D);
  std::fill(m, m + G, kMinScore);
  std::fill(l, l + G, 0.0f);
  std::fill(acc, acc + G * D, 0.0f);
  for (int64_t j0 = begin; j0 < end; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - j0), n8 = (n + 7) / 8 * 8;
    GatherRows(k_head, v_head, table, s.num_pages, P, D, j0, n, wide.data(), krow, vrow, ks_head,
               vs_head);
    for (int64_t j = n; j < n8; ++j) krow[j] = krow[n - 1];  // scored, then masked
    Prefetcher next(j0 + n < end ? KeyBlockAt(s, k, table, j0 + n, end, k_pages, v_pages) : after,
                    (n + 3) / 4);
    for (int64_t g0 = 0; g0 < G; g0 += 3) {
      const int64_t ng = std::min<int64_t>(3, G - g0);
      float* pg0 = p + g0 * kKeyBlock;
      for (int64_t j = 0; j < n; j += 4) {
        if (g0 == 0) next.Step();
        if (ng == 3) Dots4<3, HD>(krow, qs + g0 * D, D, pg0, j);
        else if (ng == 2) Dots4<2, HD>(krow, qs + g0 * D, D, pg0, j);
        else Dots4<1, HD>(krow, qs + g0 * D, D, pg0, j);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* pg = p + g * kKeyBlock;
      if (soft_cap > 0.0f) {
        for (int64_t j = 0; j < n; ++j) pg[j] = soft_cap * std::tanh(pg[j] / soft_cap);
      }
      std::fill(pg + n, pg + n8, kMinScore);
      v8 mv = Splat(kMinScore);
      for (int64_t j = 0; j < n8; j += 8) mv = Max(mv, Ld(pg + j));
      float block_max = mv[0];
      for (int i = 1; i < 8; ++i) block_max = std::max(block_max, mv[i]);
      const float m_new = std::max(m[g], block_max);
      alpha[g] = std::exp(m[g] - m_new);  // 0 on the first block (m = kMinScore)
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n8; ++j) {
        pg[j] = std::exp(pg[j] - m_new);
        sum += pg[j];
      }
      l[g] = alpha[g] * l[g] + sum;
      m[g] = m_new;
    }
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) Accumulate<3>(p, 1, kKeyBlock, alpha, vrow, acc, n, D, g);
    if (G - g == 2) Accumulate<2>(p, 1, kKeyBlock, alpha, vrow, acc, n, D, g);
    if (G - g == 1) Accumulate<1>(p, 1, kKeyBlock, alpha, vrow, acc, n, D, g);
  }
}

// Keys per part when a decode row's keys are split over tasks (flash-decoding): at least this
// many, so the parts' merge stays small next to the reading.
constexpr int64_t kMinSplitKeys = 256;

// Decode for the whole batch: tasks are (row, KV head, part of the keys). Rows x heads fewer
// than 4 per thread split their keys into parts, each a DecodeRange of its own, merged after
// (`Merge(pair)` for each of `merges()` pairs, once every task is done). Quantized pages take
// their scales, `k_scales` and `v_scales`.
template <typename T>
class DecodeWork {
 public:
  DecodeWork(const Shape& s, const float* q, const T* k_pages, const T* v_pages,
             const int32_t* q_start, const int32_t* q_lens, const int32_t* page_indices,
             float* out, float sm_scale, float soft_cap, int32_t window, int64_t threads,
             const float* k_scales = nullptr, const float* v_scales = nullptr)
      : s_(s), q_(q), k_pages_(k_pages), v_pages_(v_pages), k_scales_(k_scales),
        v_scales_(v_scales), q_start_(q_start), q_lens_(q_lens),
        page_indices_(page_indices), out_(out), sm_scale_(sm_scale), soft_cap_(soft_cap),
        window_(window), pairs_(s.batch * s.kv_heads), stride_(s.groups * (s.head_dim + 2)) {
    int64_t longest = 0;
    for (int64_t b = 0; b < s.batch; ++b) {
      const auto [begin, end] = Range(b);
      longest = std::max(longest, end - begin);
    }
    const int64_t want = 4 * threads;
    splits_ = pairs_ >= want ? 1
                             : std::max<int64_t>(1, std::min((want + pairs_ - 1) / pairs_,
                                                             longest / kMinSplitKeys));
    parts_.resize(splits_ > 1 ? pairs_ * splits_ * stride_ : 0);
  }

  int64_t tasks() const { return pairs_ * splits_; }
  int64_t merges() const { return splits_ > 1 ? pairs_ : 0; }

  void Task(int64_t i) {
    const int64_t D = s_.head_dim, G = s_.groups, pair = i / splits_;
    const auto [b, k, begin, end] = Keys(i);
    alignas(64) float qs[kMaxGroups * kMaxHeadDim];
    const float* qb = q_ + pair * G * D;
    for (int64_t x = 0; x < G * D; ++x) qs[x] = qb[x] * sm_scale_;
    KeyBlockLines after;
    if (i + 1 < tasks()) {
      const auto [b1, k1, begin1, end1] = Keys(i + 1);
      after = KeyBlockAt(s_, k1, page_indices_ + b1 * s_.max_pages, begin1, end1, k_pages_, v_pages_);
    }
    alignas(64) float acc_local[kMaxGroups * kMaxHeadDim];
    float m_local[kMaxGroups], l_local[kMaxGroups];
    float *m = m_local, *l = l_local, *acc = acc_local;
    if (splits_ > 1) {
      m = parts_.data() + i * stride_;
      l = m + G;
      acc = l + G;
    }
    const int32_t* table = page_indices_ + b * s_.max_pages;
    if (D == 64) {
      DecodeRange<T, 64>(s_, k, table, begin, end, qs, k_pages_, v_pages_, soft_cap_, m, l, acc, after,
                         k_scales_, v_scales_);
    } else if (D == 128) {
      DecodeRange<T, 128>(s_, k, table, begin, end, qs, k_pages_, v_pages_, soft_cap_, m, l, acc, after,
                          k_scales_, v_scales_);
    } else {
      DecodeRange<T, 0>(s_, k, table, begin, end, qs, k_pages_, v_pages_, soft_cap_, m, l, acc, after,
                        k_scales_, v_scales_);
    }
    if (splits_ == 1) {
      float* ob = out_ + pair * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv;
      }
    }
  }

  // The parts of one (row, KV head) pair into its output.
  void Merge(int64_t pair) {
    const int64_t D = s_.head_dim, G = s_.groups;
    const float* first = parts_.data() + pair * splits_ * stride_;
    float* ob = out_ + pair * G * D;
    for (int64_t g = 0; g < G; ++g) {
      float m_max = kMinScore, l_sum = 0.0f;
      for (int64_t part = 0; part < splits_; ++part) {
        const float* pp = first + part * stride_;
        if (pp[G + g] > 0.0f) m_max = std::max(m_max, pp[g]);
      }
      float* og = ob + g * D;
      std::fill(og, og + D, 0.0f);
      for (int64_t part = 0; part < splits_; ++part) {
        const float* pp = first + part * stride_;
        if (pp[G + g] <= 0.0f) continue;
        const float w = std::exp(pp[g] - m_max);
        l_sum += w * pp[G + g];
        const float* ag = pp + 2 * G + g * D;
        for (int64_t d = 0; d < D; ++d) og[d] += w * ag[d];
      }
      const float inv = l_sum > 0.0f ? 1.0f / l_sum : 0.0f;
      for (int64_t d = 0; d < D; ++d) og[d] *= inv;
    }
  }

 private:
  // Key range of row b: never past the page table (see AttendOne); empty for padded rows.
  std::pair<int64_t, int64_t> Range(int64_t b) const {
    const int64_t pos = q_start_[b];
    const int64_t end = q_lens_[b] < 1 ? 0 : std::min<int64_t>(pos + 1, s_.max_pages * s_.page_size);
    const int64_t begin = window_ > 0 ? std::max<int64_t>(0, pos - window_ + 1) : 0;
    return std::make_pair(begin, std::max(begin, end));
  }

  // Task i's row, KV head and keys.
  std::tuple<int64_t, int64_t, int64_t, int64_t> Keys(int64_t i) const {
    const int64_t part = i % splits_, pair = i / splits_;
    auto [begin, end] = Range(pair / s_.kv_heads);
    const int64_t chunk =
        ((end - begin + splits_ - 1) / splits_ + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    begin = std::min(end, begin + part * chunk);
    return std::make_tuple(pair / s_.kv_heads, pair % s_.kv_heads, begin, std::min(end, begin + chunk));
  }

  Shape s_;
  const float* q_;
  const T *k_pages_, *v_pages_;
  const float *k_scales_, *v_scales_;  // quantized pages' scales; null for float pages
  const int32_t *q_start_, *q_lens_, *page_indices_;
  float* out_;
  float sm_scale_, soft_cap_;
  int32_t window_;
  int64_t pairs_, stride_, splits_ = 1;
  std::vector<float> parts_;  // [pair][part] x (m[G], l[G], acc[G][D]); unused with one part
};

}  // namespace jserve_native

#endif  // JSERVE_DECODE_ATTENTION_H_
