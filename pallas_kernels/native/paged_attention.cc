// Native CPU paged attention (decode, chunked prefill), called from JAX as an XLA FFI custom call.
//
// Why: in Pallas interpret mode every op of the kernel becomes an XLA:CPU op; the page gathers,
// small batched dots and reductions ran far below memory bandwidth and dominated the decode
// step at realistic contexts. This kernel reads each live K/V row once, straight from the pool,
// with an online softmax, and splits (row, KV head) pairs over XLA's intra-op thread pool: decode
// (DecodeWork in decode_attention.h, rows with long contexts split further), prefill chunks in
// tiles (AttendTile), other head sizes one token at a time (AttendOne).
//
// Decode reads K/V from wherever the page table points, so it runs at the machine's bandwidth
// for scattered chunks of page_size * head_dim floats, not its streaming bandwidth, and scattered
// chunks read faster the larger they are (docs/performance.md). Hence the CPU engine's page size
// of 64 (NativeCpuBackend.default_page_size, jserve/runtime/backends/native_cpu.py) and huge
// pages under the pool (jserve/runtime/huge_pages.py).
//
// Layouts (the same contract as the Pallas kernels, pallas_kernels/paged_attention/ops.py; padded
// page-table slots point to page 0, the null page):
//   q        f32 [batch, num_kv_heads, tokens * groups, head_dim]   queries packed per KV head:
//            row r is token r / groups of the row's chunk, query head k * groups + r % groups
//   k_pages  f32|bf16 [num_kv_heads, num_pages, page_size, head_dim], or quantized codes:
//            s8 or f8e4m3fn, a row being its codes times the token's scale
//   v_pages  same as k_pages
//   k_scales, v_scales  f32 [num_kv_heads, num_pages, page_size] for quantized pages; empty
//            (0 elements) for float ones
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
#include "decode_attention.h"

namespace ffi = xla::ffi;

