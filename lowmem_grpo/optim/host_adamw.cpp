// Fused CPU kernel for the offloaded optimizer's 8-bit host step (loader, semantics and tests: host_adamw.py).
// adamw8bit_step: bitsandbytes' 8-bit blockwise AdamW, one pass over each 256-element block while it is in
//   cache (dequantize, clip scale, Adam in fp32, weight fp32 or bf16 with stochastic rounding, re-quantize).
// fp32 AdamW: host_adamw_fp32.cpp. Plain C ABI (ctypes releases the GIL); threads: host_pool.cpp; the norm:
// host_grad_norm.cpp. Built with -ffp-contract=off: multiply-adds are fused only where spelled out.
// Operation order, memory traffic and where results may differ by an ulp: docs/memory-modes.md.

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

constexpr int64_t kBlock = 256;          // bitsandbytes' quantisation block (elements)
constexpr int64_t kSerialBlocks = 64;    // 8-bit step: tensors of up to this many blocks on the caller alone
constexpr int64_t kChunkBlocks = 32;     // 8-bit step: blocks per work item (8192 elements)

// The quantisation table (build_quantize_lut): bitsandbytes' 65536 codes, 4 bytes of padding (the AVX2
// path's 32-bit gathers), then the same map as a threshold tree for the AVX-512 path, uint16 words:
// levels 0-5 of the binary search at word 32 * level, level 6 at 192, level 7 at 256 (12 registers of 32
// words; a node at the bit-reversed path to it), the base code at 384; then the code itself as four
// 256-byte planes, byte b of every code value in plane b (kPlanesOffset: the AVX-512 VBMI path's
// dequantization by byte permutes).
constexpr int64_t kSearchOffset = 65536 + 64;  // bytes
constexpr int64_t kSearchBase = 384;           // words
constexpr int64_t kPlanesOffset = kSearchOffset + 2 * (kSearchBase + 32);  // bytes
constexpr int64_t kTableBytes = kPlanesOffset + 4 * 256;

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float load(const float* x, int64_t i) { return x[i]; }
inline float load(const uint16_t* x, int64_t i) { return bits_to_float(static_cast<uint32_t>(x[i]) << 16); }  // bf16

// 32-bit integer hash (Chris Wellons' lowbias32): the stochastic-rounding noise of element i is a function
// of (seed, i) only, so it is the same whatever the thread count or block order.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
  return x;
}
inline uint32_t noise16(int64_t i, uint32_t key0, uint32_t key1) {
  const uint32_t lo = static_cast<uint32_t>(i), hi = static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32);
  return mix32(mix32(lo ^ key0) + (hi ^ key1)) >> 16;  // 16 uniform bits
}

inline void store(float* p, int64_t i, float x, int, uint32_t, uint32_t) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x, int stochastic, uint32_t key0, uint32_t key1) {
  const uint32_t bits = float_to_bits(x);
  // stochastic rounding to bf16: add 16 random bits below the kept half, truncate (sr_adamw.py);
  // else round to nearest even, as torch's fp32 -> bf16 copy does (NaN stays NaN: its payload bit 22 is set)
  const uint32_t add = stochastic ? noise16(i, key0, key1) : 0x7fffU + ((bits >> 16) & 1U);
  const bool nan = (bits & 0x7fffffffU) > 0x7f800000U;
  p[i] = static_cast<uint16_t>(nan ? (bits | 0x00400000U) >> 16 : (bits + add) >> 16);
}

// |x| as bits, NaN as 0: integer order of non-negative floats is their float order. (bitsandbytes'
// quantizer ignores NaN lanes in a block's absmax.)
inline uint32_t abs_bits(float x) {
  const uint32_t a = float_to_bits(x) & 0x7fffffffU;
  return a > 0x7f800000U ? 0U : a;
}

// bitsandbytes' CPU quantizer for one value already divided by the block's absmax.
inline uint8_t lut_code(float v, const uint8_t* lut) {
  v = v > -1.0f ? v : -1.0f;  // NaN -> -1, as _mm256_max_ps(v, -1) does
  v = v < 1.0f ? v : 1.0f;
  const float t = ((v + 1.0f) * 0.5f) * 65535.0f + 0.5f;
  return lut[static_cast<int32_t>(t)];
}

