// A mixture-of-experts block's routed experts in one call: the (token, slot) pairs grouped by
// expert, each expert's rows gathered and run through one gate_up product, SiLU(gate) * up and
// one down product over its packed weights, scaled by the pair's routing weight, and each
// token's k results summed in slot order (engine/models/moe.py: GroupedExperts).
//
// The same operations in the same order as the module path's Python loop, so the result is
// bit-identical to it: the products are packed_linear_into (a row's result does not depend on
// the rows gathered with it), the activation is ATen's own SiLU and product on whole rows (as
// the fused decoder step computes it), the scaling one float multiply per value and the sum a
// fixed chain per token. Pairs sort stably (counting sort over the expert ids): within an
// expert they keep token order, which fixes nothing numerically but keeps the gather
// sequential.
//
// moe_experts_into runs the pass alone across ATen's threads or as one member of a team (team.h),
// so a fused step can call it inside its own team; the Python entry point, moe_experts, checks
// every argument and then runs it as one team of OpenMP threads, as the fused decoder step runs:
// one parallel region per call instead of several per expert. In a team, members share each
// expert's products where few experts have pairs (decode), and otherwise take whole experts on
// their own buffers, which needs no barrier between experts: the step then meets twice, not ~4
// times per expert, which is what a busy 2-core machine punishes (measured, 4 blocks of 8 experts
// at 64 tokens and load ~4: 3.5 ms a step against 6-13 ms sharing every product).

#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>
#include <vector>

namespace protoserve {

void MoEScratch::fit(int64_t num_members, int64_t most, int64_t num_pairs, int64_t H, int64_t I) {
  // Plain tensors even when the first call comes in inference mode: later calls outside it write them too.
  c10::InferenceMode plain(false);
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  auto grow = [&](at::Tensor& t, int64_t rows_needed, int64_t cols) {
    if (!t.defined() || t.size(0) < rows_needed || t.size(1) != cols) t = at::empty({rows_needed, cols}, opts);
  };
  if (static_cast<int64_t>(members.size()) < num_members) members.resize(num_members);
  for (int64_t m = 0; m < num_members; ++m) {
    MoEBuffers& b = members[m];
    grow(b.rows, most, H);
    grow(b.gate_up, most, 2 * I);
    grow(b.act, most, I);
    grow(b.y, most, H);
    b.codes.fit(most, std::max(H, I));
  }
  grow(pairs, num_pairs, H);
}

void group_by_expert(const int64_t* ids, int64_t num_pairs, int64_t num_experts, ExpertGroups& groups) {
  groups.start.assign(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < num_experts, "expert id ", ids[p], " out of range 0..", num_experts - 1);
    ++groups.start[ids[p] + 1];
  }
  groups.most = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    groups.most = std::max(groups.most, groups.start[e + 1]);
    groups.start[e + 1] += groups.start[e];
  }
  groups.order.resize(num_pairs);
  std::vector<int64_t> fill(groups.start.begin(), groups.start.end() - 1);
  for (int64_t p = 0; p < num_pairs; ++p) groups.order[fill[ids[p]]++] = p;
}

void check_moe_experts(const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down,
                       int64_t H) {
  const int64_t E = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(E >= 1 && static_cast<int64_t>(down.size()) == E, "gate_up and down need one weight per expert");
  TORCH_CHECK(gate_up[0].out_features % 2 == 0, "gate_up must have an even number of outputs (gate, then up)");
  const int64_t I = gate_up[0].out_features / 2;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(gate_up[e].out_features == 2 * I, "expert ", e, " gate_up has ", gate_up[e].out_features,
                " outputs, expected ", 2 * I);
    TORCH_CHECK(down[e].out_features == H, "expert ", e, " down has ", down[e].out_features, " outputs, expected ", H);
    check_packed_linear(gate_up[e], H);
    check_packed_linear(down[e], I);
  }
}

namespace {

// Expert e's n pairs `mine` through gate_up, SiLU * up and down, each scaled into its row of
// `pairs`: split across `team` as packed_linear_into splits, or with no team across ATen's threads
// (run by the calling thread alone when it is inside a parallel region already).
void run_expert(const LinearWeights& gate_up, const LinearWeights& down, const float* x, int64_t H, int64_t k,
                const float* weights, const int64_t* mine, int64_t n, MoEBuffers& b, float* pairs,
                const Team* team) {
  const int64_t I = gate_up.out_features / 2;
  float* rows = b.rows.data_ptr<float>();
  float* y = b.y.data_ptr<float>();
  for_range(team, n, 16, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) std::memcpy(rows + j * H, x + (mine[j] / k) * H, H * sizeof(float));
  });
  packed_linear_into(gate_up, rows, n, H, b.gate_up.data_ptr<float>(), b.codes, team);
  // ATen's own SiLU and product on whole rows: the module path's exact bits. Alone, one call over
  // all n rows (ATen splits it across its threads itself); in a team, each member's share.
  int64_t j0 = 0, j1 = n;
  if (team != nullptr) team->share(n, j0, j1);
  if (j0 < j1) {
    const at::Tensor g = b.gate_up.narrow(0, j0, j1 - j0);
    at::Tensor a = b.act.narrow(0, j0, j1 - j0);
    at::mul_out(a, at::silu(g.narrow(1, 0, I)), g.narrow(1, I, I));
  }
  packed_linear_into(down, b.act.data_ptr<float>(), n, I, y, b.codes, team);
  for_range(team, n, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t j = r0; j < r1; ++j) {
      const float w = weights[mine[j]];
      const float* src = y + j * H;
      float* dst = pairs + mine[j] * H;
      for (int64_t c = 0; c < H; ++c) dst[c] = src[c] * w;
    }
  });
}

