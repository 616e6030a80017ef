// Which kernels a build holds. JSERVE_NATIVE_QUANT=0: the float kernels only, a float model's,
// in about half the compile time; build.py builds that variant first and the one with the
// quantized kernels too (=1, the default here) when a quantized weight or page first needs it.
// Without them PackedJob (packed_job.h) refuses a quantized weight and the paged attention
// quantized pages.
#ifndef JSERVE_VARIANT_H_
#define JSERVE_VARIANT_H_

#ifndef JSERVE_NATIVE_QUANT
#define JSERVE_NATIVE_QUANT 1
#endif

#endif  // JSERVE_VARIANT_H_
