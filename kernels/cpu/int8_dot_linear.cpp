// Quantized linear layers on integer dot products: y = x @ W^T (+ bias) with
// W in 4- or 8-bit codes and x quantized on the fly to int8, as llama.cpp does
// for its Q4/Q8 matmuls.
//
// Why: widening int4 weights to float32 costs several vector instructions per
// 16 weights, which made the int4 decode step compute-bound well below the
// memory bandwidth. AVX-512 VNNI's vpdpbusd multiplies 64 unsigned 8-bit codes
// by 64 signed 8-bit activations and adds them into 16 int32 lanes in one
// instruction; unpacking two nibbles per byte is two more. Without VNNI (AVX2
// CPUs such as AMD Zen 1-3), vpmaddubsw multiplies 32 code pairs into int16
// pair sums, which add up exactly in int16 over one 32-value block of 4-bit
// codes (|sum| <= 8 * 2 * 15 * 127 < 2^15) and widen to int32 once per block:
// the same exact integers, so the same results. Batched rows reuse
// each unpacked weight vector, so prefill and large decode batches run at
// integer-FMA speed instead of float32 FMA speed.
//
// Numerics: every row's activations are cut into blocks of 32 values, each
// with its own scale sx = max|x| / 127 and codes round(x / sx) in -127..127,
// plus fine codes of what that rounding lost (step sx / 256), multiplied by the
// same unpacked weights. Coarse codes alone (llama.cpp's Q8 activations) cost
// greedy agreement with the float32 model; with fine codes it matches the
// float-activation figure (docs/notes/performance-log.md). Fine codes double the dot
// products, which costs nothing at decode (memory-bound) and shows on large
// batches. ActivationCodes::fine picks per call: off ("fast" activation
// precision) every path is compiled without the fine codes, their dot products
// and their accumulators, and a block's dot is the coarse sum alone in units of
// sx (mathematically the exact mode's scaling: sx / 256 and 256 * coarse differ
// by a power of two).
// Weights are w = q * s + m per (output channel, group along K) with unsigned
// codes q (int4: 0..15, s and m per group; int8: the signed code + 128, s per
// channel and m = -128 s), s and m stored as float16, as GGUF's Q4_1 does: at
// decode the step streams every weight from memory once, and float32 metadata
// would make a 32-value int4 group a fifth larger. One 32-value block of the dot product is then
//     sum_k w_k x_k  ~  s * (sx / 256) * (256 * sum_k q_k xq_k + sum_k q_k xf_k)  +  m * sum_k x_k,
// the first sum exact in int32, the second the block's exact float32 sum (so
// the offset term carries no activation rounding). The fine step is a power of two so that the
// coarse and fine sums join in integers (a shift and an add) and convert to float once: for int4,
// |256 * coarse + fine| < 2^24, so the joined dot is exact in float32 too. The epilogue's float
// work competes with vpdpbusd for the same two vector pipes on Zen 4, and joining them saves a
// conversion and an FMA per (row, channel vector, block).
//
// Batch invariance: each row is quantized alone, and the result for (row,
// channel) is the same sequence of float operations over its blocks in
// ascending order whatever the number of rows, the register tile it lands in
// or the thread that computes it.
//
// Layout (see kernels/cpu/packed_linear.py): output channels in vectors of 16;
// for each vector, K in blocks of 32, each block 256 (int4) or 512 (int8)
// bytes, read as 64-byte chunks in which channel c's four bytes are at
// [4c, 4c + 4). int4 chunk j of a block holds k = 8j..8j+3 in the low nibbles
// and 8j+4..8j+7 in the high ones; int8 chunk j holds k = 4j..4j+3.

#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define PROTOSERVE_AMX 1
#endif

namespace simd = protoserve::simd;
using simd::F16;
using simd::I16;