// Which member runs each expert (-1: none has pairs) when members take whole experts, or an empty
// vector when they should share each product instead: with fewer than two experts per member the
// idle shares would cost more than the barriers saved. Longest first to the least loaded member
// (an expert's cost: its rows plus a fixed share for streaming its weights); every member computes
// the same assignment, so no member needs to wait for another's.
std::vector<int> assign_experts(const ExpertGroups& groups, int members) {
  const int64_t E = static_cast<int64_t>(groups.start.size()) - 1;
  std::vector<std::pair<int64_t, int64_t>> active;  // (rows, expert)
  for (int64_t e = 0; e < E; ++e)
    if (groups.start[e + 1] > groups.start[e]) active.emplace_back(groups.start[e + 1] - groups.start[e], e);
  if (members <= 1 || static_cast<int64_t>(active.size()) < 2 * members) return {};
  std::stable_sort(active.begin(), active.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  constexpr int64_t WEIGHT_ROWS = 16;  // streaming an expert's weights costs about as much as this many rows
  std::vector<int64_t> load(members, 0);
  std::vector<int> owner(E, -1);
  for (const auto& [rows, e] : active) {
    const int m = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[e] = m;
    load[m] += rows + WEIGHT_ROWS;
  }
  return owner;
}

}  // namespace

void moe_experts_into(const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down,
                      const float* x, int64_t T, int64_t H, int64_t k, const float* weights,
                      const ExpertGroups& groups, MoEScratch& scratch, float* out, const Team* team) {
  const int64_t E = static_cast<int64_t>(gate_up.size());
  float* pairs = scratch.pairs.data_ptr<float>();
  const std::vector<int> owner = assign_experts(groups, team == nullptr ? 1 : team->size);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = groups.start[e + 1] - groups.start[e];
    if (n == 0) continue;
    const int64_t* mine = groups.order.data() + groups.start[e];
    if (owner.empty()) {  // every member takes part in each product (meeting at its barriers)
      run_expert(gate_up[e], down[e], x, H, k, weights, mine, n, scratch.members[0], pairs, team);
    } else if (owner[e] == team->rank) {  // this member's whole experts, on its own buffers, no barrier
      run_expert(gate_up[e], down[e], x, H, k, weights, mine, n, scratch.members[team->rank], pairs, nullptr);
    }
  }
  if (team != nullptr) team->sync();  // a token's pairs may be any member's
  for_range(team, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* dst = out + t * H;
      std::memcpy(dst, pairs + t * k * H, H * sizeof(float));
      for (int64_t s = 1; s < k; ++s) {
        const float* src = pairs + (t * k + s) * H;
        for (int64_t c = 0; c < H; ++c) dst[c] += src[c];
      }
    }
  });
  if (team != nullptr) team->sync();  // every member's rows of out are written
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                       const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, hidden] tensor");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == T && expert_ids.scalar_type() == at::kLong &&
                  expert_ids.is_contiguous(),
              "expert_ids must be contiguous int64 [T, k]");
  const int64_t k = expert_ids.size(1);
  TORCH_CHECK(k >= 1, "expert_ids needs at least one slot per token");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == T && weights.size(1) == k,
              "weights must be contiguous float32 [T, k], as expert_ids");
  check_moe_experts(gate_up, down, H);
  const int64_t E = static_cast<int64_t>(gate_up.size()), I = gate_up[0].out_features / 2;

  auto out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  // Reused by the calling thread: no allocation per step once grown. The team's members reach the
  // caller's instances through these references (a thread_local named inside the parallel region
  // would be each member's own).
  thread_local ExpertGroups caller_groups;
  thread_local MoEScratch caller_scratch;
  ExpertGroups& groups = caller_groups;
  MoEScratch& scratch = caller_scratch;
  const int threads = std::max(1, at::get_num_threads());
  group_by_expert(expert_ids.data_ptr<int64_t>(), T * k, E, groups);
  scratch.fit(threads, groups.most, T * k, H, I);
  const float* xp = x.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* outp = out.data_ptr<float>();

  if (threads == 1) {
    moe_experts_into(gate_up, down, xp, T, H, k, wp, groups, scratch, outp, nullptr);
    return out;
  }
  // One team of OpenMP threads for the whole pass, as the fused decoder step runs: one parallel
  // region per call instead of several per expert, the members meeting at spin barriers.
  SpinBarrier barrier(threads);
  std::exception_ptr failure;
  std::mutex failure_lock;
#pragma omp parallel num_threads(threads)
  {
    c10::InferenceMode no_grad;  // OpenMP workers: the caller's no-autograd mode for the ATen calls
    const int size = omp_get_num_threads();
    barrier.set_size(size);  // OpenMP may grant fewer threads than asked; every member sets the same size
    const Team team{omp_get_thread_num(), size, &barrier};
    try {
      moe_experts_into(gate_up, down, xp, T, H, k, wp, groups, scratch, outp, &team);
    } catch (...) {
      barrier.break_();
      std::lock_guard<std::mutex> lock(failure_lock);
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  return out;
}

}  // namespace protoserve
