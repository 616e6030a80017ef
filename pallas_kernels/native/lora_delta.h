// LoRA deltas inside the fused decode layers (decoder_layer.cc): each row's adapter slot adds
// (x @ A_s) @ B_s to each target's output, reading only the slots the step's rows use.
//
// Layout (jserve.model.lora): per group of targets that read one input (q/k/v, o, gate/up, down)
// A [K, G, S, r] (G the group's targets, S the slots, r the rank); per target B [S, r, N]; all
// float32 or all bfloat16. A row's id: 0 no adapter, s in 1 .. S slot s - 1 of the stacks.
//
// Work, without phases of its own: XaSlot, one task per slot the step uses, computes its rows'
// x @ A_s for every target of a group (each line of A_s read once for all its rows) as an extra
// task of the phase that runs the group's base matmuls (the same input); AddB, per row, adds
// xa @ B_s over a column range to the base output inside the phase that next reads that row's
// output (rotary, the residuals, the activation). The dense all-slot form
// (jserve.model.lora.apply) reads every resident slot's A and B each step; this reads the used
// slots' only, once each from memory.
#ifndef JSERVE_LORA_DELTA_H_
#define JSERVE_LORA_DELTA_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_attention.h"  // Bf16ToF32

namespace jserve_native {

constexpr int kLoraGroups = 4;   // q/k/v, o, gate/up, down
constexpr int kLoraTargets = 7;  // wq wk wv wo w_gate w_up w_down
constexpr int kLoraGroupSize[kLoraGroups] = {3, 1, 2, 1};
constexpr int kLoraFirst[kLoraGroups] = {0, 3, 4, 6};  // each group's first target

inline float LoraValue(float v) { return v; }
inline float LoraValue(uint16_t v) { return Bf16ToF32(v); }

// One layer's stacks: A per group, B per target.
struct LoraLayer {
  const void* a[kLoraGroups];
  const void* b[kLoraTargets];
};

// The step's slots: rows grouped by slot, the layers' stacks and the xa scratch [M, 7, r].
struct Lora {
  bool bf16 = false;
  int64_t S = 0, r = 0;
  const int32_t* ids = nullptr;  // per row: 0, or its slot + 1
  std::vector<int32_t> rows;     // the rows with an adapter, grouped by slot
  std::vector<int64_t> begin;    // used slot u's rows: rows[begin[u] .. begin[u + 1])
  std::vector<int32_t> used;     // the slots the step's rows use (0-based)
  std::vector<LoraLayer> layers;
  float* xa = nullptr;

  // Groups rows 0 .. M-1 by their ids (each in 0 .. S, checked by the caller).
  void Group(int64_t M) {
    rows.clear();
    begin.assign(1, 0);
    used.clear();
    for (int64_t s = 1; s <= S; ++s) {
      for (int64_t m = 0; m < M; ++m)
        if (ids[m] == s) rows.push_back(static_cast<int32_t>(m));
      if (static_cast<int64_t>(rows.size()) > begin.back()) {
        used.push_back(static_cast<int32_t>(s - 1));
        begin.push_back(rows.size());
      }
    }
  }
  int64_t tasks() const { return static_cast<int64_t>(used.size()); }
  int64_t ldxa() const { return kLoraTargets * r; }
};

// xa[rows[j], first + g, c0 : c0 + kXaCols] = x[rows[j]] @ A[:, g, s, c0 : ...] for R rows: their
// R x kXaCols sums held in registers over all of K (R vectors with AVX-512), each line of A read
// once for the R rows.
constexpr int64_t kXaCols = 16;  // rank columns per pass
constexpr int kXaRows = 4;       // rows per pass

template <int R, typename T>
inline void XaBlock(const T* a, int64_t K, int64_t stride, const int32_t* rows, const float* x, int64_t ldx,
                    float* xa, int64_t ldxa) {
  float acc[R][kXaCols] = {};
  const float* xr[R];
  for (int j = 0; j < R; ++j) xr[j] = x + rows[j] * ldx;
  for (int64_t k = 0; k < K; ++k) {
    const T* ak = a + k * stride;
    float av[kXaCols];
#pragma omp simd
    for (int64_t i = 0; i < kXaCols; ++i) av[i] = LoraValue(ak[i]);
#pragma GCC unroll 4
    for (int j = 0; j < R; ++j) {
      const float xv = xr[j][k];
#pragma omp simd
      for (int64_t i = 0; i < kXaCols; ++i) acc[j][i] += xv * av[i];
    }
  }
  for (int j = 0; j < R; ++j) std::memcpy(xa + rows[j] * ldxa, acc[j], sizeof acc[j]);
}

// xa[row, first + g, :] = x[row] @ A[:, g, s, :] for the n rows of slot s and every g < G.
template <typename T>
void XaSlot(const T* a, int64_t K, int64_t G, int64_t S, int64_t r, int64_t s, const int32_t* rows,
            int64_t n, const float* x, int64_t ldx, float* xa, int64_t ldxa, int64_t first) {
  const int64_t stride = G * S * r;  // between consecutive k of one (g, s)
  if (r % kXaCols == 0) {
    for (int64_t j = 0; j < n; j += kXaRows) {
      const int64_t left = std::min<int64_t>(kXaRows, n - j);
      for (int64_t g = 0; g < G; ++g) {
        for (int64_t c = 0; c < r; c += kXaCols) {
          const T* ag = a + (g * S + s) * r + c;
          float* o = xa + (first + g) * r + c;
          switch (left) {
            case 4: XaBlock<4>(ag, K, stride, rows + j, x, ldx, o, ldxa); break;
            case 3: XaBlock<3>(ag, K, stride, rows + j, x, ldx, o, ldxa); break;
            case 2: XaBlock<2>(ag, K, stride, rows + j, x, ldx, o, ldxa); break;
            default: XaBlock<1>(ag, K, stride, rows + j, x, ldx, o, ldxa); break;
          }
        }
      }
    }
    return;
  }
  // Other ranks (a max_lora_rank that is not a multiple of 16): row by row through memory.
  for (int64_t j = 0; j < n; ++j) std::memset(xa + rows[j] * ldxa + first * r, 0, G * r * sizeof(float));
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t g = 0; g < G; ++g) {
      const T* ak = a + ((k * G + g) * S + s) * r;
      for (int64_t j = 0; j < n; ++j) {
        const float xv = x[rows[j] * ldx + k];
        float* o = xa + rows[j] * ldxa + (first + g) * r;
#pragma omp simd
        for (int64_t i = 0; i < r; ++i) o[i] += xv * LoraValue(ak[i]);
      }
    }
  }
}

