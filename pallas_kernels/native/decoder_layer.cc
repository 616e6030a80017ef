// The Llama decoder layers of a decode step (one new token per row), as one XLA FFI custom call:
//   JserveDecoderLayers  x_out = the layers applied in turn to x, each row's new K/V written into
//                        each layer's pages
// Each layer: RMSNorm, q/k/v (packed_matmul.h), rotary, the K/V write, decode attention over the
// pages (decode_attention.h), o and the residual, RMSNorm, gate/up, SiLU, down and the residual:
// what jserve.model.llama computes for a layer without biases or q/k norms, in float32 (weights
// float32 or bfloat16 panels, or quantized int8 / int4 panels dequantized in registers; pages
// float32 or bfloat16).
//
// Why: run as XLA ops, a decode step spent a large part of its time outside its matmuls,
// attention and head (~18 small fusions per layer, each a pass of XLA's thunk executor) and
// between the native calls (each wakes a helper thread of XLA's pool anew). Here the caller and
// the pool's helpers run all the layers' phases as one Team (parallel_for.h): the helpers are
// woken once per step and wait between phases spinning. One call per layer still paid a gap
// between calls and a wake-up per layer (docs/performance.md).
//
// Arguments: x f32 [M, D] (the rows' hidden states), cos and sin f32 [M, head_dim] (the rotary
// tables at each row's position, llama.rotary_tables), slots s32 [M] (page * page_size + offset
// of the row's new K/V; padded rows: page 0), q_start s32 [M] (the row's position), q_lens s32
// [M] (1, or 0 for a padded row), page_indices s32 [M, max_pages]; then per layer
// kArgsPerLayer: attn_norm and mlp_norm f32|bf16 [D], wq wk wv wo w_gate w_up w_down packed
// [N / P, K, P] (packed_matmul.h) f32|bf16, k_pages and v_pages f32|bf16 [num_kv_heads,
// num_pages, page_size, head_dim]. Layers of quantized weights (wq's codes int8 or uint8) take
// kArgsPerQuantizedLayer: the same, each weight's codes in its place, then the seven weights'
// scales after v_pages (packed_job.h).
// Results: x_out f32 [M, D], then per layer k_pages and v_pages, aliased to the arguments
// (written in place).
// Attributes: num_heads, eps (RMSNorm), sm_scale, sliding_window (0 = off), int8_rows (quantized
// weights: from this many rows on each matmul's input is quantized to int8 for integer dot
// products, quant_dot.h; 0 = never), quads (1: the int4 weights' codes stored as quads, 2: the
// int8 ones', quant_dot.h's QuadCodes: int8_rows must be 1).
//
//   JserveDecoderLayersLora  the same with LoRA adapters: after page_indices, lora_ids s32 [M]
//                        (each row's slot: 0 none, s in 1 .. S), and after each layer's arguments
//                        its kLoraArgsPerLayer stacks: A [K, G, S, r] for q/k/v, o, gate/up and
//                        down, then B [S, r, N] for the seven targets (lora_delta.h says where the
//                        deltas are computed).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"
#include "packed_matmul.h"
#include "decode_attention.h"
#include "packed_job.h"
#include "lora_delta.h"

namespace ffi = xla::ffi;

