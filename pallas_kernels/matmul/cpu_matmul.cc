// Native CPU matmul for few rows: out[M, N] = x[M, K] @ w[N, K]^T in float32, called from JAX as
// an XLA FFI custom call.
//
// Why: the decode step's LM head multiplies a handful of rows (the batch) by the whole tied
// embedding, w = E [vocab, hidden], read once from memory. XLA:CPU runs that dot at 40-60 GFLOP/s
// at M = 8-16 (and its Eigen path, which the runner picks for those batches' layer matmuls, is
// slower still). Here each task streams a block of w's rows once and multiplies every row of x
// against it from registers.
//
// Layouts: x f32 [M, K] row-major; w f32 [N, K] row-major (PyTorch's Linear layout, and E's own);
// out f32 [M, N].
//
// Kernel: x is transposed once per call into xT [K][MP] (MP = M rounded up to 8, zero padded), so
// a column of x is one 8-wide vector. A micro-kernel holds RB rows of w x NV vectors of x's rows
// in RB * NV accumulators; per k it broadcasts w[n][k] for its RB rows and adds b * xT[k] (FMA).
// The x vectors of a 16-row chunk and the RB rows of w stay in L1 while every chunk of x passes,
// so w streams from memory once per call.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 Ld(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void St(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// Runs fn(0..n-1) on the caller and on XLA's intra-op pool. Helpers that start late find no
// work and leave; the caller waits only for tasks a helper actually took.
template <typename F>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
  };
  auto state = std::make_shared<State>();
  auto shared_fn = std::make_shared<F>(std::move(fn));
  auto run = [state, shared_fn, n]() {
    state->active.fetch_add(1);
    for (int64_t i = state->next.fetch_add(1); i < n; i = state->next.fetch_add(1)) (*shared_fn)(i);
    state->active.fetch_sub(1);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = run;  // Schedule takes its callable by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  run();
  while (state->active.load() > 0) std::this_thread::yield();
}

struct Dims {
  int64_t M, K, N, MP;
};

// Rows n0..n0+RB-1 of w against x's rows m0..m0+8*NV-1 (those past M are padding, not stored).
template <int RB, int NV>
inline void Block(const Dims& d, const float* w, const float* xt, float* out, int64_t n0,
                  int64_t m0) {
  v8 acc[RB][NV] = {};
  const float* rows[RB];
  for (int r = 0; r < RB; ++r) rows[r] = w + (n0 + r) * d.K;
  for (int64_t k = 0; k < d.K; ++k) {
    const float* xk = xt + k * d.MP + m0;
    v8 xv[NV];
    for (int v = 0; v < NV; ++v) xv[v] = Ld(xk + 8 * v);
    for (int r = 0; r < RB; ++r) {
      const v8 b = Splat(rows[r][k]);
      for (int v = 0; v < NV; ++v) acc[r][v] += b * xv[v];
    }
  }
  for (int r = 0; r < RB; ++r) {
    for (int v = 0; v < NV; ++v) {
      alignas(32) float lanes[8];
      St(lanes, acc[r][v]);
      const int64_t stop = std::min<int64_t>(8, d.M - (m0 + 8 * v));
      for (int64_t i = 0; i < stop; ++i) out[(m0 + 8 * v + i) * d.N + n0 + r] = lanes[i];
    }
  }
}

// RB rows of w from n0 (RB = 1 for the leftovers) against all of x, 16 rows of x at a time.
template <int RB>
inline void Rows(const Dims& d, const float* w, const float* xt, float* out, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 16 <= d.MP; m0 += 16) Block<RB, 2>(d, w, xt, out, n0, m0);
  if (m0 < d.MP) Block<RB, 1>(d, w, xt, out, n0, m0);
}

ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::Result<ffi::Buffer<ffi::F32>> out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("matmul_nt: x must be [M, K] and w [N, K]");
  }
  Dims d{xd[0], xd[1], wd[0], (xd[0] + 7) / 8 * 8};
  if (d.M == 0 || d.N == 0) return ffi::Error::Success();
  std::vector<float> xt(d.K * d.MP, 0.0f);
  const float* xp = x.typed_data();
  for (int64_t m = 0; m < d.M; ++m)
    for (int64_t k = 0; k < d.K; ++k) xt[k * d.MP + m] = xp[m * d.K + k];
  const float* wp = w.typed_data();
  const float* xtp = xt.data();
  float* op = out->typed_data();
  if (d.K == 0) {
    std::fill(op, op + d.M * d.N, 0.0f);
    return ffi::Error::Success();
  }
  // 8 rows of w per micro-kernel when x is one vector wide (M <= 8), else 6 (12 accumulators).
  const int64_t rb = d.MP == 8 ? 8 : 6;
  // Tasks: blocks of w's rows (a multiple of 24 = lcm(6, 8)), about 32 of them or more.
  const int64_t block = std::clamp<int64_t>(d.N / 32 / 24 * 24, 24, 384);
  const int64_t tasks = (d.N + block - 1) / block;
  auto task = [=](int64_t i) {
    const int64_t n_end = std::min(d.N, (i + 1) * block);
    int64_t n = i * block;
    if (rb == 8) {
      for (; n + 8 <= n_end; n += 8) Rows<8>(d, wp, xtp, op, n);
    } else {
      for (; n + 6 <= n_end; n += 6) Rows<6>(d, wp, xtp, op, n);
    }
    for (; n < n_end; ++n) Rows<1>(d, wp, xtp, op, n);
  };
  ParallelFor(pool, tasks, task);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveMatmulNT, MatmulNT,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out
