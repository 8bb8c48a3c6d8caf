// LoRA updates inside the fused decoder step: out[r] += B (A x[r]) for the rows of a batch that
// run an adapter (engine/lora/batch.py is the PyTorch reference: a gather, two small GEMMs and an
// index_add per adapter group).
//
// Why here: a batch with adapter rows used to leave the fused step for the module path, which
// costs the Python per-operation overhead the fused step exists to remove, on every row of the
// batch. Here the low-rank products run between the step's own linear layers, on the rows
// of each adapter only, while the base rows stay exactly as the fused step computes them.
//
// Each row is computed on its own, in a fixed order of operations (A's rows dotted with x
// 16 lanes at a time, then B's columns accumulated in rank order), so a row's update does not
// depend on which or how many rows share its adapter: the batch invariance of the base step
// holds with adapters too. Rows go in blocks of eight only so each loaded weight vector serves
// eight rows; every row keeps its own accumulators.
//
// At decode a step streams every resident adapter's A and B once, which for a few adapters of
// rank 16 is as many bytes as the int4 base model: over quantized layers the weights are stored in
// bfloat16 (half the bytes) and multiplied in bfloat16 pairs (vdpbf16ps on AVX512-BF16 CPUs:
// twice the multiply-adds per instruction), each row's x and A x rounded to bf16 once, as the
// bf16 linear layers do; elsewhere they stay float32. A's rows are zero-padded to whole vectors and
// B^T's by a vector, so weight loads need no masks; only x's and the output's tails are masked.
// bf16 B is stored for the pair products: [R / 2][out + 32][2], targets with even ranks.

#include "kernels.h"
#include "simd.h"

#include <algorithm>
#include <cstring>