namespace {

constexpr int64_t LANES = 16;     // output channels per vector
constexpr int64_t BLOCK = 32;     // activation values per quantization block
// Register tile: channel vectors x rows. The AMX path's tile layout assumes CV = 2. AVX2's 16
// registers of half the width hold a quarter of the accumulators.
#if defined(PROTOSERVE_SIMD_AVX512)
constexpr int CV = 2;
constexpr int RT = 4;
#else
constexpr int CV = 1;
constexpr int RT = 2;
#endif
constexpr int64_t M_PANEL = 64;   // rows kept hot while a thread walks its channel tiles
constexpr int FINE_BITS = 8;  // fine codes step s / 256: |residual| <= s / 2 maps to -128..128, clamped to +-127
constexpr float FINE_STEPS = 1 << FINE_BITS;

// The rows' activations: int8 coarse and fine codes, per (row, block) the scale and exact float sum.
// Codes are in groups of 16 rows, block-major inside a group, [M / 16][blocks][16][32]: block b of
// rows r..r+15 is 512 contiguous bytes, which an AMX tile loads as 8 cache lines instead of 16 rows
// strided K bytes apart, and a register tile's rows walk their blocks 512 bytes apart (block-major
// over all M rows put them M * 32 bytes apart: at prefill's hundreds of rows every block of a row
// fell in the same few L1 sets, and the tile's codes came from L2).
constexpr int64_t ROW_GROUP = protoserve::ActivationCodes::ROW_GROUP;
// Offset of row r's block 0 in either code array; its block b is b * ROW_GROUP * BLOCK further.
inline int64_t row_codes(int64_t r, int64_t blocks) {
  return ((r / ROW_GROUP) * blocks * ROW_GROUP + r % ROW_GROUP) * BLOCK;
}

struct QuantizedRows {
  const int8_t* coarse;
  const int8_t* fine;
  const float* scales;  // per (row, block): sx / 256, the step of the joined coarse and fine codes
  const float* sums;
  const int32_t* code_sums;  // [2, M, blocks]: coarse, then fine (filled only where CODE_SUMS)
  int64_t M;
  int64_t blocks;

  const int8_t* coarse_at(int64_t r, int64_t b) const { return coarse + row_codes(r, blocks) + b * ROW_GROUP * BLOCK; }
  const int8_t* fine_at(int64_t r, int64_t b) const { return fine + row_codes(r, blocks) + b * ROW_GROUP * BLOCK; }
  int32_t coarse_sum(int64_t r, int64_t b) const { return code_sums[r * blocks + b]; }
  int32_t fine_sum(int64_t r, int64_t b) const { return code_sums[(M + r) * blocks + b]; }
};

// Only the AVX2 int8 path reads the sums of a block's codes; VNNI skips their reductions.
#if defined(__AVX512VNNI__)
constexpr bool CODE_SUMS = false;
#else
constexpr bool CODE_SUMS = true;
#endif

// Block b of a register tile's R rows: their codes, and the sums of those codes (for the AVX2
// int8 path's offset).
template <int R, bool FINE>
struct BlockRows {
  const int8_t* coarse[R];
  const int8_t* fine[R];
  int32_t coarse_sum[R];
  int32_t fine_sum[R];

  BlockRows(const QuantizedRows& x, int64_t m0, int64_t b) {
    for (int r = 0; r < R; ++r) {
      coarse[r] = x.coarse_at(m0 + r, b);
      if constexpr (FINE) fine[r] = x.fine_at(m0 + r, b);
      if constexpr (CODE_SUMS) {
        coarse_sum[r] = x.coarse_sum(m0 + r, b);
        if constexpr (FINE) fine_sum[r] = x.fine_sum(m0 + r, b);
      }
    }
  }
};

// One row's blocks, in a fixed order per block (so the same row always gives the same codes); the
// codes of block b go to coarse/fine + b * block_stride.
// coarse = round(x / s), s = max|x| / 127; fine = round((x - coarse * s) / (s / 256)): the
// rounding error of the coarse codes, itself in int8 (|x - coarse * s| <= s / 2; the +-128 of an
// exact tie is clamped to +-127, and -128 never occurs: the AVX2 int8 path negates codes).
// scales[b] gets s / 256 (exact: a power of two), the scale of 256 * coarse + fine; without FINE,
// s itself, and only the coarse codes are written.
template <bool FINE>
void quantize_row(const float* x, int64_t blocks, int64_t block_stride, int8_t* coarse, int8_t* fine, float* scales,
                  float* sums, int32_t* coarse_sums, int32_t* fine_sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * BLOCK;
    const F16 v[2] = {simd::load(xb), simd::load(xb + LANES)};
    const float amax = simd::reduce_max(simd::max(simd::abs(v[0]), simd::abs(v[1])));
    sums[b] = simd::reduce_add(simd::add(v[0], v[1]));
    if (amax == 0.0f) {
      scales[b] = 0.0f;
      std::fill(coarse + b * block_stride, coarse + b * block_stride + BLOCK, int8_t{0});
      coarse_sums[b] = 0;
      if constexpr (FINE) {
        std::fill(fine + b * block_stride, fine + b * block_stride + BLOCK, int8_t{0});
        fine_sums[b] = 0;
      }
      continue;
    }
    const float scale = amax / 127.0f;
    scales[b] = FINE ? scale * (1.0f / FINE_STEPS) : scale;
    const F16 inv = simd::set1(127.0f / amax);
    const F16 vscale = simd::set1(scale);
    const F16 fine_inv = simd::set1(FINE_STEPS / scale);
    I16 coarse_total = simd::izero(), fine_total = simd::izero();
    for (int h = 0; h < 2; ++h) {
      // Round to nearest even (the default MXCSR mode), as torch.round does in the reference.
      const F16 q = simd::round(simd::mul(v[h], inv));
      // The stored (saturated) codes, summed from registers: reading back the bytes just stored
      // stalls on store forwarding, which made quantizing cost a third of a small linear layer.
      const I16 qc = simd::iclamp(simd::to_int(q), -127, 127);
      simd::istore_i8_saturated(coarse + b * block_stride + h * LANES, qc);
      if constexpr (CODE_SUMS) coarse_total = simd::iadd(coarse_total, qc);
      if constexpr (FINE) {
        const F16 residual = simd::sub(v[h], simd::mul(q, vscale));
        const I16 qf = simd::iclamp(simd::to_int(simd::mul(residual, fine_inv)), -127, 127);
        simd::istore_i8_saturated(fine + b * block_stride + h * LANES, qf);
        if constexpr (CODE_SUMS) fine_total = simd::iadd(fine_total, qf);
      }
    }
    if constexpr (CODE_SUMS) {
      coarse_sums[b] = simd::ireduce_add(coarse_total);
      if constexpr (FINE) fine_sums[b] = simd::ireduce_add(fine_total);
    }
  }
}