struct Adam {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;  // as torch turns the Python floats into fp32
  float correction2, eps, step_size, decay, grad_scale;  // sqrt(1 - beta2^t), eps, -lr / (1 - beta1^t), 1 - lr*wd
  int decay_on;
  int stochastic;       // bf16 weights: stochastic rounding (1) or round to nearest even (0)
  int simd;             // 0: the scalar loops only (the tests check both paths give the same bits)
  uint32_t key0, key1;  // stochastic-rounding seed
};

// Elements [from, to) of a block: dequantize, Adam, write the weight; m and v (block-local) for quantization.
template <typename P, typename G>
inline void adam_scalar(int64_t start, int64_t from, int64_t to, P* p, const G* g, const uint8_t* c1,
                        const uint8_t* c2, float scale1, float scale2, const float* qmap1, const float* qmap2,
                        const Adam& k, float* m, float* v, uint32_t& max1, uint32_t& max2) {
  for (int64_t i = from; i < to; ++i) {
    const int64_t j = start + i;
    const float gi = load(g, j) * k.grad_scale;
    float mi = qmap1[c1[i]] * scale1;  // dequantize (bitsandbytes: code[A[i]] * absmax)
    float vi = qmap2[c2[i]] * scale2;
    mi = std::fma(gi, k.one_minus_beta1, mi * k.beta1);       // mul_(beta1).add_(grad, alpha=1 - beta1)
    vi = std::fma(k.one_minus_beta2 * gi, gi, vi * k.beta2);  // mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    const float denom = std::sqrt(vi) / k.correction2 + k.eps;  // (sqrt(v) / c2).add_(eps)
    float pi = load(p, j);
    if (k.decay_on) pi = pi * k.decay;                         // mul_(1 - lr * wd)
    pi = pi + k.step_size * mi / denom;                        // addcdiv_(m, denom, value=-lr / c1)
    store(p, j, pi, k.stochastic, k.key0, k.key1);             // noise indexed by the element's place in the tensor
    m[i] = mi;
    v[i] = vi;
    max1 = std::max(max1, abs_bits(mi));
    max2 = std::max(max2, abs_bits(vi));
  }
}

inline void quantize_scalar(int64_t from, int64_t to, const float* x, float inv, const uint8_t* lut, uint8_t* out) {
  for (int64_t i = from; i < to; ++i) out[i] = lut_code(x[i] * inv, lut);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The same arithmetic, 16 lanes at a time (gcc does not vectorise the table look-ups well by itself).
constexpr int64_t kLanes = 16;

inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const uint16_t* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512i mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
inline void store16(float* p, int64_t j, __m512 x, const Adam&) { _mm512_storeu_ps(p + j, x); }
inline void store16(uint16_t* p, int64_t j, __m512 x, const Adam& k) {
  const __m512i bits = _mm512_castps_si512(x);
  __m512i add;
  if (k.stochastic) {  // noise16(j + lane) for the 16 lanes
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i base_lo = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(j)));
    const __m512i lo = _mm512_add_epi32(base_lo, lane);
    const __mmask16 carry = _mm512_cmplt_epu32_mask(lo, base_lo);  // j + lane crossed a multiple of 2^32
    __m512i hi = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(j) >> 32)));
    hi = _mm512_mask_add_epi32(hi, carry, hi, _mm512_set1_epi32(1));
    __m512i h = mix32x16(_mm512_xor_si512(lo, _mm512_set1_epi32(static_cast<int>(k.key0))));
    h = _mm512_add_epi32(h, _mm512_xor_si512(hi, _mm512_set1_epi32(static_cast<int>(k.key1))));
    add = _mm512_srli_epi32(mix32x16(h), 16);
  } else {
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    add = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd);  // round to nearest even
  }
  const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
  __m512i out = _mm512_add_epi32(bits, add);
  out = _mm512_mask_mov_epi32(out, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
}
inline __m512i abs_bits16(__m512 x) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff));
  return _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(a, _mm512_set1_epi32(0x7f800000)), a);  // NaN -> 0
}