namespace protoserve {

namespace {

constexpr int64_t kBlockRows = 8;

using simd::F16;

// float32 weights: A [R, in rounded up to 16], B^T [R, out + 16].
void add_rows_f32(const LoraLinear& w, const float* x, int64_t in, float* out, int64_t out_stride,
                  const int64_t* rows, int64_t n, float* scratch) {
  const int64_t R = w.a.size(0);
  const int64_t a_stride = w.a.size(1), bt_stride = w.bt.size(1);
  const float* a = w.a.data_ptr<float>();
  const float* bt = w.bt.data_ptr<float>();
  float* t = scratch;  // [kBlockRows, R]: A x of each row of the block
  for (int64_t first = 0; first < n; first += kBlockRows) {
    const int64_t nb = std::min(kBlockRows, n - first);
    const float* xr[kBlockRows];
    float* yr[kBlockRows];
    for (int64_t b = 0; b < nb; ++b) {
      xr[b] = x + rows[first + b] * in;
      yr[b] = out + rows[first + b] * out_stride;
    }
    for (int64_t j = 0; j < R; ++j) {
      const float* aj = a + j * a_stride;
      F16 acc[kBlockRows];
      for (int64_t b = 0; b < nb; ++b) acc[b] = simd::zero();
      for (int64_t i = 0; i < in; i += 16) {
        const simd::Mask m = simd::first_lanes(in - i);
        const F16 av = simd::load(aj + i);  // zero past `in`, where x's masked lanes are zero too
        for (int64_t b = 0; b < nb; ++b) acc[b] = simd::fmadd(av, simd::load_masked(m, xr[b] + i), acc[b]);
      }
      for (int64_t b = 0; b < nb; ++b) t[b * R + j] = simd::reduce_add(acc[b]);
    }
    // Target s touches only its own slice of the output, from its own `rank` rows of B^T.
    for (size_t s = 0; s < w.slice_begin.size(); ++s) {
      const int64_t j0 = static_cast<int64_t>(s) * w.rank;
      for (int64_t o = w.slice_begin[s]; o < w.slice_end[s]; o += 16) {
        const simd::Mask m = simd::first_lanes(w.slice_end[s] - o);
        F16 acc[kBlockRows];
        for (int64_t b = 0; b < nb; ++b) acc[b] = simd::zero();
        for (int64_t j = j0; j < j0 + w.rank; ++j) {
          const F16 bv = simd::load(bt + j * bt_stride + o);  // lanes past the slice are never stored
          for (int64_t b = 0; b < nb; ++b) acc[b] = simd::fmadd(simd::set1(t[b * R + j]), bv, acc[b]);
        }
        // The whole update first, then one add: base + delta, as the reference adds them.
        for (int64_t b = 0; b < nb; ++b)
          simd::store_masked(yr[b] + o, m, simd::add(simd::load_masked(m, yr[b] + o), acc[b]));
      }
    }
  }
}

#if defined(PROTOSERVE_SIMD_BF16)
// bfloat16 weights in pair layout: A [R, in rounded up to 32], B [R / 2, 2 * (out + 32)].
void add_rows_bf16(const LoraLinear& w, const float* x, int64_t in, float* out, int64_t out_stride,
                   const int64_t* rows, int64_t n, float* scratch) {
  const int64_t R = w.a.size(0);
  const int64_t in32 = w.a.size(1), bp_stride = w.bt.size(1);  // bf16 values per pair row of B
  const auto* a = reinterpret_cast<const uint16_t*>(w.a.data_ptr<c10::BFloat16>());
  const auto* bp = reinterpret_cast<const uint16_t*>(w.bt.data_ptr<c10::BFloat16>());
  // Scratch: each row's x in bf16 (zero-padded to in32), then each row's A x in bf16.
  auto* xb = reinterpret_cast<uint16_t*>(scratch);  // [kBlockRows, in32]
  uint16_t* tb = xb + kBlockRows * in32;            // [kBlockRows, R]
  for (int64_t first = 0; first < n; first += kBlockRows) {
    const int64_t nb = std::min(kBlockRows, n - first);
    float* yr[kBlockRows];
    for (int64_t b = 0; b < nb; ++b) {
      yr[b] = out + rows[first + b] * out_stride;
      const float* xr = x + rows[first + b] * in;
      for (int64_t i = 0; i < in32; i += 16)
        simd::store_bf16(xb + b * in32 + i, simd::load_masked(simd::first_lanes(std::max<int64_t>(in - i, 0)), xr + i));
    }
    for (int64_t j = 0; j < R; ++j) {
      const uint16_t* aj = a + j * in32;
      __m512 acc[kBlockRows];
      for (int64_t b = 0; b < nb; ++b) acc[b] = _mm512_setzero_ps();
      for (int64_t i = 0; i < in32; i += 32) {
        const __m512bh av = (__m512bh)_mm512_loadu_si512(aj + i);
        for (int64_t b = 0; b < nb; ++b)
          acc[b] = _mm512_dpbf16_ps(acc[b], av, (__m512bh)_mm512_loadu_si512(xb + b * in32 + i));
      }
      for (int64_t b = 0; b < nb; ++b) tb[b * R + j] = c10::BFloat16(simd::reduce_add(acc[b])).x;
    }
    // Target s: its rank / 2 pairs of B, over its own slice of the output.
    for (size_t s = 0; s < w.slice_begin.size(); ++s) {
      const int64_t p0 = static_cast<int64_t>(s) * w.rank / 2;
      for (int64_t o = w.slice_begin[s]; o < w.slice_end[s]; o += 16) {
        const simd::Mask m = simd::first_lanes(w.slice_end[s] - o);
        __m512 acc[kBlockRows];
        for (int64_t b = 0; b < nb; ++b) acc[b] = _mm512_setzero_ps();
        for (int64_t p = p0; p < p0 + w.rank / 2; ++p) {
          const __m512bh bv = (__m512bh)_mm512_loadu_si512(bp + p * bp_stride + 2 * o);  // 16 outputs x 2 ranks
          for (int64_t b = 0; b < nb; ++b) {
            int32_t pair;
            std::memcpy(&pair, tb + b * R + 2 * p, sizeof(pair));
            acc[b] = _mm512_dpbf16_ps(acc[b], bv, (__m512bh)_mm512_set1_epi32(pair));
          }
        }
        // The whole update first, then one add: base + delta, as the reference adds them.
        for (int64_t b = 0; b < nb; ++b)
          simd::store_masked(yr[b] + o, m, simd::add(simd::load_masked(m, yr[b] + o), acc[b]));
      }
    }
  }
}
#endif

int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

}  // namespace

bool lora_multiplies_in_bf16() {
#if defined(PROTOSERVE_SIMD_BF16)
  return true;
#else
  return false;
#endif
}

void check_lora_linear(const LoraLinear& w, int64_t in_features, int64_t out_features) {
  TORCH_CHECK(w.rank > 0, "a LoRA update needs a positive rank");
  const auto dtype = w.a.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && w.bt.scalar_type() == dtype,
              "LoRA A and B must both be float32 or both bfloat16");
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(!bf16 || lora_multiplies_in_bf16(), "bfloat16 LoRA weights need AVX512-BF16 on this CPU");
  TORCH_CHECK(!bf16 || w.rank % 2 == 0, "bfloat16 LoRA weights come in rank pairs: the rank must be even");
  const int64_t in_padded = padded(in_features, bf16 ? 32 : 16);
  TORCH_CHECK(w.a.is_contiguous() && w.a.dim() == 2 && w.a.size(1) == in_padded, "LoRA A must be contiguous [R, ",
              in_padded, "] (", in_features, " inputs, zero-padded to whole vectors)");
  const int64_t R = w.a.size(0);
  const int64_t b_rows = bf16 ? R / 2 : R, b_cols = bf16 ? 2 * (out_features + 32) : out_features + 16;
  TORCH_CHECK(w.bt.is_contiguous() && w.bt.dim() == 2 && w.bt.size(0) == b_rows && w.bt.size(1) == b_cols,
              "LoRA B must be contiguous [", b_rows, ", ", b_cols, "] (", out_features, " outputs with zero padding, ",
              bf16 ? "in rank pairs" : "transposed", ")");
  const auto targets = static_cast<int64_t>(w.slice_begin.size());
  TORCH_CHECK(targets > 0 && static_cast<int64_t>(w.slice_end.size()) == targets && R == targets * w.rank,
              "LoRA A has ", R, " rows, expected rank ", w.rank, " x ", targets, " target slices");
  for (int64_t j = 0; j < targets; ++j)
    TORCH_CHECK(0 <= w.slice_begin[j] && w.slice_begin[j] < w.slice_end[j] && w.slice_end[j] <= out_features,
                "LoRA target slice [", w.slice_begin[j], ", ", w.slice_end[j], ") is outside ", out_features,
                " outputs");
}