// The codes of one 32-value block times the rows' activation codes, into int32 lanes: `acc` for
// the coarse codes and `acc_fine` for the fine ones (the same weights, loaded once).
// int4: 4 chunks, each two code vectors (k 8j..8j+3 in the low nibbles, 8j+4..8j+7 in the high).
// int8 (+128, unsigned): 8 chunks of k 4j..4j+3.
#if defined(__AVX512VNNI__)
struct Int4Codes {
  static constexpr int64_t BLOCK_BYTES = 256;
  template <int R, bool FINE>
  static inline void block(const uint8_t* w, int64_t stride, const BlockRows<R, FINE>& x, I16 acc[R][CV],
                           I16 acc_fine[R][CV]) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CV; ++c) {
        acc[r][c] = _mm512_setzero_si512();
        if constexpr (FINE) acc_fine[r][c] = _mm512_setzero_si512();
      }
    for (int j = 0; j < 4; ++j) {
      __m512i lo[CV], hi[CV];
      for (int c = 0; c < CV; ++c) {
        const __m512i bytes = _mm512_loadu_si512(w + c * stride + j * 64);
        lo[c] = _mm512_and_si512(bytes, nibble);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xlo = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.coarse[r] + 8 * j));
        const __m512i xhi = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.coarse[r] + 8 * j + 4));
        for (int c = 0; c < CV; ++c) {
          acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo[c], xlo);
          acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi[c], xhi);
        }
        if constexpr (!FINE) continue;
        const __m512i flo = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.fine[r] + 8 * j));
        const __m512i fhi = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.fine[r] + 8 * j + 4));
        for (int c = 0; c < CV; ++c) {
          acc_fine[r][c] = _mm512_dpbusd_epi32(acc_fine[r][c], lo[c], flo);
          acc_fine[r][c] = _mm512_dpbusd_epi32(acc_fine[r][c], hi[c], fhi);
        }
      }
    }
  }
};

struct Int8Codes {
  static constexpr int64_t BLOCK_BYTES = 512;
  template <int R, bool FINE>
  static inline void block(const uint8_t* w, int64_t stride, const BlockRows<R, FINE>& x, I16 acc[R][CV],
                           I16 acc_fine[R][CV]) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CV; ++c) {
        acc[r][c] = _mm512_setzero_si512();
        if constexpr (FINE) acc_fine[r][c] = _mm512_setzero_si512();
      }
    // Unrolled: as a loop, GCC copies the 16 accumulators between registers each iteration and
    // spills some, which ran the int8 head at half the int4 layers' rate.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i q[CV];
      for (int c = 0; c < CV; ++c) q[c] = _mm512_loadu_si512(w + c * stride + j * 64);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.coarse[r] + 4 * j));
        for (int c = 0; c < CV; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], q[c], xv);
        if constexpr (!FINE) continue;
        const __m512i fv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x.fine[r] + 4 * j));
        for (int c = 0; c < CV; ++c) acc_fine[r][c] = _mm512_dpbusd_epi32(acc_fine[r][c], q[c], fv);
      }
    }
  }
};
#else
// vpmaddubsw: unsigned codes (<= 15) times signed activation codes (-127..127), adjacent pairs
// added into int16 lanes, then the block's pair sums added in int16 (8 per lane: |sum| <= 30,480,
// no overflow) and widened to the int32 sums of four products by vpmaddwd against ones.
struct NibbleDot {
  __m256i sum[2];  // channels 0-7 and 8-15 of one vector: int16 pair sums

