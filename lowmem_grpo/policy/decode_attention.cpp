// CPU attention of one decode step (loader, contract and tests: decode_attention.py). For every row s and
// K/V head h, the query heads of h's group attend over the row's L cached positions: scores in fp32, a
// softmax with its maximum subtracted, the values summed in fp32, the result rounded to the values' dtype.
// Each K/V head is read once for its whole group, straight from the (possibly strided) cache; masked
// positions are not read. Plain C ABI (ctypes releases the GIL); one (row, head) pair per work item, on
// OpenMP's threads where the build has OpenMP (torch's own team), else on host_pool.cpp's.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
#else
#define LANES 1
#endif
#if LANES > 1
#include <immintrin.h>
#endif

#include "../optim/host_pool.h"

namespace {

using host_pool::parallel_for;

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bits_to_float(static_cast<uint32_t>(x) << 16); }  // bf16
inline uint16_t to_bf16(float x) {  // round to nearest even, as torch's fp32 -> bf16 copy (NaN stays NaN)
  const uint32_t bits = float_to_bits(x);
  const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
  return static_cast<uint16_t>(nan ? (bits | 0x00400000U) >> 16 : (bits + 0x7fffU + ((bits >> 16) & 1U)) >> 16);
}
// fp32 keys read as bf16, rounded as bf16 autocast rounds sdpa's fp32 operands (the cache keeps what the
// model's rotary embedding returned under autocast: fp32 keys beside bf16 values).
struct Fp32ReadAsBf16 { float x; };
inline float widen(Fp32ReadAsBf16 x) { return widen(to_bf16(x.x)); }
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, uint16_t* out) { *out = to_bf16(x); }

// The operands of one call; strides in elements, the last dimension (D) contiguous everywhere. Q, K, V: the
// element types of the queries, keys and values (and of the result: V's).
template <typename Q, typename K, typename V>
struct Problem {
  int64_t rows, kv_heads, group, length, dim;
  const Q* q; int64_t q_row, q_head, q_group;  // (rows, kv_heads, group, dim)
  const K* k; int64_t k_row, k_head, k_pos;    // (rows, kv_heads, length, dim)
  const V* v; int64_t v_row, v_head, v_pos;
  const uint8_t* mask; int64_t mask_row, mask_pos;  // (rows, length) bool, or null: every position attends
  float scale;
  V* out;  // (rows, kv_heads, group, dim), contiguous
  int simd;
};

// Scratch of one thread: the group's scores (group x length) and its fp32 queries and outputs (group x dim).
struct Scratch {
  std::vector<float> scores, queries, sums;
  void reserve(int64_t group, int64_t length, int64_t dim) {
    scores.resize(group * length);
    queries.resize(group * dim);
    sums.resize(group * dim);
  }
};

// The softmax weights of one query's scores in place (max subtracted, exp, divided by the sum); masked
// positions hold -inf and get 0, and a row with every position masked gets 0 throughout (as sdpa gives).
inline void softmax_scalar(float* s, int64_t length) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < length; ++l) top = std::max(top, s[l]);
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + length, 0.0f);
    return;
  }
  float total = 0.0f;
  for (int64_t l = 0; l < length; ++l) {
    s[l] = std::exp(s[l] - top);
    total += s[l];
  }
  const float inv = 1.0f / total;
  for (int64_t l = 0; l < length; ++l) s[l] *= inv;
}

template <typename Q, typename K, typename V>
void attend_scalar(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) {
  const int64_t G = p.group, L = p.length, D = p.dim;
  const K* k = p.k + row * p.k_row + head * p.k_head;
  const V* v = p.v + row * p.v_row + head * p.v_head;
  const uint8_t* mask = p.mask ? p.mask + row * p.mask_row : nullptr;
  const Q* q = p.q + row * p.q_row + head * p.q_head;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) w.queries[g * D + d] = widen(q[g * p.q_group + d]) * p.scale;
  for (int64_t l = 0; l < L; ++l) {
    const bool on = !mask || mask[l * p.mask_pos];
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.0f;
      if (on)
        for (int64_t d = 0; d < D; ++d) acc += w.queries[g * D + d] * widen(k[l * p.k_pos + d]);
      w.scores[g * L + l] = on ? acc : -std::numeric_limits<float>::infinity();
    }
  }
  std::fill(w.sums.begin(), w.sums.begin() + G * D, 0.0f);
  for (int64_t g = 0; g < G; ++g) softmax_scalar(&w.scores[g * L], L);
  for (int64_t l = 0; l < L; ++l)
    for (int64_t g = 0; g < G; ++g) {
      const float weight = w.scores[g * L + l];
      if (weight != 0.0f)
        for (int64_t d = 0; d < D; ++d) w.sums[g * D + d] += weight * widen(v[l * p.v_pos + d]);
    }
  V* out = p.out + ((row * p.kv_heads + head) * G) * D;
  for (int64_t i = 0; i < G * D; ++i) narrow(w.sums[i], out + i);
}