#if defined(__AVX512VBMI__)
// qmap[c] of 64 codes by byte permutes (a 256-entry table as four 256-byte planes, build_quantize_lut): the
// same bits as four gathers, which cost more than the rest of the step on Zen 4 and on Intel.
struct BytePlanes {
  __m512i plane[4][4];  // plane[b][r]: byte b of code values 64 r .. 64 r + 63

  explicit BytePlanes(const uint8_t* lut) {
    for (int b = 0; b < 4; ++b)
      for (int r = 0; r < 4; ++r) plane[b][r] = _mm512_loadu_si512(lut + kPlanesOffset + 256 * b + 64 * r);
  }

  void values(const uint8_t* c, __m512 out[4]) const {  // out[r]: the values of codes c[16 r .. 16 r + 15]
    // dwords transposed 4 x 4 so that the in-lane unpacks below leave the values in order
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i idx = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(c));
    const __mmask64 upper = _mm512_movepi8_mask(idx);  // codes 128-255
    __m512i byte[4];
    for (int b = 0; b < 4; ++b)
      byte[b] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(plane[b][0], idx, plane[b][1]),
                                       _mm512_permutex2var_epi8(plane[b][2], idx, plane[b][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(byte[0], byte[1]), hi01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(byte[2], byte[3]), hi23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
  }
};
#endif

template <typename P, typename G>
inline int64_t adam_vector(int64_t start, int64_t len, P* p, const G* g, const uint8_t* c1, const uint8_t* c2,
                           float scale1, float scale2, [[maybe_unused]] const float* qmap1,
                           [[maybe_unused]] const float* qmap2, [[maybe_unused]] const uint8_t* lut1,
                           [[maybe_unused]] const uint8_t* lut2,
                           const Adam& k, float* m, float* v, uint32_t& max1, uint32_t& max2) {
  const __m512 s1 = _mm512_set1_ps(scale1), s2 = _mm512_set1_ps(scale2), gs = _mm512_set1_ps(k.grad_scale);
  const __m512 b1 = _mm512_set1_ps(k.beta1), ob1 = _mm512_set1_ps(k.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(k.beta2), ob2 = _mm512_set1_ps(k.one_minus_beta2);
  const __m512 c2v = _mm512_set1_ps(k.correction2), eps = _mm512_set1_ps(k.eps);
  const __m512 step = _mm512_set1_ps(k.step_size), decay = _mm512_set1_ps(k.decay);
  __m512i mx1 = _mm512_setzero_si512(), mx2 = _mm512_setzero_si512();
  const auto update = [&](int64_t i, __m512 code1, __m512 code2) {  // elements i .. i + 15, their code values
    const int64_t j = start + i;
    const __m512 gi = _mm512_mul_ps(load16(g + j), gs);
    __m512 mi = _mm512_mul_ps(code1, s1);
    __m512 vi = _mm512_mul_ps(code2, s2);
    mi = _mm512_fmadd_ps(gi, ob1, _mm512_mul_ps(mi, b1));
    vi = _mm512_fmadd_ps(_mm512_mul_ps(ob2, gi), gi, _mm512_mul_ps(vi, b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), c2v), eps);
    __m512 pi = load16(p + j);
    if (k.decay_on) pi = _mm512_mul_ps(pi, decay);
    pi = _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(step, mi), denom));
    store16(p, j, pi, k);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    mx1 = _mm512_max_epu32(mx1, abs_bits16(mi));
    mx2 = _mm512_max_epu32(mx2, abs_bits16(vi));
  };
  const int64_t end = len - len % kLanes;
#if defined(__AVX512VBMI__)
  const BytePlanes map1(lut1), map2(lut2);
  for (int64_t i = 0; i < end; i += 4 * kLanes) {
    __m512 code1[4], code2[4];
    if (i + 4 * kLanes <= len) {
      map1.values(c1 + i, code1);
      map2.values(c2 + i, code2);
    } else {  // under 64 codes left: their values from zero-padded copies
      alignas(64) uint8_t pad1[4 * kLanes] = {}, pad2[4 * kLanes] = {};
      std::memcpy(pad1, c1 + i, len - i);
      std::memcpy(pad2, c2 + i, len - i);
      map1.values(pad1, code1);
      map2.values(pad2, code2);
    }
    for (int r = 0; r < 4 && i + r * kLanes < end; ++r) update(i + r * kLanes, code1[r], code2[r]);
  }