  NibbleDot() : sum{_mm256_setzero_si256(), _mm256_setzero_si256()} {}

  // codes: the 64-byte chunk's nibbles of this vector (one byte per code, 4 per channel);
  // x4: the 4 activation codes of that chunk, broadcast.
  inline void add(const __m256i codes[2], __m256i x4) {
    sum[0] = _mm256_add_epi16(sum[0], _mm256_maddubs_epi16(codes[0], x4));
    sum[1] = _mm256_add_epi16(sum[1], _mm256_maddubs_epi16(codes[1], x4));
    // Keep the sums a chain in registers: integer adds are associative, and GCC otherwise turns a
    // block's 8 adds into a tree that needs every product at once and spills them to the stack.
    asm("" : "+x"(sum[0]), "+x"(sum[1]));
  }

  inline I16 widen() const {
    const __m256i ones = _mm256_set1_epi16(1);
    return simd::from_halves(_mm256_madd_epi16(sum[0], ones), _mm256_madd_epi16(sum[1], ones));
  }
};

inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(p)); }

// One 64-byte chunk's low and high nibbles, each as two 32-byte halves.
inline void nibbles(const uint8_t* chunk, __m256i lo[2], __m256i hi[2]) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * h));
    lo[h] = _mm256_and_si256(bytes, nibble);
    hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
  }
}

struct Int4Codes {
  static constexpr int64_t BLOCK_BYTES = 256;
  template <int R, bool FINE>
  static inline void block(const uint8_t* w, int64_t stride, const BlockRows<R, FINE>& x, I16 acc[R][CV],
                           I16 acc_fine[R][CV]) {
    NibbleDot coarse[R][CV], fine[R][CV];
    for (int j = 0; j < 4; ++j) {
      __m256i lo[CV][2], hi[CV][2];
      for (int c = 0; c < CV; ++c) nibbles(w + c * stride + j * 64, lo[c], hi[c]);
      for (int r = 0; r < R; ++r) {
        const __m256i xlo = broadcast4(x.coarse[r] + 8 * j), xhi = broadcast4(x.coarse[r] + 8 * j + 4);
        for (int c = 0; c < CV; ++c) {
          coarse[r][c].add(lo[c], xlo);
          coarse[r][c].add(hi[c], xhi);
        }
        if constexpr (FINE) {
          const __m256i flo = broadcast4(x.fine[r] + 8 * j), fhi = broadcast4(x.fine[r] + 8 * j + 4);
          for (int c = 0; c < CV; ++c) {
            fine[r][c].add(lo[c], flo);
            fine[r][c].add(hi[c], fhi);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CV; ++c) {
        acc[r][c] = coarse[r][c].widen();
        if constexpr (FINE) acc_fine[r][c] = fine[r][c].widen();
      }
  }
};

// 8-bit codes are too wide for int16 pair sums of unsigned codes (2 * 255 * 127 > 2^15), so the
// stored q + 128 goes back to the signed q (-127..127) and the activation's sign moves onto it:
// |x| * (q * sign(x)) = q * x, pairs within 2 * 127 * 127 < 2^15, widened to int32 at every chunk.
// q + 128's sums are then q's plus 128 * the block's code sum (quantize_row's, computed once per
// row and block): the same integers vpdpbusd gives.

struct SignedDot {
  __m256i sum[2];  // channels 0-7 and 8-15 of one vector: int32

  SignedDot() : sum{_mm256_setzero_si256(), _mm256_setzero_si256()} {}

  // q: the chunk's signed codes of this vector (two halves); x4 / ax4: 4 activation codes and their |.|.
  inline void add(const __m256i q[2], __m256i x4, __m256i ax4) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h)
      sum[h] = _mm256_add_epi32(sum[h], _mm256_madd_epi16(_mm256_maddubs_epi16(ax4, _mm256_sign_epi8(q[h], x4)), ones));
    asm("" : "+x"(sum[0]), "+x"(sum[1]));  // a chain in registers, as NibbleDot's
  }

  inline I16 finish(__m256i offset) const {
    return simd::from_halves(_mm256_add_epi32(sum[0], offset), _mm256_add_epi32(sum[1], offset));
  }
};

struct Int8Codes {
  static constexpr int64_t BLOCK_BYTES = 512;
  template <int R, bool FINE>
  static inline void block(const uint8_t* w, int64_t stride, const BlockRows<R, FINE>& x, I16 acc[R][CV],
                           I16 acc_fine[R][CV]) {
    const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
    SignedDot coarse[R][CV], fine[R][CV];
    for (int j = 0; j < 8; ++j) {
      __m256i q[CV][2];
      for (int c = 0; c < CV; ++c)
        for (int h = 0; h < 2; ++h)
          q[c][h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * stride + j * 64 + 32 * h)), bias);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast4(x.coarse[r] + 4 * j);
        const __m256i ax = _mm256_abs_epi8(xv);
        for (int c = 0; c < CV; ++c) coarse[r][c].add(q[c], xv, ax);
        if constexpr (FINE) {
          const __m256i fv = broadcast4(x.fine[r] + 4 * j);
          const __m256i af = _mm256_abs_epi8(fv);
          for (int c = 0; c < CV; ++c) fine[r][c].add(q[c], fv, af);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i coarse_offset = _mm256_set1_epi32(128 * x.coarse_sum[r]);
      for (int c = 0; c < CV; ++c) acc[r][c] = coarse[r][c].finish(coarse_offset);
      if constexpr (FINE) {
        const __m256i fine_offset = _mm256_set1_epi32(128 * x.fine_sum[r]);
        for (int c = 0; c < CV; ++c) acc_fine[r][c] = fine[r][c].finish(fine_offset);
      }
    }
  }
};
#endif

