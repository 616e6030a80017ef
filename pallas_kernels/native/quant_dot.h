// Integer dot products for quantized panels (packed_matmul.h's "quantized panels") at several rows of
// x: the activations quantized once per call to int8 per block of kActBlock columns of K
// (ActQuant), then, per panel, each block of the panel's codes rearranged once into the VNNI layout
// (4 consecutive k of a column in one 32-bit lane, as bytes) for all M rows, and integer sums:
//   o[m, n] = sum_g w_scale[g, n] * sum_{b in g} x_scale[m, b] * (sum_{k in b} q[m, k] * u[k, n]
//             - bias * qsum[m, b])  (+ (w_offset[g, n] + 8 w_scale[g, n]) * xsum[m, b])
// where u is the weight's code as the kernel reads it (int4: the nibble as packed, bias 8: a
// symmetric code + 8, or an unsigned code, then centred; int8: with AVX-512 code + 128, bias 128;
// with AVX2 the signed code, bias 0), qsum the block's sum of q and xsum its float sum of x. The
// offset term is not quantized, and unsigned codes are centred so that the activations' rounding
// multiplies |code - 8| * scale (about |w|), not the code's up to 15. Every integer sum is exact,
// so numerics differ from the float path by the activations' rounding only:
// |q * x_scale - x| <= x_scale / 2 per element, x_scale = max |x| over the block / 127.
// JSERVE_INT_DOT: 1, AVX-512 with VNNI and VBMI (VPDPBUSD: unsigned x signed bytes to int32);
// 2, AVX2 (VPMADDUBSW: unsigned x signed byte pairs to int16, then VPMADDWD by ones to int32);
// 0, neither: the float path runs whatever is asked. Included by packed_matmul.h inside namespace
// jserve_native, after Simd and kPanel, before Job.

#if defined(JSERVE_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__)
#define JSERVE_INT_DOT 1
#elif defined(JSERVE_SIMD) && !defined(__AVX512F__) && defined(__AVX2__)
#define JSERVE_INT_DOT 2
#else
#define JSERVE_INT_DOT 0
#endif

// Columns of K per activation scale: a weight group's own size where it is smaller (a multiple of
// 4), else 32 (llama.cpp's Q8_0 block); a group larger than 32 must be a multiple of it.
constexpr int64_t kActBlock = 32;

inline int64_t ActBlockFor(int64_t group) { return group < kActBlock ? group : kActBlock; }

// Whether the integer path takes a weight of this group size with activation blocks of `block`.
inline bool IntDotTakes(int64_t group, int64_t block) {
  return JSERVE_INT_DOT && block > 0 && block % 4 == 0 && group % block == 0;
}

// x [M, K] quantized per row and block of B columns: q = round(x / scale) in [-127, 127] (nearest,
// ties to even), scale = max |x| / 127 (0 for an all-zero block, whose q are 0).
struct ActQuant {
  int64_t M = 0, K = 0, B = 0;
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> scale;    // [M, K / B]
  std::vector<int32_t> qsum;   // [M, K / B]: the block's sum of q
  std::vector<float> xsum;     // [M, K / B]: the block's float sum of x (offsets)

  void Resize(int64_t m, int64_t k, int64_t b) {
    M = m, K = k, B = b;
    if (static_cast<int64_t>(q.size()) < M * K) q.resize(M * K);
    const int64_t nb = M * (K / B);
    if (static_cast<int64_t>(scale.size()) < nb) {
      scale.resize(nb);
      qsum.resize(nb);
      xsum.resize(nb);
    }
  }

  // Row m of x (K floats).
  void QuantizeRow(int64_t m, const float* x) {
    const int64_t nb = K / B;
    int8_t* qm = q.data() + m * K;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    // Blocks of 32 (the usual B) in two vectors: the loops below did not vectorize their rounding
    // (4 % of a 16-row int8 decode step). The same results: VCVTPS2DQ rounds to nearest even, as
    // nearbyint does in the default rounding mode; the float sum adds in another order.
    if (B == 32) {
      const __m512 sign = _mm512_set1_ps(-0.0f);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      for (int64_t b = 0; b < nb; ++b) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
        const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        const __m512i q0 =
            _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
        const __m512i q1 =
            _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qm + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qm + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        scale[m * nb + b] = amax / 127.0f;
        qsum[m * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        xsum[m * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
      }
      return;
    }
#endif
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + b * B;
      float amax = 0.0f, sum = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : sum)
      for (int64_t k = 0; k < B; ++k) {
        amax = std::max(amax, std::fabs(xb[k]));
        sum += xb[k];
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t qs = 0;
#pragma omp simd reduction(+ : qs)
      for (int64_t k = 0; k < B; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
        const int32_t c = std::min(127, std::max(-127, v));
        qm[b * B + k] = static_cast<int8_t>(c);
        qs += c;
      }
      scale[m * nb + b] = amax / 127.0f;
      qsum[m * nb + b] = qs;
      xsum[m * nb + b] = sum;
    }
  }
};