#else
  for (int64_t i = 0; i < end; i += kLanes) {
    const __m512i i1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c1 + i)));
    const __m512i i2 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c2 + i)));
    update(i, _mm512_i32gather_ps(i1, qmap1, 4), _mm512_i32gather_ps(i2, qmap2, 4));
  }
#endif
  max1 = std::max(max1, static_cast<uint32_t>(_mm512_reduce_max_epu32(mx1)));
  max2 = std::max(max2, static_cast<uint32_t>(_mm512_reduce_max_epu32(mx2)));
  return end;
}

// lut_code's grid index of 16 values, in fewer steps with the same bits: (v + 1) * 0.5 is exact for v >= -1, so
// ((v + 1) * 0.5) * 65535 rounds as (v + 1) * 32767.5 does. Below -1 (and NaN, and -inf: cvtt gives INT_MIN)
// the result is negative or 0 where lut_code's clamp gives 0: grid_indices clamps it after the conversion.
inline __m512i grid_index16(const float* x, __m512 iv) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_min_ps(one, _mm512_mul_ps(_mm512_loadu_ps(x), iv));  // min_ps(1, NaN) = NaN
  t = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(t, one), _mm512_set1_ps(32767.5f)), _mm512_set1_ps(0.5f));
  return _mm512_cvttps_epi32(t);  // at most 65535
}

// The grid indices of x[0 .. 31] in 16-bit lanes, clamped to [0, 65535] by the pack's unsigned saturation, in
// the pack's order: 128-bit lane k holds x[4k .. 4k + 3] then x[16 + 4k .. 16 + 4k + 3] (in_order undoes it).
inline __m512i grid_indices(const float* x, __m512 iv) {
  return _mm512_packus_epi32(grid_index16(x, iv), grid_index16(x + 16, iv));
}

// 32 bytes in grid_indices' order back in the order of x: 4-byte group 2k + h is x[16 h + 4k .. 16 h + 4k + 3].
inline __m256i in_order(__m256i bytes) {
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
}

// build_quantize_lut's threshold tree in registers: lut[t] of 32 grid indices t at a time without touching
// the 64 KiB table (8 compares against thresholds picked by permutes, a binary search). A lane's path is kept
// bit-reversed (the branch taken at level l is bit l), so each step is one masked add, and the last level's
// register pair is picked by level 6's compare; one reversal of the path's byte at the end gives the code.
struct SearchTree {
  __m512i level[12];  // levels 0-5 one register each, level 6 two, level 7 four
  __m512i root;
  __m256i base;

  explicit SearchTree(const uint8_t* lut) {
    const auto words = reinterpret_cast<const uint16_t*>(lut + kSearchOffset);
    for (int r = 0; r < 12; ++r) level[r] = _mm512_loadu_si512(words + 32 * r);
    root = _mm512_set1_epi16(static_cast<int16_t>(words[0]));
    base = _mm256_set1_epi8(static_cast<char>(words[kSearchBase]));
  }

  __m256i codes(__m512i t) const {  // t: 32 grid indices in 16-bit lanes; the codes as bytes
    __mmask32 right = _mm512_cmpgt_epu16_mask(t, root);
    __m512i path = _mm512_maskz_mov_epi16(right, _mm512_set1_epi16(1));
    const auto descend = [&](__m512i threshold, int bit) {  // path += (t > threshold) << bit
      right = _mm512_cmpgt_epu16_mask(t, threshold);
      path = _mm512_mask_add_epi16(path, right, path, _mm512_set1_epi16(static_cast<int16_t>(1 << bit)));
    };
    for (int r = 1; r < 6; ++r) descend(_mm512_permutexvar_epi16(path, level[r]), r);
    descend(_mm512_permutex2var_epi16(level[6], path, level[7]), 6);
    const __m512i low = _mm512_permutex2var_epi16(level[8], path, level[9]);  // index bits 0-5 of path
    descend(_mm512_mask_blend_epi16(right, low, _mm512_permutex2var_epi16(level[10], path, level[11])), 7);
    return _mm256_add_epi8(reverse_bits(_mm512_cvtepi16_epi8(path)), base);
  }

