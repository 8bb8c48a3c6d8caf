// Sixteen-lane vectors for the CPU kernels, on AVX-512 or on AVX2.
//
// The kernels are written against 16 float32 (or int32) lanes: one zmm register on an
// AVX-512 CPU, a pair of ymm registers on an AVX2 one (AMD Zen 1-3, Intel client cores).
// Every function is the same lane-wise operation on both, so a lane's arithmetic is
// the same sequence of IEEE operations whichever register holds it: element-wise code
// gives the same bits on either CPU. Only the horizontal steps (reduce_add,
// sum_lanes16) may add in another tree; each is still a fixed function of its input,
// so batch invariance holds on either machine.
//
// Built with -march=native (kernels/cpu/extension.py): the backend is chosen by what
// the compiler may emit for this CPU.
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define PROTOSERVE_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PROTOSERVE_SIMD_AVX2 1
#else
#error "the CPU kernels need AVX-512 (F, BW, VL, DQ) or AVX2 with FMA and F16C"
#endif

// AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids): vdpbf16ps multiplies bfloat16 pairs into
// float32 lanes; the linear and attention kernels use it for bfloat16 weights and pools.
#if defined(PROTOSERVE_SIMD_AVX512) && defined(__AVX512BF16__)
#define PROTOSERVE_SIMD_BF16 1
#endif

namespace protoserve::simd {

using Mask = uint32_t;  // one bit per lane, lane 0 in bit 0

// The sum of 8 lanes in a fixed order (halves, then pairs, then the last two); both widths use it.
inline float reduce8_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(PROTOSERVE_SIMD_AVX512)

using F16 = __m512;   // 16 float32 lanes
using I16 = __m512i;  // 16 int32 lanes (or 64 bytes)

inline F16 load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline F16 set1(float x) { return _mm512_set1_ps(x); }
inline F16 zero() { return _mm512_setzero_ps(); }
inline F16 add(F16 a, F16 b) { return _mm512_add_ps(a, b); }
inline F16 sub(F16 a, F16 b) { return _mm512_sub_ps(a, b); }
inline F16 mul(F16 a, F16 b) { return _mm512_mul_ps(a, b); }
inline F16 div(F16 a, F16 b) { return _mm512_div_ps(a, b); }
inline F16 max(F16 a, F16 b) { return _mm512_max_ps(a, b); }
inline F16 fmadd(F16 a, F16 b, F16 c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline F16 fnmadd(F16 a, F16 b, F16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline F16 abs(F16 a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7fffffff))); }
// Round to nearest even, as torch.round.
inline F16 round(F16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float first(F16 a) { return _mm512_cvtss_f32(a); }
inline float reduce_add(F16 a) { return _mm512_reduce_add_ps(a); }
inline float reduce_max(F16 a) { return _mm512_reduce_max_ps(a); }
// y * 2^n for integral n whose result is a normal float (the only use: exp).
inline F16 scale_pow2(F16 y, F16 n) { return _mm512_scalef_ps(y, n); }

inline Mask first_lanes(int64_t n) { return n >= 16 ? 0xFFFFu : (1u << n) - 1u; }
inline F16 load_masked(Mask m, const float* p) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>(m), p); }
inline void store_masked(float* p, Mask m, F16 v) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>(m), v); }
inline F16 select(Mask m, F16 if_clear, F16 if_set) { return _mm512_mask_blend_ps(static_cast<__mmask16>(m), if_clear, if_set); }
inline F16 keep(Mask m, F16 a) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(m), a); }
inline Mask greater_equal(F16 a, F16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }

// Widening loads of 16 values.
inline F16 load_bf16(const uint16_t* p) {  // bfloat16 is float32's high half: exact
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline F16 load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#if defined(PROTOSERVE_SIMD_BF16)
// 16 values rounded to bfloat16, nearest even (as torch's .to(torch.bfloat16)).
inline void store_bf16(uint16_t* p, F16 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(a));
}
#endif
inline I16 load_i8_as_i32(const int8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I16 load_u8_as_i32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline I16 izero() { return _mm512_setzero_si512(); }
inline I16 iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline I16 iadd(I16 a, I16 b) { return _mm512_add_epi32(a, b); }
inline I16 iclamp(I16 a, int32_t lo, int32_t hi) { return _mm512_min_epi32(_mm512_max_epi32(a, _mm512_set1_epi32(lo)), _mm512_set1_epi32(hi)); }
inline int32_t ireduce_add(I16 a) { return _mm512_reduce_add_epi32(a); }
inline I16 iand(I16 a, I16 b) { return _mm512_and_si512(a, b); }
inline I16 shift_right(I16 a, int bits) { return _mm512_srli_epi32(a, bits); }
inline I16 shift_left(I16 a, int bits) { return _mm512_slli_epi32(a, bits); }
inline F16 to_float(I16 a) { return _mm512_cvtepi32_ps(a); }
inline I16 to_int(F16 a) { return _mm512_cvtps_epi32(a); }  // nearest even (the MXCSR default)
inline I16 iload(const void* p) { return _mm512_loadu_si512(p); }
inline void istore_i8_saturated(int8_t* p, I16 a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a)); }
inline I16 from_halves(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }

// out[u] = the sum of part[u]'s lanes, for 16 vectors at once: each output lane is the same
// fixed tree of its own vector's lanes ((l, l+8), then (l, l+4), (l, l+2), (l, l+1)), never
// mixed with another vector's.
inline F16 sum_lanes16(const F16 part[16]) {
  F16 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i) {  // (l, l+8): chunks 0,1 + chunks 2,3 of two vectors
    const F16 a = part[2 * i], b = part[2 * i + 1];
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // (l, l+4): chunk 0 + chunk 1 of each vector
    const F16 a = w[2 * i], b = w[2 * i + 1];
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // (l, l+2) inside each 128-bit chunk
    const F16 a = x[2 * i], b = x[2 * i + 1];
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x44), _mm512_shuffle_ps(a, b, 0xEE));
  }
  // (l, l+1): lane 4c + i now holds vector 4i + c; put them back in order.
  const F16 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// sum_lanes16 fed one vector at a time (put(0) .. put(15), in order, u known at compile time
// once the caller's loop is unrolled), so that a narrow backend can fold each vector as it comes
// instead of holding all sixteen. Here the sixteen zmm fit in registers: they are kept.
struct LaneSums16 {
  F16 part[16];
  inline void put(int u, F16 v) { part[u] = v; }
  inline F16 result() const { return sum_lanes16(part); }
};

// The maximum of the 16 lanes, in every lane (exact: max does not round).
inline F16 max_all_lanes(F16 x) {
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
  return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}

#else  // AVX2: two ymm halves, lanes 0-7 and 8-15

struct F16 {
  __m256 lo, hi;
};
struct I16 {
  __m256i lo, hi;
};