namespace {

using namespace jserve_native;  // parallel_for.h, packed_matmul.h, decode_attention.h

bool SameDims(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// A norm weight (float32 or bfloat16) as float32.
std::vector<float> Floats(const ffi::AnyBuffer& b) {
  std::vector<float> out(b.element_count());
  if (b.element_type() == ffi::BF16) {
    const uint16_t* p = static_cast<const uint16_t*>(b.untyped_data());
    for (size_t i = 0; i < out.size(); ++i) out[i] = Bf16ToF32(p[i]);
  } else {
    std::memcpy(out.data(), b.untyped_data(), out.size() * sizeof(float));
  }
  return out;
}

// Round to nearest even, as XLA's convert does.
inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void StoreRow(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void StoreRow(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
}

// out = w * x / sqrt(mean(x^2) + eps)
inline void RmsNormRow(const float* x, const float* w, float* out, int64_t D, float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) out[d] = w[d] * (x[d] * r);
}

// Rotate-half rotary embedding of one head (llama.apply_rotary).
inline void Rotate(const float* x, const float* cos, const float* sin, float* out, int64_t hd) {
  const int64_t half = hd / 2;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] - x[j + half] * sin[j];
#pragma omp simd
  for (int64_t j = half; j < hd; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

// One layer's arguments: its norm weights, packed weights (wq wk wv wo w_gate w_up w_down) and
// pages (the results', aliased to the arguments).
struct LayerArgs {
  const ffi::AnyBuffer *attn_norm, *mlp_norm;
  const ffi::AnyBuffer* w[7];
  const ffi::AnyBuffer* scales[7];  // quantized weights' scales, else null
  void *k_pages, *v_pages;
};

// The most phases Layers' body runs per layer: 8 (9 in the first), or 2 more where the attention
// splits rows' keys, and 4 more where the matmuls' inputs are quantized to int8 (quant_dot.h).
constexpr int kPhasesPerLayer = 14;

template <typename T>
ffi::Error Layers(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x,
                  const ffi::Buffer<ffi::F32>& cos, const ffi::Buffer<ffi::F32>& sin,
                  const ffi::Buffer<ffi::S32>& slots, const ffi::Buffer<ffi::S32>& q_start,
                  const ffi::Buffer<ffi::S32>& q_lens, const ffi::Buffer<ffi::S32>& page_indices,
                  const std::vector<LayerArgs>& layers, float* x_out, const Shape& s, int64_t H,
                  float eps, float sm_scale, int32_t window, int32_t int8_rows, int32_t quads,
                  const Lora* lora) {
  const int64_t M = s.batch, KVH = s.kv_heads, G = s.groups, hd = s.head_dim, L = layers.size();
  const LayerArgs& first = layers[0];
  const int64_t D = x.dimensions()[1], QD = H * hd, KD = KVH * hd;
  // The MLP's width: w_down's rows (int4 codes hold two per byte).
  const int64_t F = first.w[6]->dimensions().size() == 3
                        ? first.w[6]->dimensions()[1] * (first.w[6]->element_type() == ffi::U8 ? 2 : 1)
                        : 0;
  int64_t width[7];  // each weight's padded output width
  for (int i = 0; i < 7; ++i) {
    auto wd = first.w[i]->dimensions();
    width[i] = wd.size() == 3 ? wd[0] * kPanel : 0;
  }
  const int64_t Wq = width[0], Wk = width[1], Wv = width[2], Wo = width[3], Wf = width[4],
                Wu = width[5], Wd = width[6];
  // Scratch: h, q, k, v, rotated q, attention, o, h2, gate, up, act, down.
  const int64_t sizes[] = {M * D, M * Wq, M * Wk, M * Wv, M * QD, M * QD, M * Wo, M * D, M * Wf, M * Wu, M * F, M * Wd};
  thread_local std::vector<float> scratch;
  int64_t total = 0;
  for (int64_t n : sizes) total += (n + 15) / 16 * 16;
  if (static_cast<int64_t>(scratch.size()) < total) scratch.resize(total);
  float* bufs[12];
  float* next = scratch.data();
  for (int i = 0; i < 12; ++i) {
    bufs[i] = next;
    next += (sizes[i] + 15) / 16 * 16;
  }
  float *h = bufs[0], *q = bufs[1], *k = bufs[2], *v = bufs[3], *qr = bufs[4], *attn = bufs[5],
        *o = bufs[6], *h2 = bufs[7], *gate = bufs[8], *up = bufs[9], *act = bufs[10], *down = bufs[11];
  // Per layer: the seven matmuls (into the scratch), the norm weights, the attention.
  std::vector<Job> jobs(7 * L);
  std::vector<float> norms(2 * D * L);
  std::vector<DecodeWork<T>> attention;
  attention.reserve(L);
  const int64_t ks[] = {D, D, D, QD, D, D, F}, ns[] = {QD, KD, KD, D, F, F, D};
  float* outs[] = {q, k, v, o, gate, up, down};
  const char* names[] = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"};
  for (int64_t l = 0; l < L; ++l) {
    const LayerArgs& a = layers[l];
    for (int i = 0; i < 7; ++i) {
      auto job = PackedJob(*a.w[i], a.scales[i], ks[i], ns[i], outs[i], std::string("decoder_layer: ") + names[i],
                           quads);
      if (job.has_error()) return job.error();
      if (job->panels * kPanel != width[i]) {
        return ffi::Error::InvalidArgument(std::string("decoder_layer: every layer's ") + names[i] +
                                           " must have the same shape");
      }
      jobs[7 * l + i] = *job;
    }
    for (int n = 0; n < 2; ++n) {
      const std::vector<float> w = Floats(n == 0 ? *a.attn_norm : *a.mlp_norm);
      if (static_cast<int64_t>(w.size()) != D) {
        return ffi::Error::InvalidArgument("decoder_layer: the norm weights must be [hidden]");
      }
      std::copy(w.begin(), w.end(), norms.begin() + (2 * l + n) * D);
    }
    attention.emplace_back(s, qr, static_cast<const T*>(a.k_pages), static_cast<const T*>(a.v_pages),
                           q_start.typed_data(), q_lens.typed_data(), page_indices.typed_data(), attn,
                           sm_scale, 0.0f, window, pool.num_threads());
  }
  if (Wu != Wf) return ffi::Error::InvalidArgument("decoder_layer: w_gate and w_up must have the same shape");
  if (M == 0) return ffi::Error::Success();
  // Quantized weights from int8_rows rows on: each matmul's input quantized to int8 in a phase of its
  // own (ActInt8), read by the integer dot products (quant_dot.h); else null.
  const int64_t act_block = JSERVE_INT_DOT && int8_rows > 0 && M >= int8_rows && jobs[0].codes != Codes::kFloat &&
                                    IntDotTakes(jobs[0].group, ActBlockFor(jobs[0].group))
                                ? ActBlockFor(jobs[0].group)
                                : 0;
  for (const Job& job : jobs) {
    if (job.quads && !(act_block && IntDotTakes(job.group, act_block))) {
      return ffi::Error::InvalidArgument("decoder_layer: codes stored as quads need the integer path at "
                                         "every row count (int8_rows 1)");
    }
  }
  thread_local ActQuant act_quant_buf[3];  // inputs of K = D, QD, F
  ActQuant* act_quant = act_quant_buf;     // the caller's, for every member (a thread_local is per thread)
  if (act_block) {
    act_quant[0].Resize(M, D, act_block);
    act_quant[1].Resize(M, QD, act_block);
    act_quant[2].Resize(M, F, act_block);
  }
  const ActQuant *aq_d = act_block ? &act_quant[0] : nullptr, *aq_qd = act_block ? &act_quant[1] : nullptr,
                 *aq_f = act_block ? &act_quant[2] : nullptr;
  const float *cp = cos.typed_data(), *sp = sin.typed_data();
  const int32_t* slot = slots.typed_data();
  const int64_t pq = Wq / kPanel, pk = Wk / kPanel, pqkv = (Wq + Wk + Wv) / kPanel;
  const int64_t po = Wo / kPanel, pf = Wf / kPanel, pd = Wd / kPanel;
  // LoRA (lora_delta.h): one more task per used slot in each matmul phase, the rows' deltas added
  // where the phases after read the outputs.
  const int64_t nl = lora ? lora->tasks() : 0;
  Team::Run(pool, kPhasesPerLayer * L + 1, [&](TeamMember& t) {
    for (int64_t l = 0; l < L; ++l) {
      const float* xin = l == 0 ? x.typed_data() : x_out;
      const Job* job = jobs.data() + 7 * l;
      const float *attn_norm = norms.data() + 2 * l * D, *mlp_norm = attn_norm + D;
      T* k_pages = static_cast<T*>(layers[l].k_pages);
      T* v_pages = static_cast<T*>(layers[l].v_pages);
      DecodeWork<T>& work = attention[l];
      if (l == 0) t.For(M, [&](int64_t m) { RmsNormRow(xin + m * D, attn_norm, h + m * D, D, eps); });
      if (aq_d) t.For(M, [&](int64_t m) { act_quant[0].QuantizeRow(m, h + m * D); });
      t.For(pqkv + nl, [&](int64_t i) {
        if (i >= pqkv) return LoraXa(*lora, l, 0, i - pqkv, h, D, D);
        const int j = i < pq ? 0 : i < pq + pk ? 1 : 2;
        JobPanel(job[j], i - (j == 0 ? 0 : j == 1 ? pq : pq + pk), M, D, h, aq_d);
      });
      // Rotary on the row's queries of KV head kv and on its key; the key and value into the pages.
      auto rotate_and_write = [&](int64_t m, int64_t kv) {
        const float *c = cp + m * hd, *sn = sp + m * hd;
        if (lora) {
          LoraAddB(*lora, l, 0, m, QD, q + m * Wq, kv * G * hd, (kv + 1) * G * hd);
          LoraAddB(*lora, l, 1, m, KD, k + m * Wk, kv * hd, (kv + 1) * hd);
          LoraAddB(*lora, l, 2, m, KD, v + m * Wv, kv * hd, (kv + 1) * hd);
        }
        for (int64_t g = 0; g < G; ++g) {
          const int64_t head = kv * G + g;
          Rotate(q + m * Wq + head * hd, c, sn, qr + m * QD + head * hd, hd);
        }
        alignas(64) float key[kMaxHeadDim];
        Rotate(k + m * Wk + kv * hd, c, sn, key, hd);
        const int64_t page = slot[m] / s.page_size;
        if (slot[m] < 0 || page >= s.num_pages) return;  // as XLA's promise_in_bounds: never here
        const int64_t at = ((kv * s.num_pages + page) * s.page_size + slot[m] % s.page_size) * hd;
        StoreRow(k_pages + at, key, hd);
        StoreRow(v_pages + at, v + m * Wv + kv * hd, hd);
      };
      if (work.merges() == 0) {
        // One task per (row, KV head), which reads no other's K/V: written, then attended, in
        // one phase (a separate phase cost measurable time per layer; docs/performance.md).
        t.For(work.tasks(), [&](int64_t i) {
          rotate_and_write(i / KVH, i % KVH);
          work.Task(i);
        });
      } else {
        t.For(M * KVH, [&](int64_t i) { rotate_and_write(i / KVH, i % KVH); });
        t.For(work.tasks(), [&](int64_t i) { work.Task(i); });
        t.For(work.merges(), [&](int64_t i) { work.Merge(i); });
      }
      if (aq_qd) t.For(M, [&](int64_t m) { act_quant[1].QuantizeRow(m, attn + m * QD); });
      t.For(po + nl, [&](int64_t p) {
        if (p >= po) return LoraXa(*lora, l, 1, p - po, attn, QD, QD);
        JobPanel(job[3], p, M, QD, attn, aq_qd);
      });
      t.For(M, [&](int64_t m) {
        float* xo = x_out + m * D;
        if (lora) LoraAddB(*lora, l, 3, m, D, o + m * Wo, 0, D);
        for (int64_t d = 0; d < D; ++d) xo[d] = xin[m * D + d] + o[m * Wo + d];
        RmsNormRow(xo, mlp_norm, h2 + m * D, D, eps);
      });
      if (aq_d) t.For(M, [&](int64_t m) { act_quant[0].QuantizeRow(m, h2 + m * D); });
      t.For(2 * pf + nl, [&](int64_t i) {
        if (i >= 2 * pf) return LoraXa(*lora, l, 2, i - 2 * pf, h2, D, D);
        JobPanel(job[4 + i / pf], i % pf, M, D, h2, aq_d);
      });
      t.For(M, [&](int64_t m) {
        if (lora) {
          LoraAddB(*lora, l, 4, m, F, gate + m * Wf, 0, F);
          LoraAddB(*lora, l, 5, m, F, up + m * Wu, 0, F);
        }
        const float *gm = gate + m * Wf, *um = up + m * Wu;
        float* am = act + m * F;
#pragma omp simd
        for (int64_t f = 0; f < F; ++f) am[f] = gm[f] / (1.0f + std::exp(-gm[f])) * um[f];
      });
      if (aq_f) t.For(M, [&](int64_t m) { act_quant[2].QuantizeRow(m, act + m * F); });
      t.For(pd + nl, [&](int64_t p) {
        if (p >= pd) return LoraXa(*lora, l, 3, p - pd, act, F, F);
        JobPanel(job[6], p, M, F, act, aq_f);
      });
      // The residual, and the next layer's first RMSNorm with it (one phase fewer a layer).
      const float* next_norm = l + 1 < L ? norms.data() + 2 * (l + 1) * D : nullptr;
      t.For(M, [&](int64_t m) {
        float* xo = x_out + m * D;
        if (lora) LoraAddB(*lora, l, 6, m, D, down + m * Wd, 0, D);
        for (int64_t d = 0; d < D; ++d) xo[d] += down[m * Wd + d];
        if (next_norm) RmsNormRow(xo, next_norm, h + m * D, D, eps);
      });
    }
  });
  return ffi::Error::Success();
}

constexpr size_t kArgsPerLayer = 11;  // attn_norm mlp_norm wq wk wv wo w_gate w_up w_down k v
constexpr size_t kKPagesArg = 9;      // the layer's k_pages among them (v_pages follows)
// Quantized layers: the same, each weight's codes in its place, then the 7 weights' scales.
constexpr size_t kArgsPerQuantizedLayer = 18;
constexpr size_t kScalesArg = 11;
// With LoRA (JserveDecoderLayersLora): after a layer's arguments, its 4 A stacks (q/k/v, o,
// gate/up, down) and 7 B stacks (lora_delta.h).
constexpr size_t kLoraArgsPerLayer = kLoraGroups + kLoraTargets;

// The LoRA arguments of the layers (`lora_ids` [M] given): checked and grouped into `lora`.
ffi::Error ReadLora(const ffi::AnyBuffer* a, size_t L, size_t per_layer, size_t base, const int64_t* ks,
                    const int64_t* ns, const ffi::Buffer<ffi::S32>& lora_ids, int64_t M, Lora& lora) {
  const ffi::AnyBuffer& a0 = a[base];
  auto ad = a0.dimensions();
  if (ad.size() != 4 || (a0.element_type() != ffi::F32 && a0.element_type() != ffi::BF16)) {
    return ffi::Error::InvalidArgument("decoder_layer: LoRA A stacks must be float32 or bfloat16 [K, G, S, r]");
  }
  lora.bf16 = a0.element_type() == ffi::BF16;
  lora.S = ad[2];
  lora.r = ad[3];
  lora.layers.resize(L);
  for (size_t l = 0; l < L; ++l) {
    const ffi::AnyBuffer* la = a + per_layer * l + base;
    for (int i = 0; i < kLoraGroups + kLoraTargets; ++i) {
      const bool is_a = i < kLoraGroups;
      const int t = is_a ? kLoraFirst[i] : i - kLoraGroups;
      auto d = la[i].dimensions();
      const bool ok = la[i].element_type() == a0.element_type() && d.size() == (is_a ? 4u : 3u) &&
                      (is_a ? d[0] == ks[t] && d[1] == kLoraGroupSize[i] && d[2] == lora.S && d[3] == lora.r
                            : d[0] == lora.S && d[1] == lora.r && d[2] == ns[t]);
      if (!ok) {
        return ffi::Error::InvalidArgument(
            "decoder_layer: every layer's LoRA stacks must be A [K, G, S, r] per group (q/k/v, o, gate/up, "
            "down) and B [S, r, N] per target, of one dtype, S and r");
      }
      if (is_a) {
        lora.layers[l].a[i] = la[i].untyped_data();
      } else {
        lora.layers[l].b[t] = la[i].untyped_data();
      }
    }
  }
  if (lora_ids.dimensions().size() != 1 || lora_ids.dimensions()[0] != M) {
    return ffi::Error::InvalidArgument("decoder_layer: lora_ids must be [M]");
  }
  lora.ids = lora_ids.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    if (lora.ids[m] < 0 || lora.ids[m] > lora.S) {
      return ffi::Error::InvalidArgument("decoder_layer: lora_ids must be in 0 .. " + std::to_string(lora.S) +
                                         ", got " + std::to_string(lora.ids[m]));
    }
  }
  lora.Group(M);
  thread_local std::vector<float> xa;
  xa.resize(std::max<int64_t>(1, M * lora.ldxa()));
  lora.xa = xa.data();
  return ffi::Error::Success();
}

ffi::Error Run(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
               ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> q_start,
               ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> page_indices, const ffi::Buffer<ffi::S32>* lora_ids,
               ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> x_out, ffi::RemainingRets rets,
               int32_t num_heads, float eps, float sm_scale, int32_t sliding_window, int32_t int8_rows,
               int32_t quads) {
  std::vector<ffi::AnyBuffer> in;
  for (size_t i = 0; i < args.size(); ++i) {
    auto a = args.get<ffi::AnyBuffer>(i);
    if (a.has_error()) return a.error();
    in.push_back(*a);
  }
  // Quantized layers where the first layer's wq is quantized codes (every layer must be alike).
  const bool quantized = in.size() > 2 && IsQuantizedCodes(in[2]);
  const size_t base = quantized ? kArgsPerQuantizedLayer : kArgsPerLayer;
  const size_t per_layer = base + (lora_ids ? kLoraArgsPerLayer : 0);
  const size_t L = args.size() / per_layer;
  if (L == 0 || args.size() != L * per_layer || rets.size() != 2 * L) {
    return ffi::Error::InvalidArgument(
        "decoder_layer: needs, per layer, 11 arguments (attn_norm, mlp_norm, wq, wk, wv, wo, "
        "w_gate, w_up, w_down, k_pages, v_pages; quantized weights: their codes, and their 7 "
        "scales after v_pages; with LoRA, its 4 A and 7 B stacks after those) and 2 results (k_pages, v_pages)");
  }
  std::vector<ffi::AnyBuffer> out;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto r = rets.get<ffi::AnyBuffer>(i);
    if (r.has_error()) return r.error();
    out.push_back(**r);
  }
  auto xd = x.dimensions();
  auto kd = in[kKPagesArg].dimensions();
  auto pd = page_indices.dimensions();
  if (xd.size() != 2 || kd.size() != 4 || pd.size() != 2 || pd[0] != xd[0] ||
      !SameDims(x_out->dimensions(), xd)) {
    return ffi::Error::InvalidArgument(
        "decoder_layer: x and x_out must be [M, hidden], the pages [kv_heads, num_pages, "
        "page_size, head_dim], page_indices [M, max_pages]");
  }
  const ffi::DataType page_type = in[kKPagesArg].element_type();
  std::vector<LayerArgs> layers(L);
  for (size_t l = 0; l < L; ++l) {
    const ffi::AnyBuffer* a = in.data() + per_layer * l;
    for (int i = 0; i < 2; ++i) {
      const ffi::AnyBuffer &page = a[kKPagesArg + i], &result = out[2 * l + i];
      if (!SameDims(page.dimensions(), kd) || !SameDims(result.dimensions(), kd) ||
          page.element_type() != page_type || result.element_type() != page_type ||
          result.untyped_data() != page.untyped_data()) {
        return ffi::Error::InvalidArgument(
            "decoder_layer: every layer's k_pages and v_pages must share a shape and dtype and be "
            "aliased to their results");
      }
    }
    for (int i = 0; i < 2; ++i) {
      if (a[i].element_type() != ffi::F32 && a[i].element_type() != ffi::BF16) {
        return ffi::Error::InvalidArgument("decoder_layer: the norm weights must be float32 or bfloat16");
      }
    }
    LayerArgs& layer = layers[l];
    layer.attn_norm = &a[0];
    layer.mlp_norm = &a[1];
    for (int i = 0; i < 7; ++i) {
      layer.w[i] = &a[2 + i];
      layer.scales[i] = quantized ? &a[kScalesArg + i] : nullptr;
      if (IsQuantizedCodes(a[2 + i]) != quantized) {
        return ffi::Error::InvalidArgument(
            "decoder_layer: every layer's seven weights must be all quantized or all float");
      }
    }
    layer.k_pages = out[2 * l].untyped_data();
    layer.v_pages = out[2 * l + 1].untyped_data();
  }
  const int64_t M = xd[0], KVH = kd[0], hd = kd[3];
  if (num_heads < 1 || KVH < 1 || num_heads % KVH || num_heads / KVH > kMaxGroups ||
      hd > kMaxHeadDim || hd % 8) {
    return ffi::Error::InvalidArgument("decoder_layer: unsupported heads or head_dim");
  }
  for (const auto* b : {&cos, &sin}) {
    if (b->dimensions().size() != 2 || b->dimensions()[0] != M || b->dimensions()[1] != hd) {
      return ffi::Error::InvalidArgument("decoder_layer: cos and sin must be [M, head_dim]");
    }
  }
  for (const auto* b : {&slots, &q_start, &q_lens}) {
    if (b->dimensions().size() != 1 || b->dimensions()[0] != M) {
      return ffi::Error::InvalidArgument("decoder_layer: slots, q_start and q_lens must be [M]");
    }
  }
  Shape s{M, KVH, 1, num_heads / KVH, hd, kd[1], kd[2], pd[1]};
  Lora lora;
  if (lora_ids) {
    // Each target's K and N: its packed weight's rows (int4: two per byte) and the attention's widths.
    const int64_t D = xd[1], QD = num_heads * hd, KD = KVH * hd;
    const ffi::AnyBuffer& down = in[8];
    const int64_t F = down.dimensions().size() == 3 ? down.dimensions()[1] * (down.element_type() == ffi::U8 ? 2 : 1)
                                                   : 0;
    const int64_t ks[] = {D, D, D, QD, D, D, F}, ns[] = {QD, KD, KD, D, F, F, D};
    auto error = ReadLora(in.data(), L, per_layer, base, ks, ns, *lora_ids, M, lora);
    if (error.failure()) return error;
  }
  const Lora* lp = lora_ids ? &lora : nullptr;
  switch (page_type) {
    case ffi::F32:
      return Layers<float>(pool, x, cos, sin, slots, q_start, q_lens, page_indices, layers,
                           x_out->typed_data(), s, num_heads, eps, sm_scale, sliding_window, int8_rows,
                           quads, lp);
    case ffi::BF16:
      return Layers<uint16_t>(pool, x, cos, sin, slots, q_start, q_lens, page_indices, layers,
                              x_out->typed_data(), s, num_heads, eps, sm_scale, sliding_window, int8_rows,
                              quads, lp);
    default:
      return ffi::Error::InvalidArgument("decoder_layer: pages must be float32 or bfloat16");
  }
}

ffi::Error DecoderLayers(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                         ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slots,
                         ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_lens,
                         ffi::Buffer<ffi::S32> page_indices, ffi::RemainingArgs args,
                         ffi::Result<ffi::Buffer<ffi::F32>> x_out, ffi::RemainingRets rets,
                         int32_t num_heads, float eps, float sm_scale, int32_t sliding_window,
                         int32_t int8_rows, int32_t quads) {
  return Run(pool, x, cos, sin, slots, q_start, q_lens, page_indices, nullptr, args, x_out, rets, num_heads, eps,
             sm_scale, sliding_window, int8_rows, quads);
}

// The same, each row with a LoRA slot (lora_ids [M]: 0 none, s: slot s) and each layer's stacks.
ffi::Error DecoderLayersLora(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> cos,
                             ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> slots,
                             ffi::Buffer<ffi::S32> q_start, ffi::Buffer<ffi::S32> q_lens,
                             ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> lora_ids,
                             ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> x_out,
                             ffi::RemainingRets rets, int32_t num_heads, float eps, float sm_scale,
                             int32_t sliding_window, int32_t int8_rows, int32_t quads) {
  return Run(pool, x, cos, sin, slots, q_start, q_lens, page_indices, &lora_ids, args, x_out, rets, num_heads, eps,
             sm_scale, sliding_window, int8_rows, quads);
}

}  // namespace