  static __m256i reverse_bits(__m256i x) {  // the bits of every byte in reverse order
#if defined(__GFNI__)
    return _mm256_gf2p8affine_epi64_epi8(x, _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL)), 0);
#else
    const __m256i reversed = _mm256_setr_epi8(0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15,
                                              0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    const __m256i low = _mm256_shuffle_epi8(reversed, _mm256_and_si256(x, nibble));
    const __m256i high = _mm256_shuffle_epi8(reversed, _mm256_and_si256(_mm256_srli_epi16(x, 4), nibble));
    return _mm256_or_si256(_mm256_slli_epi16(low, 4), high);  // high nibble's bits stay in the low nibble
#endif
  }
};

inline int64_t quantize_vector(int64_t len, const float* x, float inv, const uint8_t* lut, uint8_t* out) {
  const __m512 iv = _mm512_set1_ps(inv);
  const SearchTree tree(lut);
  const int64_t end = len - len % (2 * kLanes);
  for (int64_t i = 0; i < end; i += 2 * kLanes) {
    const __m256i codes = in_order(tree.codes(grid_indices(x + i, iv)));  // the search does not mind the order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), codes);
  }
  return end;
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same arithmetic, 8 lanes at a time, for CPUs without AVX-512 (most desktop CPUs before Zen 4).
constexpr int64_t kLanes = 8;

inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const uint16_t* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}
inline void store8(float* p, int64_t j, __m256 x, const Adam&) { _mm256_storeu_ps(p + j, x); }
inline void store8(uint16_t* p, int64_t j, __m256 x, const Adam& k) {
  const __m256i bits = _mm256_castps_si256(x);
  __m256i add;
  if (k.stochastic) {  // noise16(j + lane) for the 8 lanes
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000U));
    const __m256i base_lo = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(j)));
    const __m256i lo = _mm256_add_epi32(base_lo, lane);
    // j + lane crossed a multiple of 2^32 where lo < base_lo (unsigned): -1 there, so subtracting adds 1
    const __m256i carry = _mm256_cmpgt_epi32(_mm256_xor_si256(base_lo, sign), _mm256_xor_si256(lo, sign));
    const __m256i hi = _mm256_sub_epi32(
        _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(j) >> 32))), carry);
    __m256i h = mix32x8(_mm256_xor_si256(lo, _mm256_set1_epi32(static_cast<int>(k.key0))));
    h = _mm256_add_epi32(h, _mm256_xor_si256(hi, _mm256_set1_epi32(static_cast<int>(k.key1))));
    add = _mm256_srli_epi32(mix32x8(h), 16);
  } else {
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    add = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd);  // round to nearest even
  }
  const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
  __m256i out = _mm256_add_epi32(bits, add);
  out = _mm256_blendv_epi8(out, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
  out = _mm256_srli_epi32(out, 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0x08);  // 8 x u16, low half
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + j), _mm256_castsi256_si128(packed));
}
inline __m256i abs_bits8(__m256 x) {
  const __m256i a = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff));
  return _mm256_andnot_si256(_mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)), a);  // NaN -> 0
}
inline uint32_t reduce_max8(__m256i x) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