#if LANES == 16  // AVX-512 with BW: 16 lanes
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512i to_bf16x16(__m512 x) {  // to_bf16 of 16 lanes, in the low half of each 32-bit lane
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  return _mm512_srli_epi32(rounded, 16);
}
inline __m512 load16(const Fp32ReadAsBf16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(to_bf16x16(_mm512_loadu_ps(&x->x)), 16));
}

inline void store16(float* out, __m512 x) { _mm512_storeu_ps(out, x); }
inline void store16(uint16_t* out, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(to_bf16x16(x)));
}

// What the loops written once for both widths (exp_lanes, softmax_vector, attend_vector_any) ask of a width.
struct Lanes {
  using F = __m512;
  static constexpr int kWidth = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  template <typename T> static F load(const T* x) { return load16(x); }
  template <typename T> static void store(T* x, F v) { store16(x, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F round(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float reduce_add(F x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(F x) { return _mm512_reduce_max_ps(x); }
  static F times_pow2_where(F poly, F n, F x, float floor) {  // poly x 2^n where x >= floor, else 0
    return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(floor), _CMP_GE_OQ), poly, n);
  }
  static __mmask16 first(int64_t n) { return static_cast<__mmask16>((1U << n) - 1); }  // n < 16
  static F load_first(const float* x, int64_t n, float fill) { return _mm512_mask_loadu_ps(set1(fill), first(n), x); }
  static void store_first(float* x, int64_t n, F v) { _mm512_mask_storeu_ps(x, first(n), v); }
};
#elif LANES == 8
// The same loops 8 lanes at a time, for CPUs with AVX2 and FMA but no AVX-512 (AMD before Zen 4, most
// desktop Intel CPUs): the keys' products widened to fp32 (no bf16 dot product), sums in a different order.
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i to_bf16x8(__m256 x) {  // to_bf16 of 8 lanes, in the low half of each 32-bit lane
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));  // magnitudes: signed order is fine
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
}
inline __m256 load8(const Fp32ReadAsBf16* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(to_bf16x8(_mm256_loadu_ps(&x->x)), 16));
}

// Lanes [0, n) set, n <= 8: the mask of _mm256_maskload_ps / _mm256_maskstore_ps.
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void store8(float* out, __m256 x) { _mm256_storeu_ps(out, x); }
inline void store8(uint16_t* out, __m256 x) {
  const __m256i w = to_bf16x8(x);  // 8 x u32 (< 2^16) -> 8 x u16
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

struct Lanes {
  using F = __m256;
  static constexpr int kWidth = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  template <typename T> static F load(const T* x) { return load8(x); }
  template <typename T> static void store(T* x, F v) { store8(x, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F round(F x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static float reduce_add(F x) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 0x1)));
  }
  static float reduce_max(F x) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 0x1)));
  }
  // poly x 2^n where x >= floor, else 0: 2^n built from its exponent bits (n >= -126 wherever x >= -87.3)
  static F times_pow2_where(F poly, F n, F x, float floor) {
    const F live = _mm256_cmp_ps(x, _mm256_set1_ps(floor), _CMP_GE_OQ);
    const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(poly, _mm256_castsi256_ps(power)));
  }
  static F load_first(const float* x, int64_t n, float fill) {
    const __m256i lanes = first_lanes(n);
    return _mm256_blendv_ps(set1(fill), _mm256_maskload_ps(x, lanes), _mm256_castsi256_ps(lanes));
  }
  static void store_first(float* x, int64_t n, F v) { _mm256_maskstore_ps(x, first_lanes(n), v); }
};
#endif