// 256 * coarse + fine in int32, then float: the block's dot in units of sx / 256 (without FINE, the
// coarse sum alone, in units of sx: quantize_row stored the matching scale).
template <bool FINE>
inline F16 joined_dot(I16 coarse, I16 fine) {
  if constexpr (FINE)
    return simd::to_float(simd::iadd(simd::shift_left(coarse, FINE_BITS), fine));
  else
    return simd::to_float(coarse);
}

struct Problem {
  const uint8_t* data;    // [Nv, K/32, BLOCK_BYTES]
  const uint16_t* scales;  // [Nv, groups, 16] float16
  const uint16_t* mins;    // [Nv, groups, 16] float16
  const float* bias;      // [N] or null
  float* out;             // [M, N]
  int64_t N, Nv, groups, blocks_per_group;
};

// Rows [m0, m0 + R) against channel vectors [v0, v0 + cv) (cv <= CV; a short last tile reads vector v0 twice).
// `ahead`: where the next tile's weights start (null: none), asked into L2 block by block while this
// tile runs, so the next tile's first rows do not wait on memory for each block in turn.
template <typename Codes, int R, bool FINE>
void tile(const Problem& p, const QuantizedRows& x, int64_t m0, int64_t v0, int cv, const uint8_t* ahead) {
  const int64_t blocks = x.blocks;
  const int64_t stride = blocks * Codes::BLOCK_BYTES;  // bytes of one channel vector
  const int64_t v_second = cv > 1 ? v0 + 1 : v0;
  const uint8_t* w = p.data + v0 * stride;
  F16 accf[R][CV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) accf[r][c] = simd::zero();
  for (int64_t b = 0; b < blocks; ++b) {
    if (ahead != nullptr)
      for (int64_t off = 0; off < CV * Codes::BLOCK_BYTES; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + CV * b * Codes::BLOCK_BYTES + off), _MM_HINT_T1);
    I16 acc[R][CV], acc_fine[R][CV];
    Codes::template block<R, FINE>(w + b * Codes::BLOCK_BYTES, (v_second - v0) * stride,
                                   BlockRows<R, FINE>(x, m0, b), acc, acc_fine);
    const int64_t g = b / p.blocks_per_group;
    for (int c = 0; c < CV; ++c) {
      const int64_t v = c == 0 ? v0 : v_second;
      const F16 s = simd::load_half(p.scales + (v * p.groups + g) * LANES);
      const F16 mn = simd::load_half(p.mins + (v * p.groups + g) * LANES);
      for (int r = 0; r < R; ++r) {
        const int64_t row_block = (m0 + r) * blocks + b;
        const F16 sx = simd::mul(s, simd::set1(x.scales[row_block]));
        const F16 dot = joined_dot<FINE>(acc[r][c], acc_fine[r][c]);
        accf[r][c] = simd::fmadd(dot, sx, accf[r][c]);
        accf[r][c] = simd::fmadd(mn, simd::set1(x.sums[row_block]), accf[r][c]);
      }
    }
  }
  for (int c = 0; c < cv; ++c) {
    const int64_t n0 = (v0 + c) * LANES;
    const int64_t valid = std::min<int64_t>(LANES, p.N - n0);
    const simd::Mask mask = simd::first_lanes(valid);
    const F16 bias = p.bias ? simd::load_masked(mask, p.bias + n0) : simd::zero();
    for (int r = 0; r < R; ++r) simd::store_masked(p.out + (m0 + r) * p.N + n0, mask, simd::add(accf[r][c], bias));
  }
}