template <typename P, typename G>
inline int64_t adam_vector(int64_t start, int64_t len, P* p, const G* g, const uint8_t* c1, const uint8_t* c2,
                           float scale1, float scale2, const float* qmap1, const float* qmap2, const uint8_t*,
                           const uint8_t*, const Adam& k, float* m, float* v, uint32_t& max1, uint32_t& max2) {
  const __m256 s1 = _mm256_set1_ps(scale1), s2 = _mm256_set1_ps(scale2), gs = _mm256_set1_ps(k.grad_scale);
  const __m256 b1 = _mm256_set1_ps(k.beta1), ob1 = _mm256_set1_ps(k.one_minus_beta1);
  const __m256 b2 = _mm256_set1_ps(k.beta2), ob2 = _mm256_set1_ps(k.one_minus_beta2);
  const __m256 c2v = _mm256_set1_ps(k.correction2), eps = _mm256_set1_ps(k.eps);
  const __m256 step = _mm256_set1_ps(k.step_size), decay = _mm256_set1_ps(k.decay);
  __m256i mx1 = _mm256_setzero_si256(), mx2 = _mm256_setzero_si256();
  const int64_t end = len - len % kLanes;
  for (int64_t i = 0; i < end; i += kLanes) {
    const int64_t j = start + i;
    const __m256 gi = _mm256_mul_ps(load8(g + j), gs);
    const __m256i i1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c1 + i)));
    const __m256i i2 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c2 + i)));
    __m256 mi = _mm256_mul_ps(_mm256_i32gather_ps(qmap1, i1, 4), s1);
    __m256 vi = _mm256_mul_ps(_mm256_i32gather_ps(qmap2, i2, 4), s2);
    mi = _mm256_fmadd_ps(gi, ob1, _mm256_mul_ps(mi, b1));
    vi = _mm256_fmadd_ps(_mm256_mul_ps(ob2, gi), gi, _mm256_mul_ps(vi, b2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), c2v), eps);
    __m256 pi = load8(p + j);
    if (k.decay_on) pi = _mm256_mul_ps(pi, decay);
    pi = _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(step, mi), denom));
    store8(p, j, pi, k);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    mx1 = _mm256_max_epu32(mx1, abs_bits8(mi));
    mx2 = _mm256_max_epu32(mx2, abs_bits8(vi));
  }
  max1 = std::max(max1, reduce_max8(mx1));
  max2 = std::max(max2, reduce_max8(mx2));
  return end;
}

inline int64_t quantize_vector(int64_t len, const float* x, float inv, const uint8_t* lut, uint8_t* out) {
  const __m256 iv = _mm256_set1_ps(inv), one = _mm256_set1_ps(1.0f), minus_one = _mm256_set1_ps(-1.0f);
  const __m256 half = _mm256_set1_ps(0.5f), top = _mm256_set1_ps(65535.0f);
  const int64_t end = len - len % kLanes;
  for (int64_t i = 0; i < end; i += kLanes) {
    __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i), iv);
    t = _mm256_min_ps(_mm256_max_ps(t, minus_one), one);  // max_ps(NaN, -1) = -1, as in the scalar path
    t = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(t, one), half), top), half);
    __m256i q = _mm256_i32gather_epi32(reinterpret_cast<const int*>(lut), _mm256_cvttps_epi32(t), 1);
    q = _mm256_and_si256(q, _mm256_set1_epi32(0xff));  // 4 bytes read at each entry: keep its own
    q = _mm256_packus_epi16(_mm256_packus_epi32(q, q), _mm256_setzero_si256());  // bytes 0-3 | 16-19
    const uint32_t low = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_castsi256_si128(q)));
    const uint32_t high = static_cast<uint32_t>(_mm_cvtsi128_si32(_mm256_extracti128_si256(q, 1)));
    std::memcpy(out + i, &low, 4);
    std::memcpy(out + i + 4, &high, 4);
  }
  return end;
}
#else
template <typename P, typename G>
inline int64_t adam_vector(int64_t, int64_t, P*, const G*, const uint8_t*, const uint8_t*, float, float,
                           const float*, const float*, const uint8_t*, const uint8_t*, const Adam&, float*, float*,
                           uint32_t&, uint32_t&) {
  return 0;  // neither AVX-512 nor AVX2: the scalar loop (vectorised by the compiler as it can) does it all
}
inline int64_t quantize_vector(int64_t, const float*, float, const uint8_t*, uint8_t*) { return 0; }
#endif

