// A packed weight of an XLA FFI call as a Job (packed_matmul.h), checked against the shapes the
// call expects: float32 or bfloat16 panels [N / P, K, P], or a quantized weight's two buffers,
// codes (int8 [N / P, K, P], or uint8 [N / P, K / 2, P] for int4) and scales ([N / P, K / G, S, P],
// float32 or float16; S = 2 where they carry offsets, then int4 codes are unsigned). Shared by
// matmul.cc and decoder_layer.cc. Include after "xla/ffi/api/ffi.h". quads, a bit per scheme (1:
// int4, 2: int8; one call may mix them, as GGUF layers do): that scheme's codes are stored as the
// integer kernel reads them (quant_dot.h's QuadCodes: int4 on a build with integer dot products,
// octets of K within each group; int8 on an AVX-512 VNNI build, quads of K).
#ifndef JSERVE_PACKED_JOB_H_
#define JSERVE_PACKED_JOB_H_

#include <cstdint>
#include <string>

#include "packed_matmul.h"

namespace jserve_native {

inline bool IsQuantizedCodes(const xla::ffi::AnyBuffer& w) {
  return w.element_type() == xla::ffi::DataType::S8 || w.element_type() == xla::ffi::DataType::U8;
}

// The job of weight `w` (with `scales` where w holds quantized codes, else nullptr) for x [M, K]:
// its panels must cover at least `min_n` columns (0: any); it writes to `out`. `what` names the
// weight in the error.
inline xla::ffi::ErrorOr<Job> PackedJob(const xla::ffi::AnyBuffer& w, const xla::ffi::AnyBuffer* scales,
                                        int64_t K, int64_t min_n, float* out, const std::string& what,
                                        int32_t quads = 0) {
  namespace ffi = xla::ffi;
  auto wd = w.dimensions();
  if (!IsQuantizedCodes(w)) {
    if (scales || wd.size() != 3 || wd[1] != K || wd[2] != kPanel || wd[0] * kPanel < min_n ||
        (w.element_type() != ffi::DataType::F32 && w.element_type() != ffi::DataType::BF16)) {
      return ffi::Error::InvalidArgument(what + " must be a float32 or bfloat16 packed weight [N / P, K, P] "
                                         "(P: JserveMatmulPanel()) of the expected shape");
    }
    return Job{w.untyped_data(), w.element_type() == ffi::DataType::BF16, wd[0], out};
  }
#if !JSERVE_NATIVE_QUANT
  return ffi::Error::InvalidArgument(what + " is quantized: this build has the float kernels only "
                                     "(JSERVE_NATIVE_QUANT=0; the caller picks the quantized build)");
#endif
  const bool int4 = w.element_type() == ffi::DataType::U8;
  const std::string layout = what + " must be a quantized packed weight: codes int8 [N / P, K, P] or uint8 "
                             "[N / P, K / 2, P] (int4) and scales [N / P, K / G, S, P] float32 or float16 "
                             "(S = 1, or 2 with offsets), of the expected shape";
  if (!scales || wd.size() != 3 || wd[2] != kPanel || wd[0] * kPanel < min_n || K <= 0 ||
      wd[1] != (int4 ? K / 2 : K) || (int4 && K % 2)) {
    return ffi::Error::InvalidArgument(layout);
  }
  auto sd = scales->dimensions();
  if (sd.size() != 4 || sd[0] != wd[0] || sd[1] < 1 || K % sd[1] || sd[3] != kPanel || sd[2] < 1 ||
      sd[2] > 2 || (int4 && (K / sd[1]) % 2) ||
      (scales->element_type() != ffi::DataType::F32 && scales->element_type() != ffi::DataType::F16)) {
    return ffi::Error::InvalidArgument(layout);
  }
  Job job{w.untyped_data(), false, wd[0], out};
  job.codes = !int4 ? Codes::kInt8 : sd[2] == 2 ? Codes::kUint4 : Codes::kInt4;
  job.scales = scales->untyped_data();
  job.f16_scales = scales->element_type() == ffi::DataType::F16;
  job.group = K / sd[1];
  job.ns = sd[2];
  job.quads = (quads >> (int4 ? 0 : 1)) & 1;
  if (job.quads && (int4 ? !JSERVE_INT_DOT || job.group % 8 : JSERVE_INT_DOT != 1 || job.group % 4)) {
    return ffi::Error::InvalidArgument(what + ": codes stored as quads need a build's integer path (int8: "
                                       "AVX-512 VNNI's) and groups of a multiple of 8 rows (int8: 4)");
  }
  return job;
}

}  // namespace jserve_native

#endif  // JSERVE_PACKED_JOB_H_