inline F16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 add(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 sub(F16 a, F16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline F16 mul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 div(F16 a, F16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline F16 max(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline F16 fmadd(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fnmadd(F16 a, F16 b, F16 c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 abs(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F16 round(F16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
inline float first(F16 a) { return _mm256_cvtss_f32(a.lo); }

inline float reduce_add(F16 a) { return reduce8_add(_mm256_add_ps(a.lo, a.hi)); }
inline float reduce_max(F16 a) {
  const __m256 v = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// y * 2^n for integral n in [-126, 127]: 2^n is then a normal float built from its exponent bits,
// and the product is exact wherever the result is normal (as vscalefps gives it).
inline __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline F16 scale_pow2(F16 y, F16 n) { return {_mm256_mul_ps(y.lo, pow2(n.lo)), _mm256_mul_ps(y.hi, pow2(n.hi))}; }

// The lanes of a mask as all-ones / all-zeros 32-bit words.
inline __m256i lane_words(Mask m) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bit), bit);
}
inline Mask first_lanes(int64_t n) { return n >= 16 ? 0xFFFFu : (1u << n) - 1u; }
inline F16 load_masked(Mask m, const float* p) {
  return {_mm256_maskload_ps(p, lane_words(m)), _mm256_maskload_ps(p + 8, lane_words(m >> 8))};
}
inline void store_masked(float* p, Mask m, F16 v) {
  _mm256_maskstore_ps(p, lane_words(m), v.lo);
  _mm256_maskstore_ps(p + 8, lane_words(m >> 8), v.hi);
}
inline F16 select(Mask m, F16 if_clear, F16 if_set) {
  return {_mm256_blendv_ps(if_clear.lo, if_set.lo, _mm256_castsi256_ps(lane_words(m))),
          _mm256_blendv_ps(if_clear.hi, if_set.hi, _mm256_castsi256_ps(lane_words(m >> 8)))};
}
inline F16 keep(Mask m, F16 a) { return select(m, zero(), a); }
inline Mask greater_equal(F16 a, F16 b) {
  const int lo = _mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ));
  const int hi = _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ));
  return static_cast<Mask>(lo | (hi << 8));
}

inline __m256 bf16x8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline F16 load_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline F16 load_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline I16 load_i8_as_i32(const int8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline I16 load_u8_as_i32(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}

inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 iset1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline I16 iadd(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I16 iclamp(I16 a, int32_t lo, int32_t hi) {
  const __m256i l = _mm256_set1_epi32(lo), h = _mm256_set1_epi32(hi);
  return {_mm256_min_epi32(_mm256_max_epi32(a.lo, l), h), _mm256_min_epi32(_mm256_max_epi32(a.hi, l), h)};
}
inline int32_t ireduce_add(I16 a) {
  const __m256i v = _mm256_add_epi32(a.lo, a.hi);
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
}
inline I16 iand(I16 a, I16 b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline I16 shift_right(I16 a, int bits) { return {_mm256_srli_epi32(a.lo, bits), _mm256_srli_epi32(a.hi, bits)}; }
inline I16 shift_left(I16 a, int bits) { return {_mm256_slli_epi32(a.lo, bits), _mm256_slli_epi32(a.hi, bits)}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline I16 to_int(F16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline I16 iload(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
// int32 -> int8 with saturation, as vpmovsdb: through int16 (also saturating, so the same values).
inline void istore_i8_saturated(int8_t* p, I16 a) {
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);  // lanes in order
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bytes);
}
inline I16 from_halves(__m256i lo, __m256i hi) { return {lo, hi}; }

// Eight vectors' lane sums in one ymm: out[u] = sum of v[u]'s 8 lanes (a fixed hadd tree).
inline __m256 sum_lanes8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [v0..v3 sums of lanes 0-3 | v0..v3 sums of lanes 4-7], b the same for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// out[u] = the sum of part[u]'s 16 lanes: (l, l+8) first, then a fixed tree inside each vector.
inline F16 sum_lanes16(const F16 part[16]) {
  __m256 half[16];
  for (int u = 0; u < 16; ++u) half[u] = _mm256_add_ps(part[u].lo, part[u].hi);
  return {sum_lanes8(half), sum_lanes8(half + 8)};
}

// sum_lanes16 fed one vector at a time (put(0) .. put(15), in order, u known at compile time once
// the caller's loop is unrolled): each vector folds to 8 lanes at once and pairs of them go through
// sum_lanes8's hadd tree as they arrive, so at most a few ymm are live instead of 32 (16 ymm in all).
// The same tree as sum_lanes16, so the same bits.
struct LaneSums16 {
  __m256 half[2];   // the pending folded vector of a pair
  __m256 pairs[2];  // hadd of pairs (0,1), (2,3) of the current quad
  __m256 quads[2];  // hadd of the quads of the current eight
  __m256 out[2];    // lanes 0-7, 8-15

  inline void put(int u, F16 v) {
    const __m256 folded = _mm256_add_ps(v.lo, v.hi);
    if ((u & 1) == 0) {
      half[0] = folded;
      return;
    }
    pairs[(u >> 1) & 1] = _mm256_hadd_ps(half[0], folded);
    if ((u & 3) != 3) return;
    quads[(u >> 2) & 1] = _mm256_hadd_ps(pairs[0], pairs[1]);
    if ((u & 7) != 7) return;
    out[u >> 3] = _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                                _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }
  inline F16 result() const { return {out[0], out[1]}; }
};

inline F16 max_all_lanes(F16 x) {
  __m256 m = _mm256_max_ps(x.lo, x.hi);
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 0x01));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4E));
  m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xB1));
  return {m, m};
}

#endif

}  // namespace protoserve::simd