// bitsandbytes' quantize_blockwise for one block of `len` fp32 values whose largest |x| (NaN ignored) has the
// bits `max_bits`: returns the new absmax; an all-zero block gets code 0 throughout.
inline float quantize_block(int64_t len, const float* x, uint32_t max_bits, const uint8_t* lut, uint8_t* out,
                            int simd) {
  const float absmax = bits_to_float(max_bits);
  if (absmax == 0.0f) {
    std::memset(out, 0, len);
  } else {
    const float inv = 1.0f / absmax;
    quantize_scalar(simd ? quantize_vector(len, x, inv, lut, out) : 0, len, x, inv, lut, out);
  }
  return absmax;
}

// One block: [start, start + len), len <= 256.
template <typename P, typename G>
void adam8bit_block(int64_t block, int64_t n, P* p, const G* g, uint8_t* s1, uint8_t* s2, float* absmax1,
                    float* absmax2, const float* qmap1, const float* qmap2, const uint8_t* lut1,
                    const uint8_t* lut2, const Adam& k) {
  const int64_t start = block * kBlock;
  const int64_t len = std::min(kBlock, n - start);
  alignas(64) float m[kBlock];
  alignas(64) float v[kBlock];
  const float scale1 = absmax1[block], scale2 = absmax2[block];
  uint8_t* c1 = s1 + start;
  uint8_t* c2 = s2 + start;
  uint32_t max1 = 0, max2 = 0;
  const int64_t done =
      k.simd ? adam_vector(start, len, p, g, c1, c2, scale1, scale2, qmap1, qmap2, lut1, lut2, k, m, v, max1, max2) : 0;
  adam_scalar(start, done, len, p, g, c1, c2, scale1, scale2, qmap1, qmap2, k, m, v, max1, max2);
  absmax1[block] = quantize_block(len, m, max1, lut1, c1, k.simd);
  absmax2[block] = quantize_block(len, v, max2, lut2, c2, k.simd);
}

template <typename P, typename G>
void adam8bit(int64_t n, P* p, const G* g, uint8_t* s1, uint8_t* s2, float* absmax1, float* absmax2,
              const float* qmap1, const float* qmap2, const uint8_t* lut1, const uint8_t* lut2, const Adam& k,
              int threads) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t chunks = blocks > kSerialBlocks ? (blocks + kChunkBlocks - 1) / kChunkBlocks : 1;
  parallel_for(chunks, threads, [&](int64_t c) {
    const int64_t end = chunks == 1 ? blocks : std::min(blocks, (c + 1) * kChunkBlocks);
    for (int64_t b = chunks == 1 ? 0 : c * kChunkBlocks; b < end; ++b)
      adam8bit_block(b, n, p, g, s1, s2, absmax1, absmax2, qmap1, qmap2, lut1, lut2, k);
  });
}

}  // namespace

