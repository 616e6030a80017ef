"""How fast this machine streams memory, against the packed matmul kernel at M rows.

Two C++ loops, built here with the native kernels' flags (`pallas_kernels.native.build.flags()`),
two threads each streaming its own buffer (huge pages advised):
  - `stream`: one 64-byte load per line, then `work` FMAs on registers (the arithmetic a matmul
    at M rows does per weight line: 16 at M = 16), with or without a software prefetch `--prefetch`
    bytes ahead; the machine's reachable bandwidth at that arithmetic density;
  - `packed`: `PackedPanel` from pallas_kernels/packed_matmul.h over 60 [576, 1536] float32
    weights (212 MB) at M rows (M FMAs per weight line), each thread a contiguous half of every weight's panels (no XLA,
    no other phases): what the kernel itself reaches.
The gap between the two at the same density is what a better micro-kernel could win. Best of 5
runs each (the machine is shared).

    python scripts/bench_native_bandwidth.py [--work 0 16 24] [--rows 1 8 16 32] [--out bw.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.native import build as native_build  # noqa: E402

SOURCE = r"""
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <sys/mman.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "packed_matmul.h"
using namespace jserve_native;

static float* Buffer(size_t bytes) {
  const size_t huge = size_t(2) << 20;
  float* p = static_cast<float*>(std::aligned_alloc(huge, (bytes + huge - 1) / huge * huge));
  madvise(p, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < bytes / 4; ++i) p[i] = 0.001f * (i % 7);
  return p;
}

template <int W>
float Stream(const float* p, size_t bytes, long pf) {
#if defined(__AVX512F__)
  __m512 a[8];
  for (auto& v : a) v = _mm512_setzero_ps();
  const __m512 s = _mm512_set1_ps(1.0001f);
  for (size_t off = 0; off < bytes; off += 64) {
    if (pf) _mm_prefetch(reinterpret_cast<const char*>(p) + off + pf, _MM_HINT_T1);
    const __m512 v = _mm512_load_ps(p + off / 4);
    a[0] = _mm512_add_ps(a[0], v);
#pragma GCC unroll 64
    for (int w = 0; w < W; ++w) a[1 + w % 7] = _mm512_fmadd_ps(a[1 + w % 7], s, v);
  }
  for (int i = 1; i < 8; ++i) a[0] = _mm512_add_ps(a[0], a[i]);
  return _mm512_reduce_add_ps(a[0]);
#else
  float acc[8] = {};
  for (size_t off = 0; off < bytes; off += 64) {
    if (pf) __builtin_prefetch(reinterpret_cast<const char*>(p) + off + pf, 0, 2);
    for (int i = 0; i < 16; ++i) acc[0] += p[off / 4 + i];
    for (int w = 0; w < W; ++w) acc[1 + w % 7] = acc[1 + w % 7] * 1.0001f + p[off / 4 + w % 16];
  }
  float t = 0;
  for (float v : acc) t += v;
  return t;
#endif
}

template <typename F>
double Best(F run, double bytes) {
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::thread a(run, 0), b(run, 1);
    a.join();
    b.join();
    best = std::max(best, bytes / std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 1e9);
  }
  return best;
}

int main(int argc, char** argv) {
  const std::string what = argv[1];
  if (what == "stream") {
    const int work = std::atoi(argv[2]);
    const long pf = std::atol(argv[3]);
    const size_t n = size_t(512) << 20;
    float* bufs[2] = {Buffer(n), Buffer(n)};
    volatile float sink = 0;
    auto run = [&](int t) {
      float r = 0;
      switch (work) {
        case 0: r = Stream<0>(bufs[t], n, pf); break;
        case 8: r = Stream<8>(bufs[t], n, pf); break;
        case 16: r = Stream<16>(bufs[t], n, pf); break;
        case 24: r = Stream<24>(bufs[t], n, pf); break;
        default: r = Stream<32>(bufs[t], n, pf); break;
      }
      sink = sink + r;
    };
    std::printf("%.2f\n", Best(run, 2.0 * n));
  } else {
    const int64_t M = std::atoi(argv[2]), K = 576, N = 1536, L = 60, P = N / kPanel;
    const size_t bytes = size_t(L) * P * K * kPanel * 4;
    float* w = Buffer(bytes);
    std::vector<float> x(M * K, 1.0f), out[2] = {std::vector<float>(M * N), std::vector<float>(M * N)};
    auto run = [&](int t) {
      for (int64_t l = 0; l < L; ++l)
        for (int64_t p = P * t / 2; p < P * (t + 1) / 2; ++p)
          PackedPanel(M, K, x.data(), w + (l * P + p) * K * kPanel, out[t].data() + p * kPanel, N);
    };
    std::printf("%.2f\n", Best(run, double(bytes)));
  }
}
"""

WORK = (0, 8, 16, 24, 32)


def build(workdir: Path) -> Path:
    src, exe = workdir / "bw.cc", workdir / "bw"
    src.write_text(SOURCE)
    compiler = os.environ.get("CXX") or "g++"
    cmd = [compiler, *native_build.flags(), "-pthread", "-I", str(native_build.HEADERS), str(src), "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return exe


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=int, nargs="*", default=[0, 16, 24], choices=WORK,
                        help="FMAs per 64-byte line in the stream loop")
    parser.add_argument("--prefetch", type=int, nargs="*", default=[0, 8192],
                        help="software prefetch distances (bytes) in the stream loop")
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 16, 32], help="M for the packed matmul")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        print("two threads, best of 5, GB/s")
        print(f"{'loop':<10}{'work/line':>10}{'prefetch':>10}{'rows':>6}{'GB/s':>8}")
        for work in args.work:
            for pf in args.prefetch:
                gbps = float(subprocess.run([str(exe), "stream", str(work), str(pf)], capture_output=True,
                                            text=True, check=True).stdout)
                results.append(dict(loop="stream", work=work, prefetch=pf, gbps=gbps))
                print(f"{'stream':<10}{work:>10}{pf:>10}{'':>6}{gbps:>8.1f}", flush=True)
        for rows in args.rows:
            gbps = float(subprocess.run([str(exe), "packed", str(rows)], capture_output=True, text=True,
                                        check=True).stdout)
            results.append(dict(loop="packed", rows=rows, gbps=gbps))
            print(f"{'packed':<10}{rows:>10}{'kernel':>10}{rows:>6}{gbps:>8.1f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(dict(flags=native_build.flags(), results=results), indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
