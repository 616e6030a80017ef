// The AVX2 int4 integer path alone, one thread, against two alternatives, on random Q4_1-form
// panels (576 rows, float16 scales and offsets): "int+ToVnni", the kernel as built (quant_dot.h:
// each call rearranges every panel's codes into quads); "float", the float path (packed_matmul.h);
// "pre-arranged", a kernel over codes stored at pack time in a nibble-split quad layout (per 8 rows
// of K and vector of 8 columns, 32 bytes: byte 4j + i holds row 8t + i of column j in its low
// nibble and row 8t + 4 + i in its high one), so a call only splits nibbles (an AND, a shift and
// an AND per two vectors). The engine stores int4 codes so where every row count takes the AVX2
// integer path (`PackedQuantized.quads`, quant_dot.h's QuadCodes); this harness keeps the three
// kernels side by side (docs/performance.md, Integer dot products with AVX2).
// Build and run on an AVX2 machine (M rows of x, P panels: 64 stay in L2, 2048 stream from memory;
// on an AVX-512 machine -march=x86-64-v3 instead of native builds the AVX2 kernels):
//   g++ -O3 -ffast-math -fopenmp-simd -std=c++17 -march=native -Ipallas_kernels/native \
//       benchmarks/kernels/int_dot_layout.cc -o /tmp/int_dot_layout && /tmp/int_dot_layout M P
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define JSERVE_NATIVE_QUANT 1
#include "packed_matmul.h"
using namespace jserve_native;

// codes pre-arranged: per panel, per 8 rows of K (two quads), per vector v: 32 bytes; byte 4j+i:
// low nibble = row 8t+i of column 8v+j, high nibble = row 8t+4+i.
template <int MR>
inline void PreKernelV(const ActQuant& aq, int64_t m0, int v, const uint8_t* codes, const Half* scales, float* o, int64_t ldo) {
  const int64_t B = 32, K = aq.K, nb = K / B;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
  __m256 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_si256();
    const uint8_t* cb = codes + b * 4 * 3 * 32 + v * 32;  // 4 octets of rows per block
    for (int t = 0; t < 4; ++t) {
      const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(cb + t * 3 * 32));
      const __m256i lo = _mm256_and_si256(c, low), hi = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
      for (int m = 0; m < MR; ++m) {
        int32_t q0, q1;
        std::memcpy(&q0, aq.q.data() + (m0 + m) * K + b * B + 8 * t, 4);
        std::memcpy(&q1, aq.q.data() + (m0 + m) * K + b * B + 8 * t + 4, 4);
        acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(q0)));
        acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q1)));
      }
    }
    const Half* sg = scales + b * 2 * kPanel + 8 * v;
    const __m256 ws = Simd::Load(sg);
    const __m256 wo = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), ws, Simd::Load(sg + kPanel));
    for (int m = 0; m < MR; ++m) {
      const int64_t mb = (m0 + m) * nb + b;
      const __m256i s32 = _mm256_add_epi32(_mm256_madd_epi16(acc[m], ones), _mm256_set1_epi32(-8 * aq.qsum[mb]));
      f[m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(aq.scale[mb])), ws, f[m]);
      f[m] = _mm256_fmadd_ps(wo, _mm256_set1_ps(aq.xsum[mb]), f[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(o + m * ldo + 8 * v, f[m]);
}

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? atoi(argv[1]) : 16, K = 576, P = argc > 2 ? atoi(argv[2]) : 64;
  std::vector<float> x(M * K);
  for (auto& v : x) v = (rand() % 2000 - 1000) / 100.0f;
  std::vector<uint8_t> codes(P * K / 2 * kPanel);
  for (auto& c : codes) c = rand();
  std::vector<uint8_t> pre(P * K / 2 * kPanel + 64);
  uint8_t* pa = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(pre.data()) + 63) & ~uintptr_t(63));
  for (size_t i = 0; i < codes.size(); ++i) pa[i] = codes[i];  // the values do not matter for timing
  std::vector<Half> scales(P * K / 32 * 2 * kPanel);
  for (auto& s : scales) s.bits = 0x3c00;
  std::vector<float> out(M * P * kPanel);
  ActQuant aq; aq.Resize(M, K, 32);
  for (int m = 0; m < M; ++m) aq.QuantizeRow(m, x.data() + m * K);
  const int iters = 2000;
  for (int round = 0; round < 2; ++round)
  for (int mode = 0; mode < 3; ++mode) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < iters; ++it)
      for (int64_t p = 0; p < P; ++p) {
        const uint8_t* c = codes.data() + p * K / 2 * kPanel;
        const Half* s = scales.data() + p * K / 32 * 2 * kPanel;
        float* o = out.data() + p * kPanel;
        if (mode == 0) PackedQuantPanelInt<Codes::kUint4>(aq, c, s, 32, 2, o, P * kPanel);
        else if (mode == 1) PackedQuantPanel<Codes::kUint4>(M, K, x.data(), c, s, 32, 2, o, P * kPanel);
        else {
          const uint8_t* pc = pa + p * K / 2 * kPanel;
          for (int64_t m = 0; m < M; m += 6) {
            const int r = std::min<int64_t>(6, M - m);
            for (int v = 0; v < 3; ++v) {
              if (r == 6) PreKernelV<6>(aq, m, v, pc, s, o + m * P * kPanel, P * kPanel);
              else if (r == 1) PreKernelV<1>(aq, m, v, pc, s, o + m * P * kPanel, P * kPanel);
              else if (r == 4) PreKernelV<4>(aq, m, v, pc, s, o + m * P * kPanel, P * kPanel);
              else PreKernelV<2>(aq, m, v, pc, s, o + m * P * kPanel, P * kPanel);
            }
          }
        }
      }
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double macs = double(iters) * P * M * K * kPanel;
    printf("%-11s M=%ld: %5.1f GMAC/s, %.2f us/panel, %.1f GB/s of codes\n", mode == 0 ? "int+ToVnni" : mode == 1 ? "float" : "pre-arranged", M,
           macs / dt / 1e9, dt / iters / P * 1e6, double(iters) * P * K / 2 * kPanel / dt / 1e9);
  }
}