#if LANES > 1
// exp of a vector of x <= 0 (scores less their maximum) to ~2 ulp: 2^n x e^r with |r| <= ln2 / 2 (r in two
// steps) and a degree-6 polynomial for e^r; inputs under -87.3 (and -inf, NaN) give 0.
inline Lanes::F exp_lanes(Lanes::F x) {
  using L = Lanes;
  const L::F n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  L::F r = L::fnmadd(n, L::set1(0.693145751953125f), x);
  r = L::fnmadd(n, L::set1(1.428606765330187045e-06f), r);
  L::F poly = L::fmadd(L::set1(1.0f / 720), r, L::set1(1.0f / 120));
  poly = L::fmadd(poly, r, L::set1(1.0f / 24));
  poly = L::fmadd(poly, r, L::set1(1.0f / 6));
  poly = L::fmadd(poly, r, L::set1(0.5f));
  poly = L::fmadd(poly, r, L::set1(1.0f));
  poly = L::fmadd(poly, r, L::set1(1.0f));
  return L::times_pow2_where(poly, n, x, -87.3f);
}

inline void softmax_vector(float* s, int64_t length) {
  using L = Lanes;
  const int64_t end = length - length % L::kWidth;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  L::F top = L::set1(minus_inf);
  for (int64_t l = 0; l < end; l += L::kWidth) top = L::max(top, L::load(s + l));
  float high = L::reduce_max(top);
  for (int64_t l = end; l < length; ++l) high = std::max(high, s[l]);
  if (high == minus_inf) {
    std::fill(s, s + length, 0.0f);
    return;
  }
  const L::F m = L::set1(high);
  L::F total = L::zero();
  for (int64_t l = 0; l < end; l += L::kWidth) {
    const L::F e = exp_lanes(L::sub(L::load(s + l), m));
    L::store(s + l, e);
    total = L::add(total, e);
  }
  if (end < length) {  // the tail's missing lanes read as -inf: exp gives them 0
    const L::F e = exp_lanes(L::sub(L::load_first(s + end, length - end, minus_inf), m));
    L::store_first(s + end, length - end, e);
    total = L::add(total, e);
  }
  const float inv = 1.0f / L::reduce_add(total);
  for (int64_t l = 0; l < end; l += L::kWidth) L::store(s + l, L::mul(L::load(s + l), L::set1(inv)));
  for (int64_t l = end; l < length; ++l) s[l] *= inv;
}

// Any dim that is a multiple of the lanes up to 256 (the sums in memory, not registers).
template <typename Q, typename K, typename V>
void attend_vector_any(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) {
  using L = Lanes;
  const int64_t G = p.group, Len = p.length, D = p.dim, W = L::kWidth, C = D / W;
  const K* k = p.k + row * p.k_row + head * p.k_head;
  const V* v = p.v + row * p.v_row + head * p.v_head;
  const uint8_t* mask = p.mask ? p.mask + row * p.mask_row : nullptr;
  float* q = w.queries.data();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) {
      const L::F x = L::load(p.q + row * p.q_row + head * p.q_head + g * p.q_group + W * c);
      L::store(q + g * D + W * c, L::mul(x, L::set1(p.scale)));
    }
  float* s = w.scores.data();
  for (int64_t l = 0; l < Len; ++l) {
    if (mask && !mask[l]) {
      for (int64_t g = 0; g < G; ++g) s[g * Len + l] = -std::numeric_limits<float>::infinity();
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      L::F acc = L::zero();
      for (int64_t c = 0; c < C; ++c) acc = L::fmadd(L::load(q + g * D + W * c), L::load(k + l * p.k_pos + W * c), acc);
      s[g * Len + l] = L::reduce_add(acc);
    }
  }
  for (int64_t g = 0; g < G; ++g) softmax_vector(s + g * Len, Len);
  float* sums = w.sums.data();
  std::fill(sums, sums + G * D, 0.0f);
  for (int64_t l = 0; l < Len; ++l) {
    if (mask && !mask[l]) continue;
    for (int64_t c = 0; c < C; ++c) {
      const L::F value = L::load(v + l * p.v_pos + W * c);
      for (int64_t g = 0; g < G; ++g) {
        float* acc = sums + g * D + W * c;
        L::store(acc, L::fmadd(L::set1(s[g * Len + l]), value, L::load(acc)));
      }
    }
  }
  V* out = p.out + ((row * p.kv_heads + head) * G) * D;
  for (int64_t i = 0; i < G * D; i += W) L::store(out + i, L::load(sums + i));
}
#endif

