// Weight-stationary linear layers for the CPU: y = x @ W^T (+ bias), x float32 [M, K].
//
// Decode multiplies a handful of rows by every weight of the model each step, so
// on this hardware the step is bound by reading weights from memory, not by
// arithmetic. The weights are therefore stored in the narrowest format the
// model allows (float32, bfloat16, int8 per-channel, int4 grouped), widened to
// float32 in registers, and each widened vector is reused for up to four input
// rows before the next one is loaded.
//
// Packed layout (see kernels/cpu/packed_linear.py): output channels in blocks
// of NB = 4, and within a block the K dimension in chunks of 16 values, the
// four channels' chunks side by side, so one thread streams one contiguous
// region. int4 chunks hold 32 values per 16 bytes (low nibbles: the first 16,
// high nibbles: the next 16).
//
// bfloat16 weights on CPUs with AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids) multiply in
// bfloat16 instead: each row of x is rounded to bfloat16 once per call (as a bf16 matmul's inputs
// are) and vdpbf16ps multiplies 32 bf16 pairs into 16 float32 lanes, twice the multiply-adds of a
// float32 FMA, with no widening of the weights. Lane i of a 64-byte load of the pack holds
// channel (i / 8) of a pair, k = 2 (i % 8), +1; the row's 16 values of the chunk are broadcast to
// both 256-bit halves. Per (row, channel): one chain over the chunks in ascending order, then a
// fixed 8-lane sum.
//
// Batch invariance: the result for (row m, channel n) is one fused multiply-add
// chain over the 16-value chunks in ascending order, followed by the same
// horizontal reduction, whatever M is, whichever rows share a register tile and
// however the channel blocks are split across threads. So a row's output is
// bit-identical alone, in a batch, or in a prompt chunk of any size.

#include "kernels.h"
#include "simd.h"

#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace simd = protoserve::simd;
using simd::F16;

namespace {

constexpr int64_t NB = 4;    // output channels per block
// Input rows per register tile: 4 x NB accumulators fill AVX-512's 32 registers; AVX2 has 16 of half
// the width, so 2.
#if defined(PROTOSERVE_SIMD_AVX512)
constexpr int MB = 4;
#else
constexpr int MB = 2;
#endif
constexpr int64_t CHUNK = 16;
constexpr int64_t M_PANEL = 64;  // input rows kept hot while a thread walks its channel blocks

// I4_DOT / I8_DOT: codes for int8_dot_linear.cpp (activations quantized to int8 too).
enum class Format : int64_t { F32 = 0, BF16 = 1, I8 = 2, I4 = 3, I4_DOT = 4, I8_DOT = 5 };

// Widen the four channels' chunk `kc` of block `nb` to float32.
struct F32Weights {
  const float* data;
  int64_t chunks;  // K / 16
  inline void load(int64_t nb, int64_t kc, F16 w[NB]) const {
    const float* p = data + (nb * chunks + kc) * NB * CHUNK;
    for (int j = 0; j < NB; ++j) w[j] = simd::load(p + j * CHUNK);
  }
};

struct BF16Weights {
  const uint16_t* data;
  int64_t chunks;
  inline void load(int64_t nb, int64_t kc, F16 w[NB]) const {
    const uint16_t* p = data + (nb * chunks + kc) * NB * CHUNK;
    for (int j = 0; j < NB; ++j) w[j] = simd::load_bf16(p + j * CHUNK);
  }
};

// Per-channel scale is applied once to the finished dot product (see finish()).
struct I8Weights {
  const int8_t* data;
  int64_t chunks;
  inline void load(int64_t nb, int64_t kc, F16 w[NB]) const {
    const int8_t* p = data + (nb * chunks + kc) * NB * CHUNK;
    for (int j = 0; j < NB; ++j) w[j] = simd::to_float(simd::load_i8_as_i32(p + j * CHUNK));
  }
};

// w = q * scale + min per group of `group` input columns (min = zero - 8 * scale).
struct I4Weights {
  const uint8_t* data;    // [Nb, K/32, NB, 16]
  const float* scales;    // [Nb, K/group, NB]
  const float* mins;      // [Nb, K/group, NB]
  int64_t chunks;         // K / 16
  int64_t groups;         // K / group
  int group_shift;        // log2(group / 16): a shift, not a division, per chunk
  inline void load(int64_t nb, int64_t kc, F16 w[NB]) const {
    const uint8_t* p = data + ((nb * (chunks >> 1) + (kc >> 1)) * NB) * CHUNK;
    const int64_t g = kc >> group_shift;
    const float* s = scales + (nb * groups + g) * NB;
    const float* m = mins + (nb * groups + g) * NB;
    const simd::I16 low_nibble = simd::iset1(0xF);
    for (int j = 0; j < NB; ++j) {
      const simd::I16 bytes = simd::load_u8_as_i32(p + j * CHUNK);
      const simd::I16 q = (kc & 1) ? simd::shift_right(bytes, 4) : simd::iand(bytes, low_nibble);
      w[j] = simd::fmadd(simd::to_float(q), simd::set1(s[j]), simd::set1(m[j]));
    }
  }
};

// A register tile's R x NB sums into out (rows m0.., channels of block nb below N): the per-channel
// scale first, then the bias.
inline void store_tile(const float sums[MB][NB], int rows, int64_t m0, int64_t nb, int64_t N,
                       const float* channel_scale, const float* bias, float* out) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < NB && nb * NB + j < N; ++j) {
      const int64_t n = nb * NB + j;
      float y = sums[r][j];
      if (channel_scale) y *= channel_scale[n];
      if (bias) y += bias[n];
      out[(m0 + r) * N + n] = y;
    }
}