#if JSERVE_INT_DOT
// Stored quads at 2 rows of x or more: the first row block prefetches into L2 the codes this many
// bytes ahead (the rest of the panel, then the next panel's), so they stream from memory while the
// dot products run: one thread at 16 rows ran at 97 G MAC/s without it, 127 with it, 152 from L2;
// at one row the hardware prefetcher alone is faster (docs/performance.md, "Int8 activations and
// integer dot products").
constexpr int64_t kIntPrefetch = 16384;
constexpr int64_t kIntChunk = 128;  // rows of K rearranged at a time (a multiple of every block)
// Rows of x per micro-kernel: AVX-512, 12 int32 + 12 float sums of 32 registers; AVX2 (one vector
// of columns at a time), int4 6 integer + 6 float sums of 16, int8 (two more vectors) 5.
template <Codes C>
constexpr int kIntMR = JSERVE_INT_DOT == 2 ? (C == Codes::kInt8 ? 5 : 6) : 4;
constexpr int64_t kQuad = 4 * Simd::kLanes;  // bytes of a vector of quads: kLanes columns x 4 k
// ToVnni's copies of a chunk: AVX2's int8 codes take two, the signed codes and their absolute values.
constexpr int64_t kIntCopies = JSERVE_INT_DOT == 2 ? 2 : 1;
#endif

// QuadCodes: codes stored at pack time for the integer kernels (`PackedQuantized.quads`,
// matmul.py), where every row count takes the integer path. int4: per 8 rows of K (an octet t) and
// vector v of L = kLanes columns, 4 L bytes, byte 4j + i holding row 8t + i of column Lv + j in its
// low nibble and row 8t + 4 + i in its high one; a panel's octets one after the other, 4 kPanel
// bytes each (the size of the pairs layout). int8 (AVX-512 VNNI builds): ToVnni's output over all
// of K, per 4 rows r and vector v, byte 4j + i = row 4r + i of column Lv + j, plus 128. A call then
// splits nibbles, or reads the codes as they are, instead of rearranging (ToVnni): at one row that
// was most of the work (benchmarks/kernels/int_dot_layout.cc). Only the integer path reads them.

#if JSERVE_INT_DOT == 1

// Rows [k0, k0 + kl) of a panel's codes (kl a multiple of 4) into buf [kl / 4][kPanel][4] unsigned
// bytes: lane j of quad r holds column j's rows 4r .. 4r + 3, in order.
template <Codes C>
inline void ToVnni(const uint8_t* codes, int64_t k0, int64_t kl, uint8_t* buf) {
  if constexpr (C == Codes::kInt8) {
    // Four rows' 16 bytes of a vector's columns as the 4 lanes of a zmm, then byte 4j + i <- row
    // i's byte j; + 128 makes the signed codes unsigned.
    alignas(64) static const uint8_t kIdx[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
        6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
        12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i idx = _mm512_load_si512(kIdx);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t r = 0; r < kl / 4; ++r) {
      const uint8_t* c = codes + (k0 + 4 * r) * kPanel;
      for (int v = 0; v < 3; ++v) {
        const uint8_t* cv = c + 16 * v;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cv)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(cv + kPanel)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(cv + 2 * kPanel)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(cv + 3 * kPanel)), 3);
        z = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, z), flip);
        _mm512_store_si512(buf + (r * 3 + v) * kQuad, z);
      }
    }
  } else {
    // Byte rows 2r (rows 4r, 4r + 1 as low / high nibbles) and 2r + 1 (4r + 2, 4r + 3): each
    // column's two bytes as [b0, b0, b1, b1], then the even bytes' low nibbles, the odd bytes' high.
    alignas(64) static const uint8_t kIdx[64] = {
        0, 0, 16, 16, 1, 1, 17, 17, 2, 2, 18, 18, 3, 3, 19, 19, 4, 4, 20, 20, 5, 5, 21, 21,
        6, 6, 22, 22, 7, 7, 23, 23, 8, 8, 24, 24, 9, 9, 25, 25, 10, 10, 26, 26, 11, 11, 27, 27,
        12, 12, 28, 28, 13, 13, 29, 29, 14, 14, 30, 30, 15, 15, 31, 31};
    const __m512i idx = _mm512_load_si512(kIdx);
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t r = 0; r < kl / 4; ++r) {
      const uint8_t* c = codes + (k0 / 2 + 2 * r) * kPanel;
      for (int v = 0; v < 3; ++v) {
        const uint8_t* cv = c + 16 * v;
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cv)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(cv + kPanel)), 1);
        const __m512i d = _mm512_permutexvar_epi8(idx, z);
        const __m512i lo = _mm512_and_si512(d, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(d, 4), low);
        _mm512_store_si512(buf + (r * 3 + v) * kQuad, _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, lo, hi));
      }
    }
  }
}