// The task of used slot u for group `group` of layer l over input x [M, K] (rows ldx apart).
inline void LoraXa(const Lora& lo, int64_t l, int group, int64_t u, const float* x, int64_t ldx, int64_t K) {
  const int64_t s = lo.used[u], n = lo.begin[u + 1] - lo.begin[u];
  const int32_t* rows = lo.rows.data() + lo.begin[u];
  const void* a = lo.layers[l].a[group];
  const int64_t G = kLoraGroupSize[group], first = kLoraFirst[group];
  if (lo.bf16) {
    XaSlot(static_cast<const uint16_t*>(a), K, G, lo.S, lo.r, s, rows, n, x, ldx, lo.xa, lo.ldxa(), first);
  } else {
    XaSlot(static_cast<const float*>(a), K, G, lo.S, lo.r, s, rows, n, x, ldx, lo.xa, lo.ldxa(), first);
  }
}

// out[c] += xa @ B[s][:, c] for c in [c0, c1), in blocks of kBlock columns held in registers.
template <typename T>
void AddB(const T* b, int64_t N, int64_t r, int64_t s, const float* xa, float* out, int64_t c0, int64_t c1) {
  constexpr int64_t kBlock = 64;
  const T* bs = b + s * r * N;
  int64_t c = c0;
  for (; c + kBlock <= c1; c += kBlock) {
    alignas(64) float acc[kBlock];
    std::memcpy(acc, out + c, sizeof acc);
    for (int64_t i = 0; i < r; ++i) {
      const float xv = xa[i];
      const T* row = bs + i * N + c;
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) acc[j] += xv * LoraValue(row[j]);
    }
    std::memcpy(out + c, acc, sizeof acc);
  }
  for (; c < c1; ++c) {
    float sum = 0.0f;
    for (int64_t i = 0; i < r; ++i) sum += xa[i] * LoraValue(bs[i * N + c]);
    out[c] += sum;
  }
}

// Row m's delta of target t (layer l, N output columns) over columns [c0, c1), added to out (the
// row's output); nothing for a row without an adapter.
inline void LoraAddB(const Lora& lo, int64_t l, int t, int64_t m, int64_t N, float* out, int64_t c0, int64_t c1) {
  const int32_t id = lo.ids[m];
  if (id <= 0) return;
  const float* xa = lo.xa + m * lo.ldxa() + t * lo.r;
  const void* b = lo.layers[l].b[t];
  if (lo.bf16) {
    AddB(static_cast<const uint16_t*>(b), N, lo.r, id - 1, xa, out, c0, c1);
  } else {
    AddB(static_cast<const float*>(b), N, lo.r, id - 1, xa, out, c0, c1);
  }
}

}  // namespace jserve_native

#endif  // JSERVE_LORA_DELTA_H_