#if defined(PROTOSERVE_SIMD_BF16)
constexpr bool BF16_LINEAR = true;

// One row of x rounded to bfloat16; K % 16 == 0.
inline void round_row_to_bf16(const float* x, int64_t K, uint16_t* out) {
  for (int64_t k = 0; k < K; k += CHUNK) simd::store_bf16(out + k, simd::load(x + k));
}

// Lanes 0-7 and 8-15 of a vector, each summed in a fixed order.
inline void sum_halves(__m512 v, float& lo, float& hi) {
  lo = simd::reduce8_add(_mm512_castps512_ps256(v));
  hi = simd::reduce8_add(_mm512_extractf32x8_ps(v, 1));
}

// Rows [0, R) of xb (bfloat16, rows K apart) against channel block nb of the bfloat16 pack.
template <int R>
inline void bf16_tile(const uint16_t* w, int64_t chunks, const uint16_t* xb, int64_t K, int64_t nb,
                      float sums[MB][NB]) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* p = w + nb * chunks * NB * CHUNK;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    const __m512bh w01 = (__m512bh)_mm512_loadu_si512(p + kc * NB * CHUNK);
    const __m512bh w23 = (__m512bh)_mm512_loadu_si512(p + kc * NB * CHUNK + 2 * CHUNK);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + r * K + kc * CHUNK)));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w01, xv);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w23, xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    sum_halves(acc[r][0], sums[r][0], sums[r][1]);
    sum_halves(acc[r][1], sums[r][2], sums[r][3]);
  }
}

template <int R = MB>
inline void dispatch_bf16_tile(const uint16_t* w, int64_t chunks, const uint16_t* xb, int64_t K, int64_t nb, int rows,
                               float sums[MB][NB]) {
  if constexpr (R > 1) {
    if (rows < R) return dispatch_bf16_tile<R - 1>(w, chunks, xb, K, nb, rows, sums);
  }
  bf16_tile<R>(w, chunks, xb, K, nb, sums);
}