#if LANES == 16
// r[i] = the sum of the 16 lanes of a[i], for 16 vectors (a tree of in-lane then cross-lane shuffles).
inline __m512 sum_lanes16(const __m512 a[16]) {
  __m512 pair[8], quad[4];
  for (int i = 0; i < 8; ++i)
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lane 4j + t: key 4i + t's sum over 128-bit lane j
    quad[i] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0x44),
                            _mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], 0xEE));
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                   _mm512_shuffle_f32x4(quad[0], quad[1], 0xDD));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                   _mm512_shuffle_f32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

// Positions l0 .. l0 + 15 that attend (all of them without a mask; none past the length).
inline __mmask16 attending(const uint8_t* mask, int64_t l0, int64_t length) {
  const int64_t n = std::min<int64_t>(16, length - l0);
  __mmask16 live = static_cast<__mmask16>(n == 16 ? 0xffffU : (1U << n) - 1);
  if (mask) live &= _mm_test_epi8_mask(_mm_maskz_loadu_epi8(live, mask + l0), _mm_set1_epi8(-1));
  return live;
}

// Scores of one query against positions 0 .. 15 of `k` (those in `live`; 0 for the others): (q . k) x scale.
template <int C, typename Q, typename K>
inline __m512 scores16(const Q* q, const K* k, int64_t k_pos, __mmask16 live, float scale) {
  __m512 query[C];
  for (int c = 0; c < C; ++c) query[c] = _mm512_mul_ps(load16(q + 16 * c), _mm512_set1_ps(scale));
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) {
    acc[i] = _mm512_setzero_ps();
    if (live >> i & 1)
      for (int c = 0; c < C; ++c) acc[i] = _mm512_fmadd_ps(query[c], load16(k + i * k_pos + 16 * c), acc[i]);
  }
  return sum_lanes16(acc);
}

#if defined(__AVX512BF16__)
// bf16 operands: pairs of products summed into fp32 by the CPU's bf16 dot product (each product exact, each
// sum rounded to nearest; subnormal inputs read as 0), a third of the instructions of widening first.
inline __m512bh load32_bf16(const uint16_t* x) { return (__m512bh)_mm512_loadu_si512(x); }
inline __m512bh load32_bf16(const Fp32ReadAsBf16* x) {  // the CPU's conversion rounds to nearest even too
  return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(&x[16].x), _mm512_loadu_ps(&x->x));
}

template <int C, typename K>
inline __m512 scores16(const uint16_t* q, const K* k, int64_t k_pos, __mmask16 live, float scale) {
  static_assert(C % 2 == 0, "dim a multiple of 32");
  __m512bh query[C / 2];
  for (int c = 0; c < C / 2; ++c) query[c] = load32_bf16(q + 32 * c);
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) {
    acc[i] = _mm512_setzero_ps();
    if (live >> i & 1)
      for (int c = 0; c < C / 2; ++c) acc[i] = _mm512_dpbf16_ps(acc[i], load32_bf16(k + i * k_pos + 32 * c), query[c]);
  }
  return _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale));
}
#endif