// The 3 code vectors at p (a panel's row of quads) into L2 (kIntPrefetch).
inline __attribute__((always_inline)) void PrefetchQuads(const uint8_t* p) {
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) _mm_prefetch(reinterpret_cast<const char*>(p + v * kQuad), _MM_HINT_T1);
}

// acc[m][v] += the 3 code vectors w[v] . row m's quad of activations (x + 4 k, rows K apart),
// broadcast: one VPDPBUSD per vector.
template <int MR>
inline __attribute__((always_inline)) void DotQuad(__m512i (&acc)[MR][3], const __m512i (&w)[3],
                                                   const int8_t* __restrict x, int64_t K) {
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m) {
    int32_t quad;
    std::memcpy(&quad, x + m * K, 4);
    const __m512i xb = _mm512_set1_epi32(quad);
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) acc[m][v] = _mm512_dpbusd_epi32(acc[m][v], w[v], xb);
  }
}

// MR rows of x against [kl, kPanel] rearranged codes (buf) starting at row k0 of K: the float
// sums o[MR][kPanel] (rows ldo apart) accumulated (or started, `init`) over the chunk's blocks.
template <int MR, Codes C, typename S, bool kQuads>
inline __attribute__((always_inline)) void IntKernel(const ActQuant& aq, int64_t m0, int64_t k0, int64_t kl,
                                                     const uint8_t* __restrict buf, const S* __restrict scales,
                                                     int64_t G, int64_t ns, float* __restrict o, int64_t ldo,
                                                     bool init, int64_t pf) {
  constexpr int L = Simd::kLanes;
  constexpr int32_t kBias = C == Codes::kInt8 ? 128 : 8;
  const int64_t B = aq.B, K = aq.K, nb = K / B;
  __m512 f[MR][3];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) f[m][v] = init ? _mm512_setzero_ps() : _mm512_loadu_ps(o + m * ldo + L * v);
  for (int64_t kb = 0; kb < kl; kb += B) {
    const int64_t b = (k0 + kb) / B, g = (k0 + kb) / G;
    __m512i acc[MR][3];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512i start = _mm512_set1_epi32(-kBias * aq.qsum[(m0 + m) * nb + b]);
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) acc[m][v] = start;
    }
    const uint8_t* wb = buf + kb / 4 * 3 * kQuad;
    const int8_t* qb = aq.q.data() + m0 * K + k0 + kb;
    if constexpr (kQuads) {  // the codes as stored (QuadCodes): two quads per load, one in each nibble
      const __m512i low = _mm512_set1_epi8(0x0f);
      const uint8_t* cb = buf + kb / 2 * kPanel;  // octet t at cb + t * 3 kQuad
      // Low nibbles (rows 8t .. 8t + 3), then high (8t + 4 .. 8t + 7): 3 code vectors live beside
      // the 12 integer and 12 float sums.
      for (int64_t h = 0; h < B / 4; ++h) {
        const int64_t t = h / 2;
        __m512i w[3];
        if (pf && h % 2 == 0) PrefetchQuads(cb + t * 3 * kQuad + pf);
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) {
          const __m512i c = _mm512_loadu_si512(cb + (t * 3 + v) * kQuad);
          w[v] = _mm512_and_si512(h % 2 ? _mm512_srli_epi16(c, 4) : c, low);
        }
        DotQuad<MR>(acc, w, qb + 4 * h, K);
      }
    }
    for (int64_t r = 0; r < (kQuads ? 0 : B / 4); ++r) {
      __m512i w[3];
      if (pf) PrefetchQuads(wb + r * 3 * kQuad + pf);
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) w[v] = _mm512_loadu_si512(wb + (r * 3 + v) * kQuad);  // stored quads: unaligned
      DotQuad<MR>(acc, w, qb + 4 * r, K);
    }
    const S* sg = scales + g * ns * kPanel;
    __m512 ws[3];
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) ws[v] = Simd::Load(sg + L * v);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m512 sx = _mm512_set1_ps(aq.scale[(m0 + m) * nb + b]);
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) {
        f[m][v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[m][v]), sx), ws[v], f[m][v]);
      }
    }
    if (ns == 2) {  // offsets: (offset + 8 scale, the codes' centring) * the block's float sum of x
      const __m512 eight = _mm512_set1_ps(8.0f);
#pragma GCC unroll 3
      for (int v = 0; v < 3; ++v) ws[v] = _mm512_fmadd_ps(eight, ws[v], Simd::Load(sg + kPanel + L * v));
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(aq.xsum[(m0 + m) * nb + b]);
#pragma GCC unroll 3
        for (int v = 0; v < 3; ++v) f[m][v] = _mm512_fmadd_ps(ws[v], xs, f[m][v]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v) _mm512_storeu_ps(o + m * ldo + L * v, f[m][v]);
}

