// Each row's greedy token: the index of its largest value, as NumPy's argmax finds it (the first
// maximum; a row holding NaN gives its first NaN). The sampler's greedy rows read a whole
// [rows, vocab] float32 logits block per step, 12.6 MB at 64 rows of a 49k vocabulary, which
// one thread reads at about its share of memory bandwidth; the rows go to ATen's threads.
//
// Per row, two passes: the maximum, then the first lane equal to it. The second pass reads the
// row again from the core's cache (a row is 4 bytes a token) and stops at the first match.

#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <cstdint>

namespace simd = protoserve::simd;
using simd::F16;

namespace {

constexpr int LANES = 16;
constexpr simd::Mask ALL = 0xFFFFu;

int64_t first_nan(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (std::isnan(row[i])) return i;
  return -1;
}

int64_t argmax_row(const float* row, int64_t n) {
  const int64_t body = n / LANES * LANES;
  F16 best = simd::set1(-INFINITY);
  simd::Mask ordered = ALL;  // lanes without NaN so far (x >= x fails only for NaN)
  for (int64_t i = 0; i < body; i += LANES) {
    const F16 x = simd::load(row + i);
    ordered &= simd::greater_equal(x, x);
    best = simd::max(best, x);
  }
  float m = body > 0 ? simd::reduce_max(best) : -INFINITY;
  for (int64_t i = body; i < n; ++i) {
    if (std::isnan(row[i])) ordered = 0;
    else if (row[i] > m) m = row[i];
  }
  if (ordered != ALL) return first_nan(row, n);
  const F16 target = simd::set1(m);
  for (int64_t i = 0; i < body; i += LANES) {
    const simd::Mask hit = simd::greater_equal(simd::load(row + i), target);
    if (hit != 0) return i + __builtin_ctz(hit);
  }
  for (int64_t i = body; i < n; ++i)
    if (row[i] >= m) return i;
  return 0;  // n == 0, or every value -inf: NumPy's answer too
}

}  // namespace

namespace protoserve {

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_rows: logits must be [rows, vocab] float32");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // Below 32 rows (6 MB of a 49k vocabulary) waking a second thread cost more than it saved.
  at::parallel_for(0, rows, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

}  // namespace protoserve