// dim = 16 C; the group's queries GB at a time. mask contiguous along positions (or null).
template <int C, int GB, typename Q, typename K, typename V>
void attend_vector(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) {
  const int64_t G = p.group, L = p.length, D = 16 * C;
  const K* k = p.k + row * p.k_row + head * p.k_head;
  const V* v = p.v + row * p.v_row + head * p.v_head;
  const uint8_t* mask = p.mask ? p.mask + row * p.mask_row : nullptr;
  float* s = w.scores.data();
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {  // scores, 16 positions at a time
    const Q* q = p.q + row * p.q_row + head * p.q_head + g * p.q_group;
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const __mmask16 live = attending(mask, l0, L);
      const int64_t n = std::min<int64_t>(16, L - l0);
      _mm512_mask_storeu_ps(s + g * L + l0, static_cast<__mmask16>(n == 16 ? 0xffffU : (1U << n) - 1),
                            _mm512_mask_mov_ps(minus_inf, live, scores16<C>(q, k + l0 * p.k_pos, p.k_pos, live,
                                                                            p.scale)));
    }
    softmax_vector(s + g * L, L);
  }
  V* out = p.out + ((row * p.kv_heads + head) * G) * D;
  for (int64_t g0 = 0; g0 < G; g0 += GB) {  // the values, weighted: GB queries' sums in registers
    const int gb = static_cast<int>(std::min<int64_t>(GB, G - g0));
    __m512 acc[GB][C];
    for (int j = 0; j < GB; ++j)
      for (int c = 0; c < C; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      if (mask && !mask[l]) continue;
      __m512 value[C];
      for (int c = 0; c < C; ++c) value[c] = load16(v + l * p.v_pos + 16 * c);
      for (int j = 0; j < GB; ++j) {
        if (j >= gb) break;
        const __m512 weight = _mm512_set1_ps(s[(g0 + j) * L + l]);
        for (int c = 0; c < C; ++c) acc[j][c] = _mm512_fmadd_ps(weight, value[c], acc[j][c]);
      }
    }
    for (int j = 0; j < gb; ++j)
      for (int c = 0; c < C; ++c) store16(out + (g0 + j) * D + 16 * c, acc[j][c]);
  }
}

template <typename Q, typename K, typename V>
void attend_simd(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) {
  if (p.dim == 64) attend_vector<4, 4>(p, row, head, w);
  else if (p.dim == 128) attend_vector<8, 2>(p, row, head, w);
  else attend_vector_any(p, row, head, w);
}
#elif LANES == 8
// r[i] = the sum of the 8 lanes of a[i], for 8 vectors.
inline __m256 sum_lanes8(const __m256 a[8]) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // per 128-bit half
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// Positions l0 .. l0 + 7 that attend, as bits (all of them without a mask; none past the length).
inline unsigned attending(const uint8_t* mask, int64_t l0, int64_t length) {
  const int64_t n = std::min<int64_t>(8, length - l0);
  unsigned live = (1U << n) - 1;
  if (mask) {
    uint64_t bytes = 0;
    std::memcpy(&bytes, mask + l0, n);
    const __m128i zero = _mm_cmpeq_epi8(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)), _mm_setzero_si128());
    live &= ~static_cast<unsigned>(_mm_movemask_epi8(zero));
  }
  return live;
}

// Scores of one query against positions 0 .. 7 of `k` (those in `live`; 0 for the others): (q . k) x scale.
template <int C, typename Q, typename K>
inline __m256 scores8(const Q* q, const K* k, int64_t k_pos, unsigned live, float scale) {
  __m256 query[C];
  for (int c = 0; c < C; ++c) query[c] = _mm256_mul_ps(load8(q + 8 * c), _mm256_set1_ps(scale));
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) {
    acc[i] = _mm256_setzero_ps();
    if (live >> i & 1)
      for (int c = 0; c < C; ++c) acc[i] = _mm256_fmadd_ps(query[c], load8(k + i * k_pos + 8 * c), acc[i]);
  }
  return sum_lanes8(acc);
}