#if defined(PROTOSERVE_AMX)
// AMX (Sapphire Rapids and later): TDPBSUD multiplies a 16 x 32 tile of int8 activation codes by
// an 8 x 64-byte tile of unsigned weight codes (K = 32: one quantization block of 16 channels, in
// the same 4-bytes-per-channel order the VNNI chunks use) into 16 x 16 int32 sums, ~16x the
// multiply-adds of one vpdpbusd per instruction. The sums are exact integers, the same ones the
// VNNI tile accumulates, and the float epilogue below repeats its float operations in its order,
// so a row's result is bit for bit the same whichever path computed it: batch invariance holds
// across the switch from VNNI (short batches, tails) to AMX (16-row groups).
constexpr int64_t AMX_ROWS = 16;
constexpr int64_t AMX_PANEL = 32;  // rows kept in L1 (codes, sums, float accumulators) while the blocks stream

// Linux gives a process the 8 KB tile state only on request (arch_prctl, since 5.16).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
    constexpr long XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
}

// Tiles 0-1: coarse and fine activation codes (16 rows x 32 bytes); 2-3: the weight blocks of two
// channel vectors (8 rows x 64 bytes); 4-7: int32 sums (16 x 16) for (coarse, fine) x 2 vectors.
// Without fine codes tiles 1, 5 and 7 stay unused.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.colsb[t] = BLOCK, cfg.rows[t] = AMX_ROWS;
  for (int t = 2; t < 4; ++t) cfg.colsb[t] = 64, cfg.rows[t] = BLOCK / 4;
  for (int t = 4; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = AMX_ROWS;
  _tile_loadconfig(&cfg);
}

// One block of one channel vector as a B tile: 8 rows of 64 bytes, row i holding k = 4i..4i+3.
// int8 blocks are already that; int4 chunk j unpacks to rows 2j (low nibbles) and 2j+1 (high).
template <typename Codes>
inline const uint8_t* weight_tile(const uint8_t* block, uint8_t* buffer) {
  if constexpr (Codes::BLOCK_BYTES == 512) {
    return block;
  } else {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i bytes = _mm512_loadu_si512(block + j * 64);
      _mm512_store_si512(buffer + 128 * j, _mm512_and_si512(bytes, nibble));
      _mm512_store_si512(buffer + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
    }
    return buffer;
  }
}

// The int32 sums of one block for a panel's 16-row groups: (coarse, fine) x 2 channel vectors.
using BlockSums = int32_t[AMX_PANEL / AMX_ROWS][4][AMX_ROWS][LANES];

// The VNNI tile's epilogue, operation for operation, for block b of every group in the panel.
template <bool FINE>
inline void amx_epilogue(const Problem& p, const QuantizedRows& x, const BlockSums& sums, int64_t m0,
                         int64_t groups, int64_t b, int64_t v0, int64_t v_second,
                         float (*accf)[CV][LANES]) {
  const int64_t g = b / p.blocks_per_group;
  F16 s[CV], mn[CV];
  for (int c = 0; c < CV; ++c) {
    const int64_t v = c == 0 ? v0 : v_second;
    s[c] = simd::load_half(p.scales + (v * p.groups + g) * LANES);
    mn[c] = simd::load_half(p.mins + (v * p.groups + g) * LANES);
  }
  for (int64_t grp = 0; grp < groups; ++grp) {
    for (int64_t r = 0; r < AMX_ROWS; ++r) {
      const int64_t row_block = (m0 + grp * AMX_ROWS + r) * x.blocks + b;
      const F16 row_scale = simd::set1(x.scales[row_block]);
      const F16 row_sum = simd::set1(x.sums[row_block]);
      for (int c = 0; c < CV; ++c) {
        float* a = accf[grp * AMX_ROWS + r][c];
        const F16 sx = simd::mul(s[c], row_scale);
        const I16 coarse = simd::iload(sums[grp][2 * c][r]);
        const F16 dot = joined_dot<FINE>(coarse, FINE ? simd::iload(sums[grp][2 * c + 1][r]) : coarse);
        F16 acc = simd::fmadd(dot, sx, simd::load(a));
        acc = simd::fmadd(mn[c], row_sum, acc);
        simd::store(a, acc);
      }
    }
  }
}

