// The CPU's int8 dot-product peak, the compute floor of quant_dot.h's AVX-512 VNNI kernel: 12
// independent VPDPBUSD (zmm) chains per thread, 64 MACs each, on 1 .. T threads.
//   g++ -O2 -march=native -pthread benchmarks/kernels/vnni_peak.cc -o /tmp/vnni_peak && /tmp/vnni_peak 2
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static int Chains(long n) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  __m512i b = _mm512_set1_epi8(1);
  const __m512i c = _mm512_set1_epi8(2);
  for (long i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbusd_epi32(a[j], b, c);
    __asm__ volatile("" : "+v"(b));  // keeps the loop from being folded
  }
  int s = 0;
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(a[i]);
  return s;
}

int main(int argc, char** argv) {
  const int max_threads = argc > 1 ? atoi(argv[1]) : 2;
  const long n = 100000000;
  for (int t = 1; t <= max_threads; ++t) {
    std::vector<std::thread> threads;
    std::vector<int> sink(t);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < t; ++i) threads.emplace_back([&sink, i, n] { sink[i] = Chains(n); });
    for (auto& th : threads) th.join();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("threads %d: %.1f G int8 MAC/s (%.2f VPDPBUSD zmm per ns per thread)\n", t,
                n * 12.0 * 64 * t / dt / 1e9, n * 12.0 / dt / 1e9);
  }
}
