// RMSNorm (optionally fused with the residual add) and rotary embedding, float32, per token row.
//
// At decode batch sizes each of these is a few microseconds of arithmetic
// behind a dozen PyTorch dispatches (pow, mean, add, rsqrt, mul, cat, neg, ...);
// one call each removes most of a layer's non-GEMM time. Every row is
// computed alone in a fixed order, so results do not depend on the batch.

#include "kernels.h"
#include "simd.h"

#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace simd = protoserve::simd;

namespace {

constexpr int64_t ROW_GRAIN = 16;  // rows per task: small batches stay on the calling thread

// Sum of squares of one row in a fixed order: 16 lanes, then the lane tree, then the tail.
inline float sum_squares(const float* x, int64_t d) {
  simd::F16 acc = simd::zero();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const simd::F16 v = simd::load(x + i);
    acc = simd::fmadd(v, v, acc);
  }
  float s = simd::reduce_add(acc);
  for (; i < d; ++i) s += x[i] * x[i];
  return s;
}

}  // namespace

namespace protoserve {

void rms_norm_row(const float* x, const float* w, float eps, int64_t d, float* out) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
  int64_t i = 0;
  const simd::F16 vinv = simd::set1(inv);
  for (; i + 16 <= d; i += 16) {
    const simd::F16 h = simd::mul(simd::load(x + i), vinv);
    simd::store(out + i, simd::mul(simd::load(w + i), h));
  }
  for (; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

void add_row(float* residual, const float* x, int64_t d) {
  for (int64_t i = 0; i < d; ++i) residual[i] = residual[i] + x[i];
}

void add_rms_norm_row(const float* x, float* residual, const float* weight, float eps, int64_t d, float* out) {
  add_row(residual, x, d);
  rms_norm_row(residual, weight, eps, d, out);
}

void rope_row(float* x, int64_t heads, int64_t head_stride, const float* c, const float* s, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      const float lo = a * c[i] + (-b) * s[i];
      const float hi = b * c[i + half] + a * s[i + half];
      v[i] = lo;
      v[i + half] = hi;
    }
  }
}

}  // namespace protoserve

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() >= 1,
              name, " must be a contiguous float32 tensor");
}

}  // namespace

namespace protoserve {

// out = weight * x / sqrt(mean(x^2) + eps), over the last dim.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(weight.numel() == d, "weight must have the last dim's size");
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * d, wp, static_cast<float>(eps), d, op + r * d);
  });
  return out;
}

// residual += x (in place); returns rms_norm(residual).
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  check_rows(weight, "weight");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have one shape");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(weight.numel() == d, "weight must have the last dim's size");
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) add_rms_norm_row(xp + r * d, rp + r * d, wp, static_cast<float>(eps), d, op + r * d);
  });
  return out;
}

// Rotate-half RoPE in place on x [T, heads, D] with per-row cos/sin [T, D] (both halves, HF layout):
// x * cos + rotate_half(x) * sin, rounded after each multiply as PyTorch does.
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "x must be float32 [T, heads, D] with unit last stride");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == t && cos.size(1) == d && sin.sizes() == cos.sizes(),
              "cos/sin must be [T, D] with D even");
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, t, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rope_row(xp + r * s0, heads, s1, cp + r * d, sp + r * d, d);
  });
}

}  // namespace protoserve