#elif JSERVE_INT_DOT == 2

// Rows [k0, k0 + kl) of a panel's codes (kl a multiple of 4) into buf [kl / 4][kPanel][4] bytes:
// lane j of quad r holds column j's rows 4r .. 4r + 3, in order; int8: the signed codes, then at
// buf + kl * kPanel the same quads' absolute values (|-128| reads as 128 unsigned).
template <Codes C>
inline void ToVnni(const uint8_t* codes, int64_t k0, int64_t kl, uint8_t* buf) {
  for (int64_t r = 0; r < kl / 4; ++r) {
    for (int v = 0; v < 3; ++v) {
      __m256i z;
      if constexpr (C == Codes::kInt8) {
        // A 4 x 8 byte transpose: rows 4r .. 4r + 3 of the vector's 8 columns.
        const uint8_t* cv = codes + (k0 + 4 * r) * kPanel + 8 * v;
        auto row = [&](int i) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cv + i * kPanel)); };
        const __m128i ab = _mm_unpacklo_epi8(row(0), row(1)), cd = _mm_unpacklo_epi8(row(2), row(3));
        z = _mm256_set_m128i(_mm_unpackhi_epi16(ab, cd), _mm_unpacklo_epi16(ab, cd));
        _mm256_store_si256(reinterpret_cast<__m256i*>(buf + kl * kPanel + (r * 3 + v) * kQuad), _mm256_abs_epi8(z));
      } else {
        // Byte rows 2r (rows 4r, 4r + 1 as low / high nibbles) and 2r + 1 (4r + 2, 4r + 3) of the
        // vector's 8 columns; each byte twice in a 16-bit lane, then its low nibble in the lane's
        // low byte and its high nibble in the high byte ((a + 256 a) >> 4 has a's high nibble there).
        const uint8_t* cv = codes + (k0 / 2 + 2 * r) * kPanel + 8 * v;
        const __m128i ab = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cv)),
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(cv + kPanel)));
        const __m256i idx = _mm256_setr_epi8(0, 0, 8, 8, 1, 1, 9, 9, 2, 2, 10, 10, 3, 3, 11, 11,
                                             4, 4, 12, 12, 5, 5, 13, 13, 6, 6, 14, 14, 7, 7, 15, 15);
        const __m256i d = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(ab), idx);
        z = _mm256_or_si256(_mm256_and_si256(d, _mm256_set1_epi16(0x000f)),
                            _mm256_and_si256(_mm256_srli_epi16(d, 4), _mm256_set1_epi16(0x0f00)));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf + (r * 3 + v) * kQuad), z);
    }
  }
}

