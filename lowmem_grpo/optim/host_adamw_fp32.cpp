// torch's fused CPU AdamW on fp32 masters for the offloaded optimizer's host step (loader, semantics and
// tests: host_adamw.py, HostAdamW): reads a bf16 or fp32 gradient and optionally writes the new master rounded
// to bf16 into an upload buffer in the same pass. Plain C ABI; threads: host_pool.cpp. Built with
// -ffp-contract=off: fused multiply-adds are spelled out (std::fma) exactly where torch's kernels fuse.
// Operation order and where results may differ by an ulp: docs/memory-modes.md.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__) || defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "host_pool.h"

namespace {

using host_pool::parallel_for;

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float load(const float* x, int64_t i) { return x[i]; }
inline float load(const uint16_t* x, int64_t i) { return bits_to_float(static_cast<uint32_t>(x[i]) << 16); }  // bf16

// fp32 -> bf16 bits, round to nearest even (NaN stays NaN), as torch's fp32 -> bf16 copy.
inline uint16_t bf16_nearest(float x) {
  const uint32_t bits = float_to_bits(x);
  const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
  return static_cast<uint16_t>(nan ? (bits | 0x00400000U) >> 16 : (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16);
}

// torch's fused CPU AdamW on an fp32 master: its constants, rounded from doubles to fp32 as that kernel does
// (host_adamw.py computes the doubles as torch does).
struct AdamW32 {
  float beta2, one_minus_beta2;
  float lerp_coeff;            // exp_avg.lerp_(grad, w), w = 1 - beta1: w where |w| < 0.5, else w - 1
  int lerp_from_m;             // |w| < 0.5: m + w (g - m); else g + (w - 1)(g - m) (torch's two lerp forms)
  float correction2, eps;      // sqrt(1 - beta2^t), eps
  float neg_step_size, decay;  // -lr / (1 - beta1^t), 1 - lr * wd
  int decay_on;                // wd != 0
  float grad_scale;            // the clip coefficient
  int scale_on;                // grad_scale != 1
  int simd;
};

inline float scaled(float g, const AdamW32& k, const float*) { return g * k.grad_scale; }
// A bf16 gradient is scaled in fp32 and rounded back to bf16: what the in-place clip of the bf16 gradient
// buffer (grad.mul_(coef), offload.py) leaves for the step to read.
inline float scaled(float g, const AdamW32& k, const uint16_t*) {
  return bits_to_float(static_cast<uint32_t>(bf16_nearest(g * k.grad_scale)) << 16);
}

// Elements [from, to): the update of torch's fused kernel, op for op (its vector loop: the lerp as one fma,
// v * beta2 + (1 - beta2) * g * g contracted to one fma, correctly rounded sqrt and divisions).
template <typename G>
inline void adamw_scalar(int64_t from, int64_t to, float* p, const G* g, float* m, float* v, uint16_t* out,
                         const AdamW32& k) {
  for (int64_t i = from; i < to; ++i) {
    float gi = load(g, i);
    if (k.scale_on) gi = scaled(gi, k, g);
    float pi = p[i];
    if (k.decay_on) pi = pi * k.decay;                                                // decoupled weight decay
    const float mi = std::fma(k.lerp_coeff, gi - m[i], k.lerp_from_m ? m[i] : gi);   // exp_avg.lerp_(grad, w)
    const float vi = std::fma(k.one_minus_beta2 * gi, gi, v[i] * k.beta2);           // v * beta2 + (1 - beta2) g g
    const float denom = std::sqrt(vi) / k.correction2 + k.eps;
    pi = pi + k.neg_step_size * mi / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (out != nullptr) out[i] = bf16_nearest(pi);  // after g[i] was read: out may be the gradient's buffer
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same arithmetic, 16 lanes at a time.
constexpr int64_t kLanes = 16;

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512i bf16_nearest16(__m512 x) {  // bf16_nearest of 16 lanes: the bf16 bits in each 32-bit lane
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i out = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  out = _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_srli_epi32(out, 16);
}
inline __m512 scaled16(__m512 g, __m512 s, const float*) { return _mm512_mul_ps(g, s); }
inline __m512 scaled16(__m512 g, __m512 s, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_nearest16(_mm512_mul_ps(g, s)), 16));
}

template <typename G>
inline int64_t adamw_vector(int64_t from, int64_t to, float* p, const G* g, float* m, float* v, uint16_t* out,
                            const AdamW32& k) {
  const __m512 scale = _mm512_set1_ps(k.grad_scale), decay = _mm512_set1_ps(k.decay);
  const __m512 coeff = _mm512_set1_ps(k.lerp_coeff), b2 = _mm512_set1_ps(k.beta2);
  const __m512 ob2 = _mm512_set1_ps(k.one_minus_beta2), c2 = _mm512_set1_ps(k.correction2);
  const __m512 eps = _mm512_set1_ps(k.eps), step = _mm512_set1_ps(k.neg_step_size);
  const int64_t end = from + (to - from) / kLanes * kLanes;
  for (int64_t i = from; i < end; i += kLanes) {
    __m512 gi = load16(g + i);
    if (k.scale_on) gi = scaled16(gi, scale, g);
    __m512 pi = _mm512_loadu_ps(p + i);
    if (k.decay_on) pi = _mm512_mul_ps(pi, decay);
    const __m512 m0 = _mm512_loadu_ps(m + i);
    const __m512 mi = _mm512_fmadd_ps(coeff, _mm512_sub_ps(gi, m0), k.lerp_from_m ? m0 : gi);
    const __m512 vi = _mm512_fmadd_ps(_mm512_mul_ps(ob2, gi), gi, _mm512_mul_ps(_mm512_loadu_ps(v + i), b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), c2), eps);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(step, mi), denom));
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    if (out != nullptr)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(bf16_nearest16(pi)));
  }
  return end;
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same arithmetic, 8 lanes at a time, for CPUs without AVX-512.
constexpr int64_t kLanes = 8;

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i bf16_nearest8(__m256 x) {  // bf16_nearest of 8 lanes: the bf16 bits in each 32-bit lane
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i out = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  out = _mm256_blendv_epi8(out, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
  return _mm256_srli_epi32(out, 16);
}
inline __m256 scaled8(__m256 g, __m256 s, const float*) { return _mm256_mul_ps(g, s); }
inline __m256 scaled8(__m256 g, __m256 s, const uint16_t*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_nearest8(_mm256_mul_ps(g, s)), 16));
}

