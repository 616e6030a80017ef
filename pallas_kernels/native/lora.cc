// LoRA deltas over any number of rows (a prefill chunk, a mixed step's tokens), as one XLA FFI call:
//   JserveLoraDelta  out_g[m] += (x[m] @ A[:, g, s_m - 1, :]) @ B_g[s_m - 1] for each target g of a
//                    group and each row m with a slot (s_m = ids[m] > 0); rows with id 0 unchanged
// Arguments: x f32 [M, K], ids s32 [M] (0 none, s in 1 .. S), A [K, G, S, r] (the group's stack,
// jserve.model.lora), then G stacks B_g [S, r, N_g] and G base outputs out_g f32 [M, N_g]; A and the
// B_g all float32 or all bfloat16. Results: the G outputs, aliased to the out_g arguments (the deltas
// are added in place).
//
// Why: the dense form (jserve.model.lora's XLA path) multiplies every row by every resident slot's
// A and B and masks the slots it does not use, S times the delta's arithmetic; here each row is
// multiplied by its own slot only (lora_delta.h's XaSlot and AddB, as the fused decode layers do),
// in tasks of a slot's rows over the caller and XLA's pool.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "parallel_for.h"
#include "lora_delta.h"

namespace ffi = xla::ffi;

namespace {

using namespace jserve_native;  // parallel_for.h, lora_delta.h

constexpr int64_t kRowsPerTask = 16;  // rows of one slot per x @ A task (its xa stays in L1)

template <typename T>
void Delta(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K, const int32_t* ids, const T* a, int64_t G,
           int64_t S, int64_t r, const std::vector<const T*>& b, const std::vector<int64_t>& n,
           const std::vector<float*>& out) {
  Lora lo;
  lo.S = S;
  lo.ids = ids;
  lo.Group(M);
  if (lo.rows.empty()) return;
  std::vector<int64_t> task_slot, task_begin;  // a slot's rows in runs of kRowsPerTask
  for (int64_t u = 0; u < lo.tasks(); ++u) {
    for (int64_t i = lo.begin[u]; i < lo.begin[u + 1]; i += kRowsPerTask) {
      task_slot.push_back(u);
      task_begin.push_back(i);
    }
  }
  const int64_t ldxa = G * r;
  thread_local std::vector<float> xa_buf;
  xa_buf.resize(M * ldxa);
  float* xa = xa_buf.data();  // the caller's, for the pool's threads too
  ParallelFor(pool, static_cast<int64_t>(task_slot.size()), [&](int64_t t) {
    const int64_t u = task_slot[t], i = task_begin[t];
    const int64_t rows = std::min(kRowsPerTask, lo.begin[u + 1] - i);
    XaSlot(a, K, G, S, r, lo.used[u], lo.rows.data() + i, rows, x, K, xa, ldxa, 0);
  });
  ParallelFor(pool, static_cast<int64_t>(lo.rows.size()), [&](int64_t i) {
    const int64_t m = lo.rows[i];
    for (int64_t g = 0; g < G; ++g) AddB(b[g], n[g], r, ids[m] - 1, xa + m * ldxa + g * r, out[g] + m * n[g], 0, n[g]);
  });
}

ffi::Error LoraDelta(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer a,
                     ffi::RemainingArgs args, ffi::RemainingRets rets) {
  auto xd = x.dimensions(), ad = a.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("lora_delta: x must be [M, K]");
  const int64_t M = xd[0], K = xd[1];
  if (ids.dimensions().size() != 1 || ids.dimensions()[0] != M) {
    return ffi::Error::InvalidArgument("lora_delta: ids must be [M] for x [M, K]");
  }
  if (ad.size() != 4 || ad[0] != K || (a.element_type() != ffi::F32 && a.element_type() != ffi::BF16)) {
    return ffi::Error::InvalidArgument("lora_delta: A must be float32 or bfloat16 [K, G, S, r] for x [M, K]");
  }
  const int64_t G = ad[1], S = ad[2], r = ad[3];
  if (static_cast<int64_t>(args.size()) != 2 * G || static_cast<int64_t>(rets.size()) != G) {
    return ffi::Error::InvalidArgument("lora_delta: needs G stacks B [S, r, N] and G outputs [M, N] after A [K, G, S, r], "
                                       "and G results");
  }
  std::vector<const void*> b(G);
  std::vector<int64_t> n(G);
  std::vector<float*> out(G);
  for (int64_t g = 0; g < G; ++g) {
    auto bg = args.get<ffi::AnyBuffer>(g);
    auto og = args.get<ffi::AnyBuffer>(G + g);
    auto rg = rets.get<ffi::AnyBuffer>(g);
    if (bg.has_error()) return bg.error();
    if (og.has_error()) return og.error();
    if (rg.has_error()) return rg.error();
    auto bd = bg->dimensions(), od = og->dimensions();
    if (bg->element_type() != a.element_type() || bd.size() != 3 || bd[0] != S || bd[1] != r) {
      return ffi::Error::InvalidArgument("lora_delta: each B must be [S, r, N] of A's dtype, S and r");
    }
    if (og->element_type() != ffi::F32 || od.size() != 2 || od[0] != M || od[1] != bd[2] ||
        (*rg)->untyped_data() != og->untyped_data()) {
      return ffi::Error::InvalidArgument("lora_delta: each output must be float32 [M, N] (B's N), aliased to its result");
    }
    b[g] = bg->untyped_data();
    n[g] = bd[2];
    out[g] = static_cast<float*>(og->untyped_data());
  }
  const int32_t* id = ids.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    if (id[m] < 0 || id[m] > S) {
      return ffi::Error::InvalidArgument("lora_delta: ids must be in 0 .. " + std::to_string(S) + ", got " +
                                         std::to_string(id[m]));
    }
  }
  if (a.element_type() == ffi::BF16) {
    std::vector<const uint16_t*> bt(G);
    for (int64_t g = 0; g < G; ++g) bt[g] = static_cast<const uint16_t*>(b[g]);
    Delta(pool, x.typed_data(), M, K, id, static_cast<const uint16_t*>(a.untyped_data()), G, S, r, bt, n, out);
  } else {
    std::vector<const float*> bt(G);
    for (int64_t g = 0; g < G; ++g) bt[g] = static_cast<const float*>(b[g]);
    Delta(pool, x.typed_data(), M, K, id, static_cast<const float*>(a.untyped_data()), G, S, r, bt, n, out);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JserveLoraDelta, LoraDelta,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [M]
                                  .Arg<ffi::AnyBuffer>()         // A [K, G, S, r], f32 or bf16
                                  .RemainingArgs()               // B_g [S, r, N_g], then out_g [M, N_g]
                                  .RemainingRets());             // out_g [M, N_g], aliased
