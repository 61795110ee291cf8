// The gradient's squared L2 norm for the offloaded optimizer's global norm (loader: host_adamw.py,
// grad_sum_squares): fp32 partial sums per 64Ki-element chunk, each from 16 running sums in a fixed order,
// added in chunk order in fp64, so the same bits for any thread count and any vector width.
// Threads: host_pool.cpp. Design notes: docs/memory-modes.md.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "host_pool.h"

namespace {

constexpr int64_t kNormChunk = 1 << 16;  // elements per fp32 partial sum of the norm
constexpr int64_t kSumLanes = 16;        // running fp32 sums per partial sum of the norm

inline float load(const float* x, int64_t i) { return x[i]; }
inline float load(const uint16_t* x, int64_t i) {  // bf16
  const uint32_t u = static_cast<uint32_t>(x[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

using host_pool::parallel_for;

template <typename G>
double sum_squares(int64_t n, const G* g, int threads) {
  const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
  double total = 0.0;
  double* partial = new double[chunks > 0 ? chunks : 1];
  parallel_for(chunks, threads, [&](int64_t c) {
    const int64_t start = c * kNormChunk, end = std::min(n, start + kNormChunk);
    // 16 running sums, element i into sum i % 16, then added pairwise (8 + 8, 4 + 4, 2 + 2, 1 + 1): the same
    // order for any vector width (one AVX-512 register, two AVX2 ones, or scalar code), so the same bits.
    alignas(64) float acc[kSumLanes] = {};
    const int64_t whole = start + (end - start) / kSumLanes * kSumLanes;
    for (int64_t i = start; i < whole; i += kSumLanes) {
#pragma omp simd
      for (int64_t j = 0; j < kSumLanes; ++j) {
        const float x = load(g, i + j);
        acc[j] += x * x;
      }
    }
    for (int64_t i = whole; i < end; ++i) {
      const float x = load(g, i);
      acc[i - whole] += x * x;
    }
    for (int64_t width = kSumLanes / 2; width > 0; width /= 2)
      for (int64_t j = 0; j < width; ++j) acc[j] += acc[j + width];
    partial[c] = acc[0];
  });
  for (int64_t c = 0; c < chunks; ++c) total += partial[c];
  delete[] partial;
  return total;
}

}  // namespace

extern "C" double grad_sum_squares(int64_t n, const void* g, int g_kind, int threads) {
  if (g_kind == 0) return sum_squares(n, static_cast<const float*>(g), threads);
  return sum_squares(n, static_cast<const uint16_t*>(g), threads);
}