// Rows [m0, m0 + groups * 16) against channel vectors [v0, v0 + cv), written to out.
// Software-pipelined: the tiles of block b are stored while the epilogue reads block b - 1's sums,
// because a vector load of bytes a tile store just wrote waits for the store to reach L1.
template <typename Codes, bool FINE>
void amx_tile(const Problem& p, const QuantizedRows& x, int64_t m0, int64_t groups, int64_t v0, int cv) {
  const int64_t blocks = x.blocks;
  const int64_t stride = blocks * Codes::BLOCK_BYTES;
  const int64_t v_second = cv > 1 ? v0 + 1 : v0;
  const int64_t rows = groups * AMX_ROWS;
  alignas(64) float accf[AMX_PANEL][CV][LANES];
  alignas(64) BlockSums sums[2];
  alignas(64) uint8_t unpacked[CV][512];
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < CV; ++c) simd::store(accf[r][c], simd::zero());
  for (int64_t b = 0; b < blocks; ++b) {
    _tile_loadd(2, weight_tile<Codes>(p.data + v0 * stride + b * Codes::BLOCK_BYTES, unpacked[0]), 64);
    _tile_loadd(3, weight_tile<Codes>(p.data + v_second * stride + b * Codes::BLOCK_BYTES, unpacked[1]), 64);
    BlockSums& out = sums[b & 1];
    for (int64_t grp = 0; grp < groups; ++grp) {
      const int64_t r0 = m0 + grp * AMX_ROWS;
      _tile_loadd(0, x.coarse_at(r0, b), BLOCK);
      _tile_zero(4);
      _tile_zero(6);
      _tile_dpbsud(4, 0, 2);
      _tile_dpbsud(6, 0, 3);
      _tile_stored(4, out[grp][0], 64);
      _tile_stored(6, out[grp][2], 64);
      if constexpr (FINE) {
        _tile_loadd(1, x.fine_at(r0, b), BLOCK);
        _tile_zero(5);
        _tile_zero(7);
        _tile_dpbsud(5, 1, 2);
        _tile_dpbsud(7, 1, 3);
        _tile_stored(5, out[grp][1], 64);
        _tile_stored(7, out[grp][3], 64);
      }
    }
    if (b > 0) amx_epilogue<FINE>(p, x, sums[(b - 1) & 1], m0, groups, b - 1, v0, v_second, accf);
  }
  amx_epilogue<FINE>(p, x, sums[(blocks - 1) & 1], m0, groups, blocks - 1, v0, v_second, accf);
  for (int c = 0; c < cv; ++c) {
    const int64_t n0 = (v0 + c) * LANES;
    const int64_t valid = std::min<int64_t>(LANES, p.N - n0);
    const simd::Mask mask = simd::first_lanes(valid);
    const F16 bias = p.bias ? simd::load_masked(mask, p.bias + n0) : simd::zero();
    for (int64_t r = 0; r < rows; ++r)
      simd::store_masked(p.out + (m0 + r) * p.N + n0, mask, simd::add(simd::load(accf[r][c]), bias));
  }
}
#endif

// The register tile of `rows` (1..RT) rows.
template <typename Codes, bool FINE, int R = RT>
inline void dispatch_tile(const Problem& p, const QuantizedRows& x, int64_t m0, int64_t rows, int64_t v0, int cv,
                          const uint8_t* ahead) {
  if constexpr (R > 1) {
    if (rows < R) return dispatch_tile<Codes, FINE, R - 1>(p, x, m0, rows, v0, cv, ahead);
  }
  tile<Codes, R, FINE>(p, x, m0, v0, cv, ahead);
}