// MR rows of x against vector v (kLanes columns) of [kl, kPanel] rearranged codes (buf) starting at
// row k0 of K: the float sums o[MR][L v .. L v + L) (rows ldo apart) accumulated (or started,
// `init`) over the chunk's blocks. One vector at a time keeps the MR float sums in registers across
// blocks beside the MR integer ones (16 registers: 3 vectors x 4 rows spilled the integer sums and
// ran no faster than the float path). int4: the nibbles (unsigned) x q (signed) by VPMADDUBSW,
// |pair| <= 2 * 15 * 127, so a block's up to 8 quads add in int16 (<= 30480) before one VPMADDWD.
// int8: the codes' 0..255 unsigned would saturate VPMADDUBSW, so |code| is the unsigned side and q
// takes the code's sign (VPSIGNB; q is never -128): |pair| <= 2 * 128 * 127 = 32512, one VPMADDWD
// per quad.
template <int MR, Codes C, typename S, bool kQuads>
inline __attribute__((always_inline)) void IntKernelV(const ActQuant& aq, int64_t m0, int64_t k0, int64_t kl, int v,
                                                      const uint8_t* __restrict buf, const S* __restrict scales,
                                                      int64_t G, int64_t ns, float* __restrict o, int64_t ldo,
                                                      bool init) {
  constexpr int L = Simd::kLanes;
  constexpr bool kInt8 = C == Codes::kInt8;
  const int64_t B = aq.B, K = aq.K, nb = K / B;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 f[MR];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) f[m] = init ? _mm256_setzero_ps() : _mm256_loadu_ps(o + m * ldo + L * v);
  for (int64_t kb = 0; kb < kl; kb += B) {
    const int64_t b = (k0 + kb) / B, g = (k0 + kb) / G;
    __m256i acc[MR];
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_si256();
    const uint8_t* wb = buf + kb / 4 * 3 * kQuad + v * kQuad;
    const int8_t* qb = aq.q.data() + m0 * K + k0 + kb;
    if constexpr (kQuads) {  // the codes as stored (QuadCodes): two quads per load, one in each nibble
      const __m256i low = _mm256_set1_epi8(0x0f);
      const uint8_t* cb = buf + kb / 2 * kPanel + v * kQuad;  // octet t at cb + t * 3 kQuad
      for (int64_t t = 0; t < B / 8; ++t) {
        const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + t * 3 * kQuad));
        const __m256i w0 = _mm256_and_si256(c, low), w1 = _mm256_and_si256(_mm256_srli_epi16(c, 4), low);
#pragma GCC unroll 6
        for (int m = 0; m < MR; ++m) {
          int32_t q0, q1;
          std::memcpy(&q0, qb + m * K + 8 * t, 4);
          std::memcpy(&q1, qb + m * K + 8 * t + 4, 4);
          acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(q0)));
          acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(q1)));
        }
      }
    }
    for (int64_t r = 0; r < (kQuads ? 0 : B / 4); ++r) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + r * 3 * kQuad));
#pragma GCC unroll 6
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, qb + m * K + 4 * r, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
        if constexpr (kInt8) {
          const __m256i aw = _mm256_load_si256(reinterpret_cast<const __m256i*>(wb + kl * kPanel + r * 3 * kQuad));
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, w));
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
        } else {
          acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(w, xb));
        }
      }
    }
    const S* sg = scales + g * ns * kPanel + L * v;
    const __m256 ws = Simd::Load(sg);
    const __m256 wo = ns == 2 ? _mm256_fmadd_ps(_mm256_set1_ps(8.0f), ws, Simd::Load(sg + kPanel)) : ws;
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const int64_t mb = (m0 + m) * nb + b;
      const __m256i s32 = kInt8 ? acc[m]
                                : _mm256_add_epi32(_mm256_madd_epi16(acc[m], ones), _mm256_set1_epi32(-8 * aq.qsum[mb]));
      f[m] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32), _mm256_set1_ps(aq.scale[mb])), ws, f[m]);
      if (ns == 2) f[m] = _mm256_fmadd_ps(wo, _mm256_set1_ps(aq.xsum[mb]), f[m]);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(o + m * ldo + L * v, f[m]);
}

