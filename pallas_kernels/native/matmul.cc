// Native CPU matmul over weights packed once at load, called from JAX as an XLA FFI custom call:
//   JserveMatmulPacked  out[M, N] = x[M, K] @ w[K, N] in float32, w packed as [N / P, K, P]
//     (P = JserveMatmulPanel(): 24 columns with AVX2, 48 with AVX-512)
//   JserveMatmulPackedMany  the same for several weights that read one x (q/k/v, gate/up), one call
// w is float32 or bfloat16 (read as its float32 value; the products and sums are float32), or, in
// JserveMatmulPackedMany, a quantized weight as two arguments, its codes and scales (int8 or int4
// panels, dequantized in registers: packed_matmul.h, packed_job.h; from `int8_rows` rows of x on,
// x quantized to int8 and integer dot products: quant_dot.h).
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
               const std::vector<Job>& jobs, const ActQuant* aq) {
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
      JobPanel(jobs[panels[t].first], panels[t].second, M, K, x, aq);
    }
  };
  ParallelFor(pool, (P + per_task - 1) / per_task, task);
}

// The jobs of (weight, scales or null, out) triples against x [M, K], or an error naming the shapes.
using Weight = std::tuple<ffi::AnyBuffer, const ffi::AnyBuffer*, ffi::Buffer<ffi::F32>>;

// x quantized for the quantized jobs' integer path (quant_dot.h) where M >= int8_rows > 0 and this
// build has it, else null; the rows are quantized over the pool where there are many.
const ActQuant* QuantizeFor(ffi::ThreadPool& pool, int64_t M, int64_t K, const float* x,
                            const std::vector<Job>& jobs, int64_t int8_rows) {
  if (!JSERVE_INT_DOT || int8_rows <= 0 || M < int8_rows) return nullptr;
  int64_t block = 0;
  for (const Job& job : jobs) {
    if (job.codes != Codes::kFloat && IntDotTakes(job.group, ActBlockFor(job.group))) {
      block = ActBlockFor(job.group);
      break;
    }
  }
  if (block == 0) return nullptr;
  thread_local ActQuant caller_aq;
  ActQuant* aq = &caller_aq;  // the caller's, for the pool's threads too (a thread_local is per thread)
  aq->Resize(M, K, block);
  if (M < 64) {
    for (int64_t m = 0; m < M; ++m) aq->QuantizeRow(m, x + m * K);
  } else {
    ParallelFor(pool, M, [aq, x, K](int64_t m) { aq->QuantizeRow(m, x + m * K); });
  }
  return aq;
}

ffi::Error Matmul(ffi::ThreadPool& pool, const ffi::Buffer<ffi::F32>& x, std::vector<Weight>& weights,
                  int64_t int8_rows, int32_t quads) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("matmul_packed: x must be [M, K]");
  const int64_t M = xd[0], K = xd[1];
  std::vector<Job> jobs;
  for (auto& [w, scales, out] : weights) {
    auto od = out.dimensions();
    auto job = PackedJob(w, scales, K, 0, out.typed_data(), "matmul_packed: with x [M, K], each w", quads);
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
  const ActQuant* aq = QuantizeFor(pool, M, K, x.typed_data(), jobs, int8_rows);
  for (const Job& job : jobs) {
    if (job.quads && !(aq && IntDotTakes(job.group, aq->B))) {
      return ffi::Error::InvalidArgument("matmul_packed: codes stored as quads need the integer path at "
                                         "every row count (int8_rows 1, one activation block for the call)");
    }
  }
  RunPanels(pool, M, K, x.typed_data(), jobs, aq);
  return ffi::Error::Success();
}

ffi::Error MatmulPacked(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                        ffi::Result<ffi::Buffer<ffi::F32>> out) {
  std::vector<Weight> weights{{w, nullptr, *out}};
  return Matmul(pool, x, weights, 0, false);
}

// x @ w_i for several packed weights at once: args (x, w_1 .. w_n), results (out_1 .. out_n); a
// quantized w_i is two arguments, its codes and then its scales. int8_rows: from this many rows of
// x on (0: never), x is quantized to int8 for the quantized weights' integer dot products.
// quads: 1, the int4 weights' codes are stored as quads (quant_dot.h's QuadCodes); 2, the int8 ones'.
ffi::Error MatmulPackedMany(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs ws,
                            ffi::RemainingRets outs, int32_t int8_rows, int32_t quads) {
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
  return Matmul(pool, x, weights, int8_rows, quads);
}

}  // namespace

// Columns per packed panel in this build (Python's `pack` asks).
extern "C" int JserveMatmulPanel() { return static_cast<int>(kPanel); }

// Whether this build has the integer dot products over int8 activations (quant_dot.h).
extern "C" int JserveMatmulIntDot() { return JSERVE_INT_DOT; }

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
                                  .RemainingRets()                // out_i [M, N_i]
                                  .Attr<int32_t>("int8_rows")
                                  .Attr<int32_t>("quads"));