// What the Python side (decoder_layer.py) relies on, checked when the library loads.
extern "C" int JserveArgsPerLayer() { return static_cast<int>(kArgsPerLayer); }
extern "C" int JserveKPagesArg() { return static_cast<int>(kKPagesArg); }
extern "C" int JserveArgsPerQuantizedLayer() { return static_cast<int>(kArgsPerQuantizedLayer); }
extern "C" int JserveScalesArg() { return static_cast<int>(kScalesArg); }
extern "C" int JserveLoraArgsPerLayer() { return static_cast<int>(kLoraArgsPerLayer); }
extern "C" int JserveMaxGroups() { return kMaxGroups; }
extern "C" int JserveMaxHeadDim() { return kMaxHeadDim; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveDecoderLayers, DecoderLayers,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [M, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [M, head_dim]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_start [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices [M, max_pages]
                                  .RemainingArgs()               // per layer: kArgsPerLayer
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x_out [M, D]
                                  .RemainingRets()               // per layer: k_pages, v_pages
                                  .Attr<int32_t>("num_heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("int8_rows")
                                  .Attr<int32_t>("quads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveDecoderLayersLora, DecoderLayersLora,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [M, head_dim]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [M, head_dim]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_start [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_lens [M]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_indices [M, max_pages]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lora_ids [M]
                                  .RemainingArgs()               // per layer: its args, then its LoRA stacks
                                  .Ret<ffi::Buffer<ffi::F32>>()  // x_out [M, D]
                                  .RemainingRets()               // per layer: k_pages, v_pages
                                  .Attr<int32_t>("num_heads")
                                  .Attr<float>("eps")
                                  .Attr<float>("sm_scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<int32_t>("int8_rows")
                                  .Attr<int32_t>("quads"));