// dim = 8 C; one query's sums in registers at a time. mask contiguous along positions (or null).
template <int C, typename Q, typename K, typename V>
void attend_vector(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) {
  const int64_t G = p.group, L = p.length, D = 8 * C;
  const K* k = p.k + row * p.k_row + head * p.k_head;
  const V* v = p.v + row * p.v_row + head * p.v_head;
  const uint8_t* mask = p.mask ? p.mask + row * p.mask_row : nullptr;
  float* s = w.scores.data();
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t g = 0; g < G; ++g) {  // scores, 8 positions at a time
    const Q* q = p.q + row * p.q_row + head * p.q_head + g * p.q_group;
    for (int64_t l0 = 0; l0 < L; l0 += 8) {
      const unsigned live = attending(mask, l0, L);
      const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(live)), lane_bit),
                                            lane_bit);
      const __m256 x = _mm256_blendv_ps(minus_inf, scores8<C>(q, k + l0 * p.k_pos, p.k_pos, live, p.scale),
                                        _mm256_castsi256_ps(on));
      if (L - l0 >= 8) _mm256_storeu_ps(s + g * L + l0, x);
      else _mm256_maskstore_ps(s + g * L + l0, first_lanes(L - l0), x);
    }
    softmax_vector(s + g * L, L);
  }
  V* out = p.out + ((row * p.kv_heads + head) * G) * D;
  for (int64_t g = 0; g < G; ++g) {  // the values, weighted
    __m256 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      if (mask && !mask[l]) continue;
      const __m256 weight = _mm256_set1_ps(s[g * L + l]);
      for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(weight, load8(v + l * p.v_pos + 8 * c), acc[c]);
    }
    for (int c = 0; c < C; ++c) store8(out + g * D + 8 * c, acc[c]);
  }
}

template <typename Q, typename K, typename V>
void attend_simd(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) {
  if (p.dim == 64) attend_vector<8>(p, row, head, w);
  else attend_vector_any(p, row, head, w);
}
#else
template <typename Q, typename K, typename V>
void attend_simd(const Problem<Q, K, V>& p, int64_t row, int64_t head, Scratch& w) { attend_scalar(p, row, head, w); }
#endif
constexpr int kLanes = LANES;

template <typename Q, typename K, typename V>
void attend(const Q* q, const K* k, const V* v, V* out, const int64_t* sizes, const int64_t* strides,
            const uint8_t* mask, float scale, int simd, int threads) {
  const Problem<Q, K, V> p{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4],
                           q, strides[0], strides[1], strides[2], k, strides[3], strides[4], strides[5],
                           v, strides[6], strides[7], strides[8], mask, strides[9], strides[10], scale, out, simd};
  const auto item = [&](int64_t i) {
    thread_local Scratch w;
    w.reserve(p.group, p.length, p.dim);
    const int64_t row = i / p.kv_heads, head = i % p.kv_heads;
    if (p.simd && kLanes > 1 && p.dim % 16 == 0 && p.dim <= 256 && p.mask_pos <= 1) attend_simd(p, row, head, w);
    else attend_scalar(p, row, head, w);
  };
  const int64_t items = p.rows * p.kv_heads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(std::max(threads, 1)) schedule(dynamic, 1) if (threads > 1 && items > 1)
  for (int64_t i = 0; i < items; ++i) item(i);
#else
  parallel_for(items, threads, item);
#endif
}

}  // namespace

extern "C" {

// kind: 0 = fp32 (q, k, v and out), 1 = bf16, 2 = bf16 q, v and out with fp32 keys read as bf16 (what bf16
// autocast gives sdpa). sizes: rows, kv_heads, group, length, dim; strides (elements): q's row, head and
// group, k's and v's row, head and position, the mask's row and position; mask may be null. Returns 0, or -1
// for a kind it does not handle.
int decode_attention(int kind, const int64_t* sizes, const void* q, const void* k, const void* v,
                     const uint8_t* mask, const int64_t* strides, float scale, void* out, int simd, int threads) {
  using bf16 = uint16_t;
  if (kind == 0)
    attend(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(v),
           static_cast<float*>(out), sizes, strides, mask, scale, simd, threads);
  else if (kind == 1)
    attend(static_cast<const bf16*>(q), static_cast<const bf16*>(k), static_cast<const bf16*>(v),
           static_cast<bf16*>(out), sizes, strides, mask, scale, simd, threads);
  else if (kind == 2)
    attend(static_cast<const bf16*>(q), static_cast<const Fp32ReadAsBf16*>(k), static_cast<const bf16*>(v),
           static_cast<bf16*>(out), sizes, strides, mask, scale, simd, threads);
  else
    return -1;
  return 0;
}

// The lanes of the vector loops compiled here: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (the scalar loops only).
int decode_attention_lanes() { return kLanes; }

// 1 where the work items run on OpenMP's threads, 0 where on host_pool.cpp's.
int decode_attention_openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