namespace {

using namespace jserve_native;  // decode_attention.h, parallel_for.h

constexpr int64_t kTokensPerTask = 32;  // a prefill row's chunk is split into tasks this long

// One (row, KV head, token): the token's `groups` queries against its keys, page by page, for
// head sizes that are not a multiple of 8 (DecodeWork and AttendTile take the others).
template <typename T>
void AttendOne(const Shape& s, int64_t b, int64_t k, int64_t token, const float* q,
               const T* k_pages, const T* v_pages, const int32_t* q_start, const int32_t* q_lens,
               const int32_t* page_indices, float* out, float sm_scale, float soft_cap,
               int32_t window, const float* k_scales, const float* v_scales) {
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
  const float* ks_head = kQuantized<T> ? k_scales + k * s.num_pages * P : nullptr;
  const float* vs_head = kQuantized<T> ? v_scales + k * s.num_pages * P : nullptr;
  alignas(64) float scores[kMaxGroups][64];
  for (int64_t t0 = begin; t0 < end;) {
    int64_t page = table[t0 / P];
    if (page < 0 || page >= s.num_pages) page = 0;
    const int64_t off = t0 % P;
    const int64_t n = std::min<int64_t>({P - off, end - t0, 64});
    const T* kp = k_head + (page * P + off) * D;
    const T* vp = v_head + (page * P + off) * D;
    // Quantized pages: the block's scales (a token's dot product and probability take them).
    const float* ksp = kQuantized<T> ? ks_head + page * P + off : nullptr;
    const float* vsp = kQuantized<T> ? vs_head + page * P + off : nullptr;
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
        if constexpr (kQuantized<T>) dot *= ksp[t];
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
        const float p = kQuantized<T> ? pg[t] * vsp[t] : pg[t];
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


// Tokens t0..t1-1 of row b, KV head k.
template <typename T>
void AttendTile(const Shape& s, int64_t b, int64_t k, int64_t t0, int64_t t1, const float* q,
                const T* k_pages, const T* v_pages, const int32_t* q_start, const int32_t* q_lens,
                const int32_t* page_indices, float* out, float sm_scale, float soft_cap,
                int32_t window, const float* k_scales, const float* v_scales, bool aligned) {
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
  int64_t begin = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  // Batch-invariant: key blocks at multiples of kKeyBlock, whatever the tile's first token, so
  // that a token's online softmax rescales at the same keys in any tile (the masks drop the
  // keys before its window).
  if (aligned) begin = begin / kKeyBlock * kKeyBlock;

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
  const float* ks_head = kQuantized<T> ? k_scales + k * s.num_pages * P : nullptr;
  const float* vs_head = kQuantized<T> ? v_scales + k * s.num_pages * P : nullptr;
  const float* krow[kKeyBlock];
  const float* vrow[kKeyBlock];
  for (int64_t j0 = begin; j0 < end; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, end - j0);
    GatherRows(k_head, v_head, table, s.num_pages, P, D, j0, n, wide, krow, vrow, ks_head, vs_head);
    // Batch-invariant: one key and 8 rows at a time, whatever the tile's size. -ffast-math lets
    // GCC schedule each Scores<NK, NV> instance's sums its own way (seen on AMD EPYC VMs:
    // a token's scores an ulp apart alone and in a chunk).
    if (aligned) {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t r0 = 0; r0 < rows8; r0 += 8) Scores<1, 1>(krow + j, qt, st + j * kTileRows, D, r0);
      }
    } else {
      int64_t jp = 0;
      for (; jp + 3 <= n; jp += 3) ScoresRows<3>(krow + jp, qt, st + jp * kTileRows, D, rows8);
      if (n - jp == 2) ScoresRows<2>(krow + jp, qt, st + jp * kTileRows, D, rows8);
      if (n - jp == 1) ScoresRows<1>(krow + jp, qt, st + jp * kTileRows, D, rows8);
    }

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
    int64_t rp = 0;  // batch-invariant: row by row (as the scores)
    for (; !aligned && rp + 3 <= R; rp += 3) Accumulate<3>(st, kTileRows, 1, alpha, vrow, acc, n, D, rp);
    if (!aligned && R - rp == 2) {
      Accumulate<2>(st, kTileRows, 1, alpha, vrow, acc, n, D, rp);
      rp += 2;
    }
    for (; rp < R; ++rp) Accumulate<1>(st, kTileRows, 1, alpha, vrow, acc, n, D, rp);
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) ob[r * D + d] = acc[r * D + d] * inv;
  }
}