// y = bf16(x) @ W^T (+ bias) for the bfloat16 pack `w`, xb the rows already rounded.
void run_bf16_products(const uint16_t* w, const uint16_t* xb, int64_t M, int64_t K, int64_t N, const float* bias,
                       float* out, const protoserve::Team* team) {
  const int64_t blocks = (N + NB - 1) / NB, chunks = K / CHUNK;
  protoserve::for_range(team, blocks, 8, [&](int64_t b0, int64_t b1) {
    float sums[MB][NB];
    for (int64_t p0 = 0; p0 < M; p0 += M_PANEL) {
      const int64_t p1 = std::min(M, p0 + M_PANEL);
      for (int64_t nb = b0; nb < b1; ++nb) {
        for (int64_t m0 = p0; m0 < p1; m0 += MB) {
          const int rows = static_cast<int>(std::min<int64_t>(MB, p1 - m0));
          dispatch_bf16_tile(w, chunks, xb + m0 * K, K, nb, rows, sums);
          store_tile(sums, rows, m0, nb, N, nullptr, bias, out);
        }
      }
    }
  });
}
#else
constexpr bool BF16_LINEAR = false;
#endif

// Rows [m0, m0 + R) of x against channel block nb: R x NB dot products.
template <int R, typename W>
inline void tile(const W& weights, const float* x, int64_t K, int64_t nb, float sums[MB][NB]) {
  F16 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = simd::zero();
  const int64_t chunks = K / CHUNK;
  for (int64_t kc = 0; kc < chunks; ++kc) {
    F16 w[NB];
    weights.load(nb, kc, w);
    for (int r = 0; r < R; ++r) {
      const F16 xv = simd::load(x + r * K + kc * CHUNK);
      for (int j = 0; j < NB; ++j) acc[r][j] = simd::fmadd(xv, w[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) sums[r][j] = simd::reduce_add(acc[r][j]);
}

// The tile of `rows` (1..MB) rows.
template <int R = MB, typename W>
inline void dispatch_tile(const W& weights, const float* x, int64_t K, int64_t nb, int rows, float sums[MB][NB]) {
  if constexpr (R > 1) {
    if (rows < R) return dispatch_tile<R - 1>(weights, x, K, nb, rows, sums);
  }
  tile<R>(weights, x, K, nb, sums);
}

// A block's K x NB weights widened once into `buffer` (the float32 layout), so
// that many row tiles reuse them; the same arithmetic as widening in registers.
template <typename W>
inline void widen_block(const W& weights, int64_t nb, int64_t chunks, float* buffer) {
  for (int64_t kc = 0; kc < chunks; ++kc) {
    F16 w[NB];
    weights.load(nb, kc, w);
    for (int j = 0; j < NB; ++j) simd::store(buffer + (kc * NB + j) * CHUNK, w[j]);
  }
}

template <typename W>
void run(const W& weights, const float* x, int64_t M, int64_t K, int64_t N, const float* channel_scale,
         const float* bias, float* out, const protoserve::Team* team) {
  const int64_t blocks = (N + NB - 1) / NB;
  // One block is ~K*NB weights: give each thread whole blocks, at least a few.
  protoserve::for_range(team, blocks, 8, [&](int64_t b0, int64_t b1) {
    float sums[MB][NB];
    const int64_t chunks = K / CHUNK;
    // More rows than one tile: widen each block once and let every tile read it.
    const bool widen = !std::is_same<W, F32Weights>::value && M > MB;
    std::vector<float> buffer(widen ? K * NB : 0);
    const F32Weights widened{buffer.data(), chunks};
    for (int64_t p0 = 0; p0 < M; p0 += M_PANEL) {
      const int64_t p1 = std::min(M, p0 + M_PANEL);
      for (int64_t nb = b0; nb < b1; ++nb) {
        if (widen) widen_block(weights, nb, chunks, buffer.data());
        for (int64_t m0 = p0; m0 < p1; m0 += MB) {
          const int rows = static_cast<int>(std::min<int64_t>(MB, p1 - m0));
          const float* xr = x + m0 * K;
          if (widen) {
            dispatch_tile(widened, xr, K, 0, rows, sums);
          } else {
            dispatch_tile(weights, xr, K, nb, rows, sums);
          }
          store_tile(sums, rows, m0, nb, N, channel_scale, bias, out);
        }
      }
    }
  });
}

}  // namespace

namespace protoserve {

bool linear_multiplies_in_bf16() { return BF16_LINEAR; }

void check_packed_linear(const LinearWeights& w, int64_t K) {
  const int64_t N = w.out_features;
  TORCH_CHECK(N > 0 && K > 0, "a linear layer needs positive in and out features");
  if (w.bias.has_value())
    TORCH_CHECK(w.bias->scalar_type() == at::kFloat && w.bias->is_contiguous() && w.bias->numel() == N,
                "bias must be contiguous float32 [N]");
  TORCH_CHECK(w.data.is_contiguous(), "the packed weight must be contiguous");
  const int64_t blocks = (N + NB - 1) / NB;
  switch (static_cast<Format>(w.format)) {
    case Format::I4_DOT:
    case Format::I8_DOT: {
      const int64_t bits = w.format == static_cast<int64_t>(Format::I4_DOT) ? 4 : 8;
      TORCH_CHECK(K % 32 == 0, "in_features must be a multiple of 32, got ", K);
      TORCH_CHECK(w.group_size >= 32 && w.group_size % 32 == 0 && K % w.group_size == 0,
                  "group_size must be a multiple of 32 dividing in_features");
      const int64_t Nv = (N + 15) / 16, groups = K / w.group_size;
      TORCH_CHECK(w.data.scalar_type() == at::kByte && w.data.numel() == Nv * (K / 32) * bits * 64,
                  "bad int", bits, " code pack for [", N, ", ", K, "]");
      TORCH_CHECK(w.scales.has_value() && w.mins.has_value(), "integer-dot formats need scales and mins");
      for (const auto* t : {&*w.scales, &*w.mins})
        TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == Nv * groups * 16,
                    "scales and mins must be contiguous float16 [", Nv, ", ", groups, ", 16]");
      return;
    }
    case Format::F32:
      TORCH_CHECK(K % CHUNK == 0, "in_features must be a multiple of 16, got ", K);
      TORCH_CHECK(w.data.scalar_type() == at::kFloat && w.data.numel() == blocks * NB * K, "bad float32 pack");
      return;
    case Format::BF16:
      TORCH_CHECK(K % CHUNK == 0, "in_features must be a multiple of 16, got ", K);
      TORCH_CHECK(w.data.scalar_type() == at::kBFloat16 && w.data.numel() == blocks * NB * K, "bad bfloat16 pack");
      return;
    case Format::I8:
      TORCH_CHECK(K % CHUNK == 0, "in_features must be a multiple of 16, got ", K);
      TORCH_CHECK(w.data.scalar_type() == at::kChar && w.data.numel() == blocks * NB * K, "bad int8 pack");
      TORCH_CHECK(w.scales.has_value() && w.scales->scalar_type() == at::kFloat && w.scales->is_contiguous() &&
                      w.scales->numel() >= N,
                  "int8 needs float32 per-channel scales");
      return;
    case Format::I4: {
      TORCH_CHECK(K % 32 == 0 && w.group_size >= 32 && (w.group_size & (w.group_size - 1)) == 0 &&
                      K % w.group_size == 0,
                  "int4 needs in_features a multiple of 32 and a power-of-two group size >= 32 dividing it");
      TORCH_CHECK(w.data.scalar_type() == at::kByte && w.data.numel() == blocks * NB * K / 2, "bad int4 pack");
      const int64_t groups = K / w.group_size;
      TORCH_CHECK(w.scales.has_value() && w.mins.has_value() && w.scales->scalar_type() == at::kFloat &&
                      w.mins->scalar_type() == at::kFloat && w.scales->is_contiguous() &&
                      w.mins->is_contiguous() && w.scales->numel() == blocks * groups * NB &&
                      w.mins->numel() == blocks * groups * NB,
                  "int4 needs float32 scales and mins [blocks, groups, 4]");
      return;
    }
  }
  TORCH_CHECK(false, "unknown weight format ", w.format);
}

void packed_linear_into(const LinearWeights& w, const float* x, int64_t M, int64_t K, float* out,
                        ActivationCodes& codes, const Team* team) {
  const Format format = static_cast<Format>(w.format);
  if (format == Format::I4_DOT || format == Format::I8_DOT) {
    int8_dot_linear_into(w, format == Format::I4_DOT ? 4 : 8, x, M, K, out, codes, team);
    return;
  }
  if (team != nullptr) team->sync();  // every member's rows of x are written
  const int64_t N = w.out_features, chunks = K / CHUNK;
  const float* bias = w.bias.has_value() ? w.bias->data_ptr<float>() : nullptr;
#if defined(PROTOSERVE_SIMD_BF16)
  if (format == Format::BF16) {
    // The rounded rows go in the integer-dot formats' scratch: 2 * M * K bytes, which fit() provides.
    uint16_t* xb = reinterpret_cast<uint16_t*>(codes.codes.data());
    protoserve::for_range(team, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) round_row_to_bf16(x + r * K, K, xb + r * K);
    });
    if (team != nullptr) team->sync();  // every member's rounded rows are written
    run_bf16_products(reinterpret_cast<const uint16_t*>(w.data.data_ptr()), xb, M, K, N, bias, out, team);
    if (team != nullptr) team->sync();
    return;
  }
#endif
  switch (format) {
    case Format::F32:
      run(F32Weights{w.data.data_ptr<float>(), chunks}, x, M, K, N, nullptr, bias, out, team);
      break;
    case Format::BF16:
      run(BF16Weights{reinterpret_cast<const uint16_t*>(w.data.data_ptr()), chunks}, x, M, K, N, nullptr, bias, out,
          team);
      break;
    case Format::I8:
      run(I8Weights{w.data.data_ptr<int8_t>(), chunks}, x, M, K, N, w.scales->data_ptr<float>(), bias, out, team);
      break;
    default:  // I4: check_packed_linear allows no other format here
      run(I4Weights{w.data.data_ptr<uint8_t>(), w.scales->data_ptr<float>(), w.mins->data_ptr<float>(), chunks,
                    K / w.group_size, __builtin_ctzll(static_cast<uint64_t>(w.group_size / CHUNK))},
          x, M, K, N, nullptr, bias, out, team);
      break;
  }
  if (team != nullptr) team->sync();  // every member's columns of out are written
}

// x: [M, K] float32; data/scales/mins: packed by packed_linear.py; returns [M, N] float32.
at::Tensor packed_linear(const at::Tensor& x, int64_t format, const at::Tensor& data,
                         const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& mins,
                         const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t group_size,
                         bool fine_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const LinearWeights w{format, data, scales, mins, bias, out_features, group_size};
  const int64_t M = x.size(0), K = x.size(1);
  check_packed_linear(w, K);
  auto out = at::empty({M, out_features}, x.options());
  if (M == 0) return out;
  thread_local ActivationCodes codes;  // reused by the calling thread: no allocation per step
  if (format == static_cast<int64_t>(Format::I4_DOT) || format == static_cast<int64_t>(Format::I8_DOT) ||
      (BF16_LINEAR && format == static_cast<int64_t>(Format::BF16)))
    codes.fit(M, K);
  codes.fine = fine_activations;
  packed_linear_into(w, x.data_ptr<float>(), M, K, out.data_ptr<float>(), codes, nullptr);
  return out;
}

}  // namespace protoserve