int64_t lora_scratch_size(const LoraLinear& w) {
  if (w.a.scalar_type() == at::kBFloat16)  // bf16 x rows and A x values, counted in floats
    return (kBlockRows * (w.a.size(1) + w.a.size(0)) + 1) / 2;
  return kBlockRows * w.a.size(0);
}

void lora_add_rows(const LoraLinear& w, const float* x, int64_t in, float* out, int64_t out_stride,
                   const int64_t* rows, int64_t n, float* scratch) {
#if defined(PROTOSERVE_SIMD_BF16)
  if (w.a.scalar_type() == at::kBFloat16) return add_rows_bf16(w, x, in, out, out_stride, rows, n, scratch);
#endif
  add_rows_f32(w, x, in, out, out_stride, rows, n, scratch);
}

void lora_add_(at::Tensor& out, const at::Tensor& x, const LoraLinear& w, const at::Tensor& rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x must be contiguous float32 [T, in]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0),
              "out must be contiguous float32 [T, out]");
  check_lora_linear(w, x.size(1), out.size(1));
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1, "rows must be int64 [n]");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] < x.size(0), "row ", r[i], " is outside the batch of ", x.size(0));
  std::vector<float> scratch(lora_scratch_size(w));
  lora_add_rows(w, x.data_ptr<float>(), x.size(1), out.data_ptr<float>(), out.size(1), r, rows.numel(), scratch.data());
}

}  // namespace protoserve