template <typename G>
inline int64_t adamw_vector(int64_t from, int64_t to, float* p, const G* g, float* m, float* v, uint16_t* out,
                            const AdamW32& k) {
  const __m256 scale = _mm256_set1_ps(k.grad_scale), decay = _mm256_set1_ps(k.decay);
  const __m256 coeff = _mm256_set1_ps(k.lerp_coeff), b2 = _mm256_set1_ps(k.beta2);
  const __m256 ob2 = _mm256_set1_ps(k.one_minus_beta2), c2 = _mm256_set1_ps(k.correction2);
  const __m256 eps = _mm256_set1_ps(k.eps), step = _mm256_set1_ps(k.neg_step_size);
  const int64_t end = from + (to - from) / kLanes * kLanes;
  for (int64_t i = from; i < end; i += kLanes) {
    __m256 gi = load8(g + i);
    if (k.scale_on) gi = scaled8(gi, scale, g);
    __m256 pi = _mm256_loadu_ps(p + i);
    if (k.decay_on) pi = _mm256_mul_ps(pi, decay);
    const __m256 m0 = _mm256_loadu_ps(m + i);
    const __m256 mi = _mm256_fmadd_ps(coeff, _mm256_sub_ps(gi, m0), k.lerp_from_m ? m0 : gi);
    const __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(ob2, gi), gi, _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), c2), eps);
    pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    _mm256_storeu_ps(p + i, pi);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    if (out != nullptr) {
      const __m256i h = bf16_nearest8(pi);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);  // 8 x u16, low half
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
    }
  }
  return end;
}
#else
template <typename G>
inline int64_t adamw_vector(int64_t from, int64_t, float*, const G*, float*, float*, uint16_t*, const AdamW32&) {
  return from;
}
#endif

constexpr int64_t kAdamWChunk = 1 << 14;  // elements per work item (64 KiB of each fp32 stream)

// Chunks are whole vectors, so only the tensor's last n % lanes elements take the scalar loop (as in torch).
template <typename G>
void adamw32(int64_t n, float* p, const G* g, float* m, float* v, uint16_t* out, const AdamW32& k, int threads) {
  parallel_for((n + kAdamWChunk - 1) / kAdamWChunk, threads, [&](int64_t c) {
    const int64_t from = c * kAdamWChunk, to = std::min(n, from + kAdamWChunk);
    const int64_t done = k.simd ? adamw_vector(from, to, p, g, m, v, out, k) : from;
    adamw_scalar(done, to, p, g, m, v, out, k);
  });
}

}  // namespace

extern "C" {

// torch's fused CPU AdamW step on fp32 weights `p` with fp32 states m, v; g_kind: 0 = fp32, 1 = bf16 gradient;
// `out`: a bf16 buffer for the new weights rounded to nearest even (may be the gradient's own buffer), or null.
// Returns 0, or -1 for a gradient dtype it does not handle.
int adamw_step(int64_t n, float* p, const void* g, int g_kind, float* m, float* v, uint16_t* out, float beta2,
               float one_minus_beta2, float lerp_weight, float correction2, float eps, float neg_step_size,
               float decay, int decay_on, float grad_scale, int simd, int threads) {
  const bool small = std::fabs(lerp_weight) < 0.5f;  // torch's lerp: the form that is exact at its end
  const AdamW32 k{beta2, one_minus_beta2, small ? lerp_weight : lerp_weight - 1.0f, small, correction2, eps,
                  neg_step_size, decay, decay_on, grad_scale, grad_scale != 1.0f, simd};
  if (g_kind == 0) adamw32(n, p, static_cast<const float*>(g), m, v, out, k, threads);
  else if (g_kind == 1) adamw32(n, p, static_cast<const uint16_t*>(g), m, v, out, k, threads);
  else return -1;
  return 0;
}

}  // extern "C"
