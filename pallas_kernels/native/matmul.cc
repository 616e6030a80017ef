// Native CPU matmul over weights packed once at load, called from JAX as an XLA FFI custom call:
//   JserveMatmulPacked  out[M, N] = x[M, K] @ w[K, N] in float32, w packed as [N / P, K, P]
//     (P = JserveMatmulPanel(): 24 columns with AVX2, 48 with AVX-512)
//   JserveMatmulPackedMany  the same for several weights that read one x (q/k/v, gate/up), one call
// w is float32 or bfloat16 (read as its float32 value; the products and sums are float32), or, in
// JserveMatmulPackedMany, a quantized weight as two arguments, its codes and scales (int8 or int4
// panels, dequantized in registers: packed_matmul.h, packed_job.h).
// The paged runner's layer matmuls and tied LM head (w = the embedding's transpose) on CPU.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"
#include "packed_matmul.h"
#include "packed_job.h"

namespace ffi = xla::ffi;

namespace {

using namespace jserve_native;  // packed_matmul.h, parallel_for.h

// Every panel of every job, split into runs of panels over the caller and XLA's pool: the
// matmuls that read the same x (q/k/v, gate/up) run as one call, one wait.
void RunPanels(ffi::ThreadPool& pool, int64_t M, int64_t K, const float* x,
               const std::vector<Job>& jobs) {
  std::vector<std::pair<int, int64_t>> panels;  // (job, panel)
  for (int j = 0; j < static_cast<int>(jobs.size()); ++j)
    for (int64_t p = 0; p < jobs[j].panels; ++p) panels.emplace_back(j, p);
  const int64_t P = static_cast<int64_t>(panels.size());
  if (P == 0) return;
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = std::min(P, workers * kTasksPerWorker);
  const int64_t per_task = (P + tasks - 1) / tasks;
  auto task = [&](int64_t i) {
    for (int64_t t = i * per_task; t < std::min(P, (i + 1) * per_task); ++t) {
      JobPanel(jobs[panels[t].first], panels[t].second, M, K, x);
    }
  };
  ParallelFor(pool, (P + per_task - 1) / per_task, task);
}

// The jobs of (weight, scales or null, out) triples against x [M, K], or an error naming the shapes.
using Weight = std::tuple<ffi::AnyBuffer, const ffi::AnyBuffer*, ffi::Buffer<ffi::F32>>;

ffi::Error Matmul(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, std::vector<Weight>& weights) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("matmul_packed: x must be [M, K]");
  const int64_t M = xd[0], K = xd[1];
  std::vector<Job> jobs;
  for (auto& [w, scales, out] : weights) {
    auto od = out.dimensions();
    auto job = PackedJob(w, scales, K, 0, out.typed_data(), "matmul_packed: with x [M, K], each w");
    if (job.has_error()) return job.error();
    if (od.size() != 2 || od[0] != M || od[1] != job->panels * kPanel) {
      return ffi::Error::InvalidArgument("matmul_packed: each out must be [M, N] for x [M, K] and w [N / P, K, P]");
    }
    if (M == 0) continue;
    if (K == 0) {
      std::fill(job->out, job->out + M * job->panels * kPanel, 0.0f);
      continue;
    }
    jobs.push_back(*job);
  }
  RunPanels(pool, M, K, x.typed_data(), jobs);
  return ffi::Error::Success();
}

ffi::Error MatmulPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::Result<ffi::Buffer<ffi::F32>> out) {
  std::vector<Weight> weights{{w, nullptr, *out}};
  return Matmul(pool, x, weights);
}

// x @ w_i for several packed weights at once: args (x, w_1 .. w_n), results (out_1 .. out_n); a
// quantized w_i is two arguments, its codes and then its scales.
ffi::Error MatmulPackedMany(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                            ffi::RemainingRets outs) {
  std::vector<ffi::AnyBuffer> args;
  for (size_t i = 0; i < ws.size(); ++i) {
    auto w = ws.get<ffi::AnyBuffer>(i);
    if (w.has_error()) return w.error();
    args.push_back(*w);
  }
  std::vector<Weight> weights;
  size_t i = 0;
  for (; i < args.size() && weights.size() < outs.size(); ++i) {
    const size_t w = i;
    const ffi::AnyBuffer* scales = IsQuantizedCodes(args[w]) && i + 1 < args.size() ? &args[++i] : nullptr;
    auto out = outs.get<ffi::Buffer<ffi::F32>>(weights.size());
    if (out.has_error()) return out.error();
    weights.emplace_back(args[w], scales, **out);
  }
  if (weights.empty() || i != args.size() || weights.size() != outs.size()) {
    return ffi::Error::InvalidArgument(
        "matmul_packed_many: needs as many results as weights (at least one; a quantized weight is "
        "two arguments, codes and scales)");
  }
  return Matmul(pool, x, weights);
}

}  // namespace

// Columns per packed panel in this build (Python's `pack` asks).
extern "C" int JserveMatmulPanel() { return static_cast<int>(kPanel); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveMatmulPacked, MatmulPacked,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()         // w [N / P, K, P], f32 or bf16
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [M, N]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveMatmulPackedMany, MatmulPackedMany,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .RemainingArgs()                // w_i [N_i / P, K, P] f32 or bf16, or codes_i, scales_i
                                  .RemainingRets());              // out_i [M, N_i]