// Rows [m0, m1) against channel vectors [v0, v0 + cv) on the vector register tiles (VNNI or AVX2);
// the first register tile asks for the next tile's weights (`ahead`, null for none).
template <typename Codes, bool FINE>
void vector_rows(const Problem& p, const QuantizedRows& x, int64_t m0, int64_t m1, int64_t v0, int cv,
                 const uint8_t* ahead = nullptr) {
  for (; m0 < m1; m0 += RT, ahead = nullptr)
    dispatch_tile<Codes, FINE>(p, x, m0, std::min<int64_t>(RT, m1 - m0), v0, cv, ahead);
}

template <typename Codes, bool FINE>
void run(const Problem& p, const QuantizedRows& x, int64_t M, const protoserve::Team* team) {
  const int64_t tiles = (p.Nv + CV - 1) / CV;
#if defined(PROTOSERVE_AMX)
  // Whole 16-row groups go to AMX; the rest (a decode step's few rows, a batch's tail) to VNNI.
  const int64_t amx_rows = amx_permitted() ? M / AMX_ROWS * AMX_ROWS : 0;
  if (amx_rows > 0) {
    protoserve::for_range(team, tiles, 1, [&](int64_t t0, int64_t t1) {
      configure_tiles();  // tile configuration is per thread
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t v0 = t * CV;
        const int cv = static_cast<int>(std::min<int64_t>(CV, p.Nv - v0));
        for (int64_t p0 = 0; p0 < amx_rows; p0 += AMX_PANEL)
          amx_tile<Codes, FINE>(p, x, p0, std::min<int64_t>(AMX_PANEL, amx_rows - p0) / AMX_ROWS, v0, cv);
        vector_rows<Codes, FINE>(p, x, amx_rows, M, v0, cv);
      }
      _tile_release();  // drop the tile state: context switches then need not save it
    });
    return;
  }
#endif
  const int64_t stride = x.blocks * Codes::BLOCK_BYTES;  // bytes of one channel vector
  // Decode reads every weight once: a tile is ~K * 32 codes, give each thread a few.
  protoserve::for_range(team, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t p0 = 0; p0 < M; p0 += M_PANEL) {
      const int64_t p1 = std::min(M, p0 + M_PANEL);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t v0 = t * CV;
        const int cv = static_cast<int>(std::min<int64_t>(CV, p.Nv - v0));
        // The next tile's weights (a whole tile: not past the last vector) come from memory while
        // this one computes; on later panels they are already in cache and the hint is cheap.
        const uint8_t* ahead = t + 1 < t1 && (t + 2) * CV <= p.Nv ? p.data + (t + 1) * CV * stride : nullptr;
        vector_rows<Codes, FINE>(p, x, p0, p1, v0, cv, ahead);
      }
    }
  });
}

}  // namespace

namespace protoserve {

bool int8_dot_amx_available() {
#if defined(PROTOSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

void int8_dot_linear_into(const LinearWeights& w, int bits, const float* x, int64_t M, int64_t K, float* out,
                          ActivationCodes& codes, const Team* team) {
  const int64_t N = w.out_features, blocks = K / BLOCK, Nv = (N + LANES - 1) / LANES;
  int8_t* cp = codes.codes.data();
  float* sp = codes.scales.data();
  float* up = codes.sums.data();
  int32_t* csp = codes.code_sums.data();
  const bool fine = codes.fine;
  // Each member quantizes its share of the rows; the tiles then read every row.
  int8_t* const fp = cp + ActivationCodes::padded_rows(M) * K;
  protoserve::for_range(team, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      (fine ? quantize_row<true> : quantize_row<false>)(x + r * K, blocks, ROW_GROUP * BLOCK, cp + row_codes(r, blocks),
                                                          fp + row_codes(r, blocks), sp + r * blocks, up + r * blocks,
                                                          csp + r * blocks, csp + (M + r) * blocks);
  });
  if (team != nullptr) team->sync();
  const QuantizedRows rows{cp, fp, sp, up, csp, M, blocks};
  const Problem p{w.data.data_ptr<uint8_t>(),
                  reinterpret_cast<const uint16_t*>(w.scales->data_ptr()),
                  reinterpret_cast<const uint16_t*>(w.mins->data_ptr()),
                  w.bias.has_value() ? w.bias->data_ptr<float>() : nullptr,
                  out,
                  N,
                  Nv,
                  K / w.group_size,
                  w.group_size / BLOCK};
  if (bits == 4)
    (fine ? run<Int4Codes, true> : run<Int4Codes, false>)(p, rows, M, team);
  else
    (fine ? run<Int8Codes, true> : run<Int8Codes, false>)(p, rows, M, team);
  if (team != nullptr) team->sync();
}

}  // namespace protoserve
