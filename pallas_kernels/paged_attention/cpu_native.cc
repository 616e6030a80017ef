// Native CPU paged attention (decode, chunked prefill), called from JAX as an XLA FFI custom call.
//
// Why: in Pallas interpret mode every op of the kernel becomes an XLA:CPU op; the page gathers,
// small batched dots and reductions ran at 5-10 GB/s and dominated the decode step at realistic
// contexts. This kernel reads each live K/V row once, straight from the pool, with an online
// softmax, and splits (row, KV head) pairs over XLA's intra-op thread pool: decode (Decode, rows
// with long contexts split further), prefill chunks in tiles (AttendTile), other head sizes one
// token at a time (AttendOne).
//
// Decode reads K/V from wherever the page table points, so it runs at the machine's bandwidth
// for scattered chunks of page_size * head_dim floats, not its streaming bandwidth: 16 rows x
// 365 cached tokens x 30 layers, pages scattered over a pool twice the size, ~10 GB/s with
// 4 KB pages (16 tokens), ~13 GB/s with 16 KB pages (64 tokens); a plain read of random 4 KB
// chunks reaches 9-13 GB/s on this machine, of 16 KB chunks 20 GB/s, of a contiguous buffer
// 18-23 GB/s. Hence the CPU engine's page size of 64 (kv_cache.default_page_size) and huge
// pages under the pool (jserve/huge_pages.py).
//
// Layouts (DESIGN §4; the same contract as the Pallas kernels):
//   q        f32 [batch, num_kv_heads, tokens * groups, head_dim]   queries packed per KV head:
//            row r is token r / groups of the row's chunk, query head k * groups + r % groups
//   k_pages  f32|bf16 [num_kv_heads, num_pages, page_size, head_dim]
//   v_pages  same as k_pages
//   q_start  s32 [batch]   position of the row's first new token (= keys cached before it)
//   q_lens   s32 [batch]   real new tokens of the row; tokens past it (and padded rows) output 0
//   page_indices s32 [batch, max_pages]
//   out      f32, q's shape
// Attributes: groups, sm_scale, soft_cap (0 = off), sliding_window (0 = off).
//
// Semantics match pallas_kernels.paged_attention.reference: token t of row b sits at position
// p = q_start[b] + t and attends keys max(0, p - window + 1) .. p (the chunk's own K/V are already
// in the pages); logits q.k * sm_scale, then soft_cap * tanh(logits / soft_cap).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"

namespace ffi = xla::ffi;