extern "C" {

// Builds bitsandbytes' CPU quantisation table for a sorted 256-entry code (its build_quantize_lut):
// entry i is the code nearest to -1 + 2i / 65535, the lower one on a tie. `lut` holds table_bytes():
// those 65536 codes, padding, and the threshold tree that computes the same codes by search (kSearchOffset).
void build_quantize_lut(const float* code, uint8_t* lut) {
  float midpoints[255];
  for (int i = 0; i < 255; ++i) midpoints[i] = 0.5f * (code[i] + code[i + 1]);
  int idx = 0;
  for (int i = 0; i < 65536; ++i) {
    const float val = -1.0f + (2.0f * static_cast<float>(i)) / 65535.0f;
    while (idx < 255 && midpoints[idx] < val) ++idx;
    lut[i] = static_cast<uint8_t>(idx);
  }
  std::memset(lut + 65536, 0, kTableBytes - 65536);
  // lut is non-decreasing, so lut[t] = base + #{k : t > after[k]}, base = lut[0], after[k] the last t whose
  // code is at most base + k (65535 where no t has a larger code: never passed).
  const int base = lut[0];
  uint16_t after[255];
  for (int k = 0, t = 0; k < 255; ++k) {
    while (t < 65536 && lut[t] <= base + k) ++t;
    after[k] = static_cast<uint16_t>(t - 1);  // t >= 1: lut[0] = base
  }
  uint16_t tree[kSearchBase + 1];
  std::memset(tree, 0, sizeof(tree));
  for (int level = 0; level < 8; ++level) {  // node j of a level: the middle of its range of `after`
    const int at = level < 6 ? 32 * level : level == 6 ? 192 : 256;
    for (int j = 0; j < (1 << level); ++j) {  // stored at j's bits reversed: SearchTree's path to it
      int path = 0;
      for (int b = 0; b < level; ++b) path |= ((j >> (level - 1 - b)) & 1) << b;
      tree[at + path] = after[((2 * j + 1) << (7 - level)) - 1];
    }
  }
  tree[kSearchBase] = static_cast<uint16_t>(base);
  std::memcpy(lut + kSearchOffset, tree, sizeof(tree));
  for (int i = 0; i < 256; ++i) {
    uint32_t bits;
    std::memcpy(&bits, code + i, 4);
    for (int b = 0; b < 4; ++b) lut[kPlanesOffset + 256 * b + i] = static_cast<uint8_t>(bits >> (8 * b));
  }
}

// Bytes of the table build_quantize_lut fills.
int64_t quantize_table_bytes() { return kTableBytes; }

// bitsandbytes' quantize_blockwise (fp32 input, 256-element blocks) with this file's quantizer: what the
// optimizer step does to its states, exposed for the tests to compare with bitsandbytes' own.
void quantize_blockwise(int64_t n, const float* x, const uint8_t* lut, uint8_t* out, float* absmax, int simd) {
  for (int64_t b = 0; b * kBlock < n; ++b) {
    const int64_t start = b * kBlock, len = std::min(kBlock, n - start);
    uint32_t max_bits = 0;
    for (int64_t i = 0; i < len; ++i) max_bits = std::max(max_bits, abs_bits(x[start + i]));
    absmax[b] = quantize_block(len, x + start, max_bits, lut, out + start, simd);
  }
}

// p_kind / g_kind: 0 = fp32, 1 = bf16; lut1 / lut2: build_quantize_lut of qmap1 / qmap2. Returns 0, or -1 for a
// dtype pair it does not handle.
int adamw8bit_step(int64_t n, void* p, int p_kind, const void* g, int g_kind, uint8_t* s1, uint8_t* s2,
                   float* absmax1, float* absmax2, const float* qmap1, const float* qmap2, const uint8_t* lut1,
                   const uint8_t* lut2, float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
                   float correction2, float eps, float step_size, float decay, int decay_on, float grad_scale,
                   int stochastic, uint32_t key0, uint32_t key1, int simd, int threads) {
  const Adam k{beta1, one_minus_beta1, beta2, one_minus_beta2, correction2, eps, step_size, decay, grad_scale,
               decay_on, stochastic, simd, key0, key1};
  const auto gf = static_cast<const float*>(g);
  const auto gh = static_cast<const uint16_t*>(g);
  const auto pf = static_cast<float*>(p);
  const auto ph = static_cast<uint16_t*>(p);
  const int pair = p_kind * 2 + g_kind;  // weight dtype, gradient dtype
  if (pair == 0) adam8bit(n, pf, gf, s1, s2, absmax1, absmax2, qmap1, qmap2, lut1, lut2, k, threads);
  else if (pair == 1) adam8bit(n, pf, gh, s1, s2, absmax1, absmax2, qmap1, qmap2, lut1, lut2, k, threads);
  else if (pair == 2) adam8bit(n, ph, gf, s1, s2, absmax1, absmax2, qmap1, qmap2, lut1, lut2, k, threads);
  else if (pair == 3) adam8bit(n, ph, gh, s1, s2, absmax1, absmax2, qmap1, qmap2, lut1, lut2, k, threads);
  else return -1;
  return 0;
}

// The lanes of the loops compiled here: 16 (AVX-512), 8 (AVX2 + FMA) or 1 (the scalar loops only).
int simd_lanes() {
#if defined(__AVX512F__) && defined(__AVX512BW__) || defined(__AVX2__) && defined(__FMA__)
  return static_cast<int>(kLanes);
#else
  return 1;
#endif
}

}  // extern "C"