template <int MR, Codes C, typename S, bool kQuads>
inline __attribute__((always_inline)) void IntKernel(const ActQuant& aq, int64_t m0, int64_t k0, int64_t kl,
                                                     const uint8_t* __restrict buf, const S* __restrict scales,
                                                     int64_t G, int64_t ns, float* __restrict o, int64_t ldo,
                                                     bool init, int64_t pf) {
  (void)pf;  // kIntPrefetch was measured with AVX-512 only: these keep to the hardware prefetcher
  for (int v = 0; v < 3; ++v) IntKernelV<MR, C, S, kQuads>(aq, m0, k0, kl, v, buf, scales, G, ns, o, ldo, init);
}
#endif  // JSERVE_INT_DOT == 2

#if JSERVE_INT_DOT
template <int R, Codes C, typename S, bool kQuads>
inline void IntRows(int rows, const ActQuant& aq, int64_t m0, int64_t k0, int64_t kl, const uint8_t* buf,
                    const S* scales, int64_t G, int64_t ns, float* o, int64_t ldo, bool init, int64_t pf = 0) {
  if constexpr (R > 1) {
    if (rows < R) return IntRows<R - 1, C, S, kQuads>(rows, aq, m0, k0, kl, buf, scales, G, ns, o, ldo, init, pf);
  }
  IntKernel<R, C, S, kQuads>(aq, m0, k0, kl, buf, scales, G, ns, o, ldo, init, pf);
}

// All aq.M rows against one quantized panel (codes and scales as PackedQuantPanel's, or int4 codes
// stored as quads where `quads`: QuadCodes) into o[:, 0:kPanel], rows ldo apart. Needs
// IntDotTakes(G, aq.B).
template <Codes C, typename S>
void PackedQuantPanelInt(const ActQuant& aq, const uint8_t* codes, const S* scales, int64_t G, int64_t ns,
                         float* o, int64_t ldo, bool quads = false) {
  const int64_t M = aq.M, K = aq.K;
  // Chunks of whole blocks: kIntChunk rows, or fewer at K's end.
  const int64_t chunk = kIntChunk / aq.B * aq.B;
  alignas(64) uint8_t buf[kIntCopies * kIntChunk * kPanel];
  // The sums go to a tile of rows kPanel apart, copied to o at the end (PackedQuantPanel's reason).
  thread_local std::vector<float> tile_buf;
  if (static_cast<int64_t>(tile_buf.size()) < M * kPanel) tile_buf.resize(M * kPanel);
  float* tile = tile_buf.data();
  for (int64_t k0 = 0; k0 < K; k0 += chunk) {
    const int64_t kl = std::min(chunk, K - k0);
#if JSERVE_INT_DOT == 1
    if constexpr (C == Codes::kInt8) {
      if (quads) {  // the codes as ToVnni would write them
        for (int64_t m = 0; m < M; m += kIntMR<C>) {
          IntRows<kIntMR<C>, C, S, false>(static_cast<int>(std::min<int64_t>(kIntMR<C>, M - m)), aq, m, k0, kl,
                                          codes + k0 * kPanel, scales, G, ns, tile + m * kPanel, kPanel, k0 == 0,
                                          m == 0 && M > 1 ? kIntPrefetch : 0);
        }
        continue;
      }
    }
#endif
    if constexpr (C != Codes::kInt8) {
      if (quads) {
        for (int64_t m = 0; m < M; m += kIntMR<C>) {
          IntRows<kIntMR<C>, C, S, true>(static_cast<int>(std::min<int64_t>(kIntMR<C>, M - m)), aq, m, k0, kl,
                                         codes + k0 / 2 * kPanel, scales, G, ns, tile + m * kPanel, kPanel, k0 == 0,
                                         m == 0 && M > 1 ? kIntPrefetch : 0);
        }
        continue;
      }
    }
    ToVnni<C>(codes, k0, kl, buf);
    for (int64_t m = 0; m < M; m += kIntMR<C>) {
      IntRows<kIntMR<C>, C, S, false>(static_cast<int>(std::min<int64_t>(kIntMR<C>, M - m)), aq, m, k0, kl, buf,
                                      scales, G, ns, tile + m * kPanel, kPanel, k0 == 0);
    }
  }
  for (int64_t m = 0; m < M; ++m) std::memcpy(o + m * ldo, tile + m * kPanel, kPanel * sizeof(float));
}
#endif  // JSERVE_INT_DOT