namespace {

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

template <typename T>
inline float Load(const T* p, int i);
template <>
inline float Load<float>(const float* p, int i) { return p[i]; }
template <>
inline float Load<uint16_t>(const uint16_t* p, int i) { return Bf16ToF32(p[i]); }

struct Shape {
  int64_t batch, kv_heads, tokens, groups, head_dim, num_pages, page_size, max_pages;
};

constexpr int64_t kTokensPerTask = 32;  // a prefill row's chunk is split into tasks this long

// One (row, KV head, token): the token's `groups` queries against its keys, page by page, for
// head sizes that are not a multiple of 8 (Decode and AttendTile take the others).
template <typename T>
void AttendOne(const Shape& s, int64_t b, int64_t k, int64_t token, const float* q,
               const T* k_pages, const T* v_pages, const int32_t* q_start, const int32_t* q_lens,
               const int32_t* page_indices, float* out, float sm_scale, float soft_cap,
               int32_t window) {
  const int64_t D = s.head_dim, G = s.groups, P = s.page_size;
  const int64_t first_row = ((b * s.kv_heads + k) * s.tokens + token) * G;
  const float* qb = q + first_row * D;
  float* ob = out + first_row * D;
  if (token >= q_lens[b]) {
    std::fill(ob, ob + G * D, 0.0f);
    return;
  }
  const int64_t pos = q_start[b] + token;
  // Never read past the page table or the pool, whatever the inputs say (the Pallas kernels
  // clamp the same way): keys beyond the table are not attended, a bad page id reads page 0.
  const int64_t end = std::min<int64_t>(pos + 1, s.max_pages * s.page_size);
  const int64_t begin = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  float m[kMaxGroups], l[kMaxGroups];
  alignas(64) float acc[kMaxGroups * kMaxHeadDim];
  alignas(64) float qs[kMaxGroups * kMaxHeadDim];
  for (int64_t g = 0; g < G; ++g) {
    m[g] = kMinScore;
    l[g] = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      acc[g * D + d] = 0.0f;
      qs[g * D + d] = qb[g * D + d] * sm_scale;
    }
  }
  const int32_t* table = page_indices + b * s.max_pages;
  const T* k_head = k_pages + k * s.num_pages * P * D;
  const T* v_head = v_pages + k * s.num_pages * P * D;
  alignas(64) float scores[kMaxGroups][64];
  for (int64_t t0 = begin; t0 < end;) {
    int64_t page = table[t0 / P];
    if (page < 0 || page >= s.num_pages) page = 0;
    const int64_t off = t0 % P;
    const int64_t n = std::min<int64_t>({P - off, end - t0, 64});
    const T* kp = k_head + (page * P + off) * D;
    const T* vp = v_head + (page * P + off) * D;
    if (t0 + n < end) {
      // The next block's rows live on another page, somewhere else in the pool: start fetching
      // them now, the hardware prefetcher only follows this page.
      const int64_t t1 = t0 + n;
      int64_t next = table[t1 / P];
      if (next < 0 || next >= s.num_pages) next = 0;
      const int64_t bytes = std::min<int64_t>({P - t1 % P, end - t1, 64}) * D * sizeof(T);
      const char* nk = reinterpret_cast<const char*>(k_head + (next * P + t1 % P) * D);
      const char* nv = reinterpret_cast<const char*>(v_head + (next * P + t1 % P) * D);
      for (int64_t i = 0; i < bytes; i += 64) {
        __builtin_prefetch(nk + i);
        __builtin_prefetch(nv + i);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qs + g * D;
      float block_max = kMinScore;
      for (int64_t t = 0; t < n; ++t) {
        const T* kt = kp + t * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * Load(kt, static_cast<int>(d));
        if (soft_cap > 0.0f) dot = soft_cap * std::tanh(dot / soft_cap);
        scores[g][t] = dot;
        block_max = std::max(block_max, dot);
      }
      const float m_new = std::max(m[g], block_max);
      const float alpha = std::exp(m[g] - m_new);  // 0 on the first block (m = kMinScore)
      float* pg = scores[g];
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        pg[t] = std::exp(pg[t] - m_new);
        sum += pg[t];
      }
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
      for (int64_t t = 0; t < n; ++t) {
        const float p = pg[t];
        const T* vt = vp + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * Load(vt, static_cast<int>(d));
      }
      l[g] = alpha * l[g] + sum;
      m[g] = m_new;
    }
    t0 += n;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
    for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv;
  }
}

// ---------------------------------------------------------------------------------------------
// Tiled prefill: a tile of a row's query tokens (all `groups` heads of one KV head, up to
// kTileRows query rows) against blocks of kKeyBlock keys, flash-attention style, so a long
// chunk costs one pass over its keys per tile, not per token. The tile's queries are held
// transposed (Qt [head_dim][rows]), so the scores come out as St [keys][rows] from K rows read
// straight from the pages (f32; bf16 pages are widened per block), with no transposition of K,
// and the softmax runs down St's columns with whole-vector max/exp/sum. Needs head_dim % 8 == 0;
// other sizes take AttendOne per token.

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
constexpr int64_t kTileRows = 64;  // query rows per tile (a multiple of 32)