template <typename T>
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
               ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales,
               ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_lens,
               ffi::Buffer<ffi::S32> page_indices, ffi::Result<ffi::Buffer<ffi::F32>> out,
               int32_t groups, float sm_scale, float soft_cap, int32_t window, bool invariant) {
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
  const float* ksc = nullptr;
  const float* vsc = nullptr;
  if constexpr (kQuantized<T>) {
    const int64_t want = s.kv_heads * s.num_pages * s.page_size;
    auto sd = k_scales.dimensions();
    if (sd.size() != 3 || sd[0] != s.kv_heads || sd[1] != s.num_pages || sd[2] != s.page_size ||
        static_cast<int64_t>(v_scales.element_count()) != want) {
      return ffi::Error::InvalidArgument("paged attention: scales must be [kv_heads, num_pages, page_size]");
    }
    ksc = k_scales.typed_data();
    vsc = v_scales.typed_data();
  } else if (k_scales.element_count() != 0 || v_scales.element_count() != 0) {
    return ffi::Error::InvalidArgument("paged attention: float pages take no scales");
  }
  const float* qp = q.typed_data();
  const T* kp = reinterpret_cast<const T*>(k_pages.untyped_data());
  const T* vp = reinterpret_cast<const T*>(v_pages.untyped_data());
  const int32_t* qs = q_start.typed_data();
  const int32_t* ql = q_lens.typed_data();
  const int32_t* pi = page_indices.typed_data();
  float* op = out->typed_data();
  // Batch-invariant (`invariant`): every token through the same code, whatever the call's rows
  // and tokens: the tiles (aligned key blocks) for decode too, never a decode row's keys split
  // into parts; AttendOne (per token) for head sizes the tiles do not take.
  if ((s.tokens > 1 || invariant) && s.head_dim % 8 == 0) {
    // Prefill: tasks are (row, KV head, tile of tile_tokens tokens).
    const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / s.groups);
    const int64_t tiles = (s.tokens + tile_tokens - 1) / tile_tokens;
    auto tile_task = [=](int64_t i) {
      const int64_t tile = i % tiles, bk = i / tiles;
      const int64_t t0 = tile * tile_tokens, t1 = std::min(s.tokens, t0 + tile_tokens);
      AttendTile<T>(s, bk / s.kv_heads, bk % s.kv_heads, t0, t1, qp, kp, vp, qs, ql, pi, op,
                    sm_scale, soft_cap, window, ksc, vsc, invariant);
    };
    ParallelFor(pool, s.batch * s.kv_heads * tiles, tile_task);
    return ffi::Error::Success();
  }
  if (s.tokens == 1 && s.head_dim % 8 == 0 && !invariant) {
    DecodeWork<T> work(s, qp, kp, vp, qs, ql, pi, op, sm_scale, soft_cap, window, pool.num_threads(),
                       ksc, vsc);
    ParallelFor(pool, work.tasks(), [&work](int64_t i) { work.Task(i); });
    for (int64_t pair = 0; pair < work.merges(); ++pair) work.Merge(pair);
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
      AttendOne<T>(s, b, k, t, qp, kp, vp, qs, ql, pi, op, sm_scale, soft_cap, window, ksc, vsc);
    }
  };
  ParallelFor(pool, s.batch * s.kv_heads * runs, task);
  return ffi::Error::Success();
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::F32> k_scales,
                          ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> q_start,
                          ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> page_indices,
                          ffi::Result<ffi::Buffer<ffi::F32>> out, int32_t groups, float sm_scale,
                          float soft_cap, int32_t sliding_window, int32_t batch_invariant) {
  if (k_pages.element_type() != v_pages.element_type()) {
    return ffi::Error::InvalidArgument("paged attention: k_pages and v_pages dtypes differ");
  }
  switch (k_pages.element_type()) {
    case ffi::F32:
      return Run<float>(pool, q, k_pages, v_pages, k_scales, v_scales, q_start, q_lens, page_indices,
                        out, groups, sm_scale, soft_cap, sliding_window,
                        batch_invariant != 0);
    case ffi::BF16:
      return Run<uint16_t>(pool, q, k_pages, v_pages, k_scales, v_scales, q_start, q_lens,
                           page_indices, out, groups, sm_scale, soft_cap, sliding_window,
                        batch_invariant != 0);
#if JSERVE_NATIVE_QUANT
    case ffi::S8:
      return Run<int8_t>(pool, q, k_pages, v_pages, k_scales, v_scales, q_start, q_lens,
                         page_indices, out, groups, sm_scale, soft_cap, sliding_window,
                        batch_invariant != 0);
    case ffi::F8E4M3FN:
      return Run<Fp8>(pool, q, k_pages, v_pages, k_scales, v_scales, q_start, q_lens, page_indices,
                      out, groups, sm_scale, soft_cap, sliding_window,
                        batch_invariant != 0);
#else
    case ffi::S8:
    case ffi::F8E4M3FN:
      return ffi::Error::InvalidArgument(
          "paged attention: quantized pages, and this build has the float kernels only "
          "(JSERVE_NATIVE_QUANT=0; the caller picks the quantized build)");
#endif
    default:
      return ffi::Error::InvalidArgument(
          "paged attention: pages must be float32, bfloat16, int8 or float8_e4m3fn");
  }
}

}  // namespace

// What the Python side (paged_attention.py) relies on, checked when the library loads.
extern "C" int JserveMaxGroups() { return kMaxGroups; }
extern "C" int JserveMaxHeadDim() { return kMaxHeadDim; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JservePagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::AnyBuffer>()         // k_pages
                                  .Arg<ffi::AnyBuffer>()         // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scales (empty: float pages)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_start
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Attr<int32_t>("groups")
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("batch_invariant"));