// St[j][rows] = sum_d krow[j][d] * Qt[d][rows] for NK keys, NV * 8 rows from r0.
template <int NK, int NV>
inline void Scores(const float* const* krow, const float* qt, float* st, int64_t D, int64_t r0) {
  v8 a[NK][NV] = {};
  for (int64_t d = 0; d < D; ++d) {
    const float* q = qt + d * kTileRows + r0;
    for (int j = 0; j < NK; ++j) {
      const v8 k = Splat(krow[j][d]);
      for (int v = 0; v < NV; ++v) a[j][v] += k * Ld(q + 8 * v);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NV; ++v) St(st + j * kTileRows + r0 + 8 * v, a[j][v]);
}

template <int NK>
inline void ScoresRows(const float* const* krow, const float* qt, float* st, int64_t D,
                       int64_t rows8) {
  int64_t r0 = 0;
  for (; r0 + 32 <= rows8; r0 += 32) Scores<NK, 4>(krow, qt, st, D, r0);
  switch ((rows8 - r0) / 8) {
    case 3: Scores<NK, 3>(krow, qt, st, D, r0); break;
    case 2: Scores<NK, 2>(krow, qt, st, D, r0); break;
    case 1: Scores<NK, 1>(krow, qt, st, D, r0); break;
    default: break;
  }
}

// acc[r] = acc[r] * alpha[r] + sum_j P(j, r) * vrow[j] for NR rows from r, 32 dims at a time;
// P(j, r) = pt[j * js + r * rs] (tiles hold St [keys][rows], decode P [rows][keys]).
template <int NR>
inline void Accumulate(const float* pt, int64_t js, int64_t rs, const float* alpha,
                       const float* const* vrow, float* acc, int64_t n, int64_t D, int64_t r) {
  int64_t dc = 0;
  for (; dc + 32 <= D; dc += 32) {
    v8 a[NR][4];
    for (int i = 0; i < NR; ++i) {
      const v8 s = Splat(alpha[r + i]);
      for (int v = 0; v < 4; ++v) a[i][v] = Ld(acc + (r + i) * D + dc + 8 * v) * s;
    }
    for (int64_t j = 0; j < n; ++j) {
      // NR broadcasts, then each V vector loaded once for all NR rows: 12 accumulators + 3
      // broadcasts + 1 V vector = the 16 ymm registers at NR = 3. Row by row, GCC kept 4 V
      // vectors live and spilled an accumulator, a store-to-load chain through every key: one
      // thread's decode over L2-resident K/V took 4020 cycles per 64-key block that way, 3580
      // now (*measured*, a /tmp harness; from DRAM both run at the memory's pace).
      const float* vj = vrow[j] + dc;
      v8 p[NR];
      for (int i = 0; i < NR; ++i) p[i] = Splat(pt[j * js + (r + i) * rs]);
      for (int v = 0; v < 4; ++v) {
        const v8 x = Ld(vj + 8 * v);
        for (int i = 0; i < NR; ++i) a[i][v] += p[i] * x;
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int v = 0; v < 4; ++v) St(acc + (r + i) * D + dc + 8 * v, a[i][v]);
  }
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
// shift: vpmovzxwd + vpslld with AVX2). GCC left the element-by-element loop scalar: one thread's
// decode over bfloat16 K/V took 13040 cycles per 64-key block from L2 and 18280 from DRAM that
// way, 6190 and 7810 now (float32 pages: 3580 and ~9700; *measured*, a /tmp harness).
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

// Pointers to the K and V rows of keys j0 .. j0 + n - 1 (n <= kKeyBlock) of one KV head: into
// the pages for f32, widened into `wide` (2 * kKeyBlock rows of D) for bf16. A page id outside
// the pool reads page 0.
template <typename T>
inline void GatherRows(const T* k_head, const T* v_head, const int32_t* table, int64_t num_pages,
                       int64_t P, int64_t D, int64_t j0, int64_t n, float* wide,
                       const float** krow, const float** vrow) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t key = j0 + j;
    int64_t page = table[key / P];
    if (page < 0 || page >= num_pages) page = 0;
    const T* kp = k_head + (page * P + key % P) * D;
    const T* vp = v_head + (page * P + key % P) * D;
    if constexpr (std::is_same<T, float>::value) {
      krow[j] = kp;
      vrow[j] = vp;
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

// Tokens t0..t1-1 of row b, KV head k.
template <typename T>
void AttendTile(const Shape& s, int64_t b, int64_t k, int64_t t0, int64_t t1, const float* q,
                const T* k_pages, const T* v_pages, const int32_t* q_start, const int32_t* q_lens,
                const int32_t* page_indices, float* out, float sm_scale, float soft_cap,
                int32_t window) {
  const int64_t D = s.head_dim, G = s.groups, P = s.page_size;
  const int64_t first_row = ((b * s.kv_heads + k) * s.tokens + t0) * G;
  const float* qb = q + first_row * D;
  float* ob = out + first_row * D;
  const int64_t real_end = std::max(t0, std::min<int64_t>(t1, q_lens[b]));
  std::fill(ob + (real_end - t0) * G * D, ob + (t1 - t0) * G * D, 0.0f);  // padded tokens
  const int64_t R = (real_end - t0) * G;
  if (R == 0) return;
  const int64_t rows8 = (R + 7) / 8 * 8;
  const int64_t first_pos = q_start[b] + t0, last_pos = q_start[b] + real_end - 1;
  // Never read past the page table or the pool (see AttendOne).
  const int64_t end = std::min<int64_t>(last_pos + 1, s.max_pages * P);
  const int64_t begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;

  // Per-thread scratch: Qt [D][kTileRows], acc [R][D], St [kKeyBlock][kTileRows], the running
  // max / sum / rescale per row, and widened K/V rows for bf16 pages.
  thread_local std::vector<float> buf;
  const int64_t widen = std::is_same<T, float>::value ? 0 : 2 * kKeyBlock * D;
  buf.resize(D * kTileRows + R * D + kKeyBlock * kTileRows + 3 * kTileRows + widen);
  float* qt = buf.data();
  float* acc = qt + D * kTileRows;
  float* st = acc + R * D;
  float* m = st + kKeyBlock * kTileRows;
  float* l = m + kTileRows;
  float* alpha = l + kTileRows;
  float* wide = alpha + kTileRows;
  for (int64_t d = 0; d < D; ++d) {
    for (int64_t r = 0; r < rows8; ++r) qt[d * kTileRows + r] = r < R ? qb[r * D + d] * sm_scale : 0.0f;
  }
  std::fill(acc, acc + R * D, 0.0f);
  std::fill(m, m + kTileRows, kMinScore);
  std::fill(l, l + kTileRows, 0.0f);

  const int32_t* table = page_indices + b * s.max_pages;
  const T* k_head = k_pages + k * s.num_pages * P * D;
  const T* v_head = v_pages + k * s.num_pages * P * D;
  const float* krow[kKeyBlock];
  const float* vrow[kKeyBlock];
  for (int64_t j0 = begin; j0 < end; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - j0);
    GatherRows(k_head, v_head, table, s.num_pages, P, D, j0, n, wide, krow, vrow);
    int64_t jp = 0;
    for (; jp + 3 <= n; jp += 3) ScoresRows<3>(krow + jp, qt, st + jp * kTileRows, D, rows8);
    if (n - jp == 2) ScoresRows<2>(krow + jp, qt, st + jp * kTileRows, D, rows8);
    if (n - jp == 1) ScoresRows<1>(krow + jp, qt, st + jp * kTileRows, D, rows8);

    // Masks, by key: rows whose token precedes the key (causal), and rows whose window has
    // moved past it; row r is token r / G, at position first_pos + r / G.
    for (int64_t j = 0; j < n; ++j) {
      float* sj = st + j * kTileRows;
      if (soft_cap > 0.0f) {
        for (int64_t r = 0; r < rows8; ++r) sj[r] = soft_cap * std::tanh(sj[r] / soft_cap);
      }
      const int64_t key = j0 + j;
      const int64_t causal = std::clamp<int64_t>((key - first_pos) * G, 0, rows8);
      std::fill(sj, sj + causal, kMinScore);
      if (window > 0) {
        const int64_t out_of_window = std::clamp<int64_t>((key + window - first_pos) * G, 0, rows8);
        std::fill(sj + out_of_window, sj + rows8, kMinScore);
      }
    }
    // Online softmax down the columns, 8 rows at a time.
    for (int64_t r = 0; r < rows8; r += 8) {
      v8 block_max = Splat(kMinScore);
      for (int64_t j = 0; j < n; ++j) block_max = Max(block_max, Ld(st + j * kTileRows + r));
      const v8 m_old = Ld(m + r), m_new = Max(m_old, block_max);
      v8 sum = Splat(0.0f);
      for (int64_t j = 0; j < n; ++j) {
        float* p = st + j * kTileRows + r;
        alignas(32) float e[8];
        St(e, Ld(p) - m_new);
        for (int i = 0; i < 8; ++i) e[i] = std::exp(e[i]);
        const v8 pe = Ld(e);
        St(p, pe);
        sum += pe;
      }
      alignas(32) float a[8];
      St(a, m_old - m_new);
      for (int i = 0; i < 8; ++i) a[i] = std::exp(a[i]);  // 0 once a real key follows masked ones
      const v8 av = Ld(a);
      St(alpha + r, av);
      St(l + r, av * Ld(l + r) + sum);
      St(m + r, m_new);
    }
    int64_t rp = 0;
    for (; rp + 3 <= R; rp += 3) Accumulate<3>(st, kTileRows, 1, alpha, vrow, acc, n, D, rp);
    if (R - rp == 2) Accumulate<2>(st, kTileRows, 1, alpha, vrow, acc, n, D, rp);
    if (R - rp == 1) Accumulate<1>(st, kTileRows, 1, alpha, vrow, acc, n, D, rp);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) ob[r * D + d] = acc[r * D + d] * inv;
  }
}

using jserve_native::ParallelFor;  // parallel_for.h

// ---------------------------------------------------------------------------------------------
// Decode: one token's `groups` queries (one KV head) against blocks of up to kKeyBlock keys
// gathered across pages. Scores come 4 keys x up to 3 query heads at a time (Dots4), from
// independent dot products summed by a transposition (no horizontal sum per key); the softmax
// runs over the block in 8-wide vectors; V accumulates for 3 queries x 32 dims in registers
// (Accumulate). Each K and V row comes from memory once per token and from L1 once per 3 query
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
// keys at a time, with K reloaded per head, took ~10 % longer: one thread's decode over
// L2-resident K/V, 3540-4200 -> 3220-3260 cycles per 64-key block in two interleaved runs (a
// /tmp harness); 30 layers of SmolLM2 decode attention at 16 rows on both threads, 384 / 1024
// cached tokens: 17.1 -> 16.6 ms contiguous, 19.5 -> 19.2 and 52.3 -> 50.9 ms scattered (*measured*).
template <int NG, int HD>
inline void Dots4(const float* const* krow, const float* q, int64_t head_dim, float* p, int64_t j) {
  const int64_t D = HD > 0 ? HD : head_dim;
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
// in equal shares over the steps of this block's scores. On a 2-core Zen 3 no prefetch variant
// changed decode attention beyond the noise (one thread, docs/performance.md: the next block at
// once into L1 or L2, two blocks ahead, spread over the scores); on a 2-core Xeon (AVX-512, ~100
// ns to memory) the SmolLM2 decode step at 16 rows x 384 cached tokens went from 62.3 to
// 58.7-59.3 ms with the next block of the same task (into L2 / L1; --breakdown: attention 18.6 ->
// 16.5 / 16.9 ms), interleaved. With the pages scattered over the pool, as the engine leaves
// them (bench_page_layout.py, interleaved, 15-21 rounds, ms): no prefetch 70.4 / 107.5 at 384 /
// 1024 cached, the next block 64.3 / 91.2 and 60.4 / 90.5, also the next task's first block
// 62.0 / 88.7 and 59.7 / 87.9 (two blocks ahead as well: 59.3 / 87.3, not kept); 4 rows x 384
// 32.7 -> 32.3. On contiguous pages the next task's block made no difference.
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
// block to prefetch during the last one.
template <typename T, int HD>
void DecodeRange(const Shape& s, int64_t k, const int32_t* table, int64_t begin, int64_t end,
                 const float* qs, const T* k_pages, const T* v_pages, float soft_cap, float* m,
                 float* l, float* acc, KeyBlockLines after) {
  const int64_t D = s.head_dim, G = s.groups, P = s.page_size;
  const T* k_head = k_pages + k * s.num_pages * P * D;
  const T* v_head = v_pages + k * s.num_pages * P * D;
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
    GatherRows(k_head, v_head, table, s.num_pages, P, D, j0, n, wide.data(), krow, vrow);
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
// than 4 per thread split their keys into parts, each a DecodeRange of its own, merged after.
template <typename T>
void Decode(ffi::ThreadPool& pool, const Shape& s, const float* q, const T* k_pages,
            const T* v_pages, const int32_t* q_start, const int32_t* q_lens,
            const int32_t* page_indices, float* out, float sm_scale, float soft_cap,
            int32_t window) {
  const int64_t D = s.head_dim, G = s.groups, pairs = s.batch * s.kv_heads;
  // Key range of row b: never past the page table (see AttendOne); empty for padded rows.
  auto range = [&s, q_start, q_lens, window](int64_t b) {
    const int64_t pos = q_start[b];
    const int64_t end = q_lens[b] < 1 ? 0 : std::min<int64_t>(pos + 1, s.max_pages * s.page_size);
    const int64_t begin = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    return std::make_pair(begin, std::max(begin, end));
  };
  int64_t longest = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    const auto [begin, end] = range(b);
    longest = std::max(longest, end - begin);
  }
  const int64_t want = 4 * static_cast<int64_t>(pool.num_threads());
  const int64_t splits =
      pairs >= want ? 1 : std::max<int64_t>(1, std::min((want + pairs - 1) / pairs, longest / kMinSplitKeys));
  // Part results, [pair][part] x (m[G], l[G], acc[G][D]); unused with one part.
  const int64_t stride = G * (D + 2);
  std::vector<float> parts(splits > 1 ? pairs * splits * stride : 0);
  // Task i's row, KV head and keys.
  auto keys = [&](int64_t i) {
    const int64_t part = i % splits, pair = i / splits;
    auto [begin, end] = range(pair / s.kv_heads);
    const int64_t chunk = ((end - begin + splits - 1) / splits + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
    begin = std::min(end, begin + part * chunk);
    return std::make_tuple(pair / s.kv_heads, pair % s.kv_heads, begin, std::min(end, begin + chunk));
  };
  const int64_t tasks = pairs * splits;
  auto task = [&](int64_t i) {
    const int64_t pair = i / splits;
    const auto [b, k, begin, end] = keys(i);
    alignas(64) float qs[kMaxGroups * kMaxHeadDim];
    const float* qb = q + pair * G * D;
    for (int64_t x = 0; x < G * D; ++x) qs[x] = qb[x] * sm_scale;
    KeyBlockLines after;
    if (i + 1 < tasks) {
      const auto [b1, k1, begin1, end1] = keys(i + 1);
      after = KeyBlockAt(s, k1, page_indices + b1 * s.max_pages, begin1, end1, k_pages, v_pages);
    }
    alignas(64) float acc_local[kMaxGroups * kMaxHeadDim];
    float m_local[kMaxGroups], l_local[kMaxGroups];
    float *m = m_local, *l = l_local, *acc = acc_local;
    if (splits > 1) {
      m = parts.data() + i * stride;
      l = m + G;
      acc = l + G;
    }
    const int32_t* table = page_indices + b * s.max_pages;
    if (D == 64) {
      DecodeRange<T, 64>(s, k, table, begin, end, qs, k_pages, v_pages, soft_cap, m, l, acc, after);
    } else if (D == 128) {
      DecodeRange<T, 128>(s, k, table, begin, end, qs, k_pages, v_pages, soft_cap, m, l, acc, after);
    } else {
      DecodeRange<T, 0>(s, k, table, begin, end, qs, k_pages, v_pages, soft_cap, m, l, acc, after);
    }
    if (splits == 1) {
      float* ob = out + pair * G * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv;
      }
    }
  };
  ParallelFor(pool, tasks, task);
  if (splits == 1) return;
  for (int64_t pair = 0; pair < pairs; ++pair) {  // merge the parts
    const float* first = parts.data() + pair * splits * stride;
    float* ob = out + pair * G * D;
    for (int64_t g = 0; g < G; ++g) {
      float m_max = kMinScore, l_sum = 0.0f;
      for (int64_t part = 0; part < splits; ++part) {
        const float* pp = first + part * stride;
        if (pp[G + g] > 0.0f) m_max = std::max(m_max, pp[g]);
      }
      float* og = ob + g * D;
      std::fill(og, og + D, 0.0f);
      for (int64_t part = 0; part < splits; ++part) {
        const float* pp = first + part * stride;
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
}

template <typename T>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
               ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_lens,
               ffi::Buffer<ffi::S32> page_indices, ffi::Result<ffi::Buffer<ffi::F32>> out,
               int32_t groups, float sm_scale, float soft_cap, int32_t window) {
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || page_indices.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument("paged attention: q and pages must be 4-D, page_indices 2-D");
  }
  if (groups < 1 || qd[2] % groups) {
    return ffi::Error::InvalidArgument("paged attention: q rows must be tokens * groups");
  }
  Shape s{qd[0], qd[1], qd[2] / groups, groups, qd[3], kd[1], kd[2], page_indices.dimensions()[1]};
  if (kd[0] != s.kv_heads || kd[3] != s.head_dim || s.groups > kMaxGroups ||
      s.head_dim > kMaxHeadDim) {
    return ffi::Error::InvalidArgument("paged attention: unsupported shapes");
  }
  const float* qp = q.typed_data();
  const T* kp = reinterpret_cast<const T*>(k_pages.untyped_data());
  const T* vp = reinterpret_cast<const T*>(v_pages.untyped_data());
  const int32_t* qs = q_start.typed_data();
  const int32_t* ql = q_lens.typed_data();
  const int32_t* pi = page_indices.typed_data();
  float* op = out->typed_data();
  if (s.tokens > 1 && s.head_dim % 8 == 0) {
    // Prefill: tasks are (row, KV head, tile of tile_tokens tokens).
    const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / s.groups);
    const int64_t tiles = (s.tokens + tile_tokens - 1) / tile_tokens;
    auto tile_task = [=](int64_t i) {
      const int64_t tile = i % tiles, bk = i / tiles;
      const int64_t t0 = tile * tile_tokens, t1 = std::min(s.tokens, t0 + tile_tokens);
      AttendTile<T>(s, bk / s.kv_heads, bk % s.kv_heads, t0, t1, qp, kp, vp, qs, ql, pi, op,
                    sm_scale, soft_cap, window);
    };
    ParallelFor(pool, s.batch * s.kv_heads * tiles, tile_task);
    return ffi::Error::Success();
  }
  if (s.tokens == 1 && s.head_dim % 8 == 0) {
    Decode<T>(pool, s, qp, kp, vp, qs, ql, pi, op, sm_scale, soft_cap, window);
    return ffi::Error::Success();
  }
  // Head sizes the tiles do not take: tasks are (row, KV head, run of
  // kTokensPerTask tokens), each token walking its keys alone.
  const int64_t runs = (s.tokens + kTokensPerTask - 1) / kTokensPerTask;
  auto task = [=](int64_t i) {
    const int64_t run = i % runs, bk = i / runs;
    const int64_t b = bk / s.kv_heads, k = bk % s.kv_heads;
    const int64_t stop = std::min(s.tokens, (run + 1) * kTokensPerTask);
    for (int64_t t = run * kTokensPerTask; t < stop; ++t) {
      AttendOne<T>(s, b, k, t, qp, kp, vp, qs, ql, pi, op, sm_scale, soft_cap, window);
    }
  };
  ParallelFor(pool, s.batch * s.kv_heads * runs, task);
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> q_start,
                          ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> page_indices,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t groups, float sm_scale,
                          float soft_cap, int32_t sliding_window) {
  if (k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("paged attention: k_pages and v_pages dtypes differ");
  }
  switch (k_pages.element_type()) {
    case ffi::F32:
      return Run<float>(pool, q, k_pages, v_pages, q_start, q_lens, page_indices, out, groups,
                        sm_scale, soft_cap, sliding_window);
    case ffi::BF16:
      return Run<uint16_t>(pool, q, k_pages, v_pages, q_start, q_lens, page_indices, out, groups,
                           sm_scale, soft_cap, sliding_window);
    default:
      return ffi::Error::InvalidArgument("paged attention: pages must be float32 or bfloat16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int32_t>("groups")
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window"));
