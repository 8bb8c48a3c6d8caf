// The whole decoder forward in one C++ call: the layer loop of
// engine/models/decoder.py, calling the same kernels in the same order, so its
// logits are bit-identical to the module-by-module path.
//
// Why: at decode batch sizes a SmolLM2 step is ~30 layers x a dozen small ops.
// Driven from Python each op costs a module call, argument checks and a dispatch
// (measured ~0.4 ms per layer, a third of an int4 step); here the loop costs
// microseconds, and the GIL is released for the whole step, so the server's
// event loop keeps streaming while the model runs.
//
// The step runs as one team of OpenMP threads (team.h): one parallel region per
// step instead of one per operation, the members meeting at spin barriers.
// Nothing inside the team may throw, so every argument is checked first.

#include "kernels.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <omp.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>

namespace protoserve {

const char* const STEP_PHASE_NAMES[STEP_PHASES] = {"norms_residual", "qkv", "rope_kv_write", "attention", "o_proj",
                                                   "gate_up", "activation", "down", "lm_head"};

namespace {

std::atomic<bool> phase_timing{false};
std::mutex phase_lock;
std::array<double, STEP_PHASES> phase_seconds{};
int64_t phase_steps = 0, phase_tokens = 0;

// Member 0's clock over one step: mark(p) books the time since the previous mark to phase p.
class PhaseClock {
 public:
  explicit PhaseClock(bool on) : on_(on) {
    if (on_) last_ = std::chrono::steady_clock::now();
  }
  void mark(StepPhase phase) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    seconds[phase] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }
  std::array<double, STEP_PHASES> seconds{};

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace

void set_step_phase_timing(bool enabled) { phase_timing.store(enabled, std::memory_order_relaxed); }

std::vector<double> take_step_phase_totals() {
  std::lock_guard<std::mutex> lock(phase_lock);
  std::vector<double> out(phase_seconds.begin(), phase_seconds.end());
  out.push_back(static_cast<double>(phase_steps));
  out.push_back(static_cast<double>(phase_tokens));
  phase_seconds.fill(0.0);
  phase_steps = phase_tokens = 0;
  return out;
}

DecoderStep::DecoderStep(DecoderShape shape, std::vector<LayerWeights> layers, at::Tensor final_norm,
                         LinearWeights lm_head)
    : shape_(shape), layers_(std::move(layers)), final_norm_(std::move(final_norm)), lm_head_(std::move(lm_head)) {
  TORCH_CHECK(shape_.num_heads > 0 && shape_.num_kv_heads > 0 && shape_.head_dim > 0,
              "the decoder step needs positive head counts and head_dim");
  TORCH_CHECK(shape_.num_heads % shape_.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(shape_.head_dim % 2 == 0, "RoPE needs an even head_dim");
  TORCH_CHECK(final_norm_.scalar_type() == at::kFloat && final_norm_.is_contiguous() && final_norm_.dim() == 1,
              "final_norm must be a contiguous float32 vector");
  hidden_ = final_norm_.numel();
  const int64_t q_size = shape_.num_heads * shape_.head_dim;
  const int64_t qkv = (shape_.num_heads + 2 * shape_.num_kv_heads) * shape_.head_dim;
  auto check_norm = [](const at::Tensor& w, int64_t n, const char* name) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n, name,
                " must be a contiguous float32 vector of ", n);
  };
  for (const auto& layer : layers_) {
    TORCH_CHECK(layer.qkv.out_features == qkv, "qkv projection has ", layer.qkv.out_features, " outputs, expected ",
                qkv);
    TORCH_CHECK(layer.gate_up.out_features == 2 * shape_.intermediate_size, "gate_up projection size mismatch");
    TORCH_CHECK(layer.o.out_features == hidden_ && layer.down.out_features == hidden_,
                "o and down projections must return the hidden size ", hidden_);
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "q_norm and k_norm come together");
    TORCH_CHECK(layer.pre_feedforward_norm.has_value() == layer.post_feedforward_norm.has_value(),
                "pre_feedforward_norm and post_feedforward_norm come together");
    if (layer.pre_feedforward_norm.has_value()) {
      check_norm(*layer.pre_feedforward_norm, hidden_, "pre_feedforward_norm");
      check_norm(*layer.post_feedforward_norm, hidden_, "post_feedforward_norm");
    }
    check_norm(layer.input_norm, hidden_, "input_norm");
    check_norm(layer.post_attention_norm, hidden_, "post_attention_norm");
    if (layer.q_norm.has_value()) {
      check_norm(*layer.q_norm, shape_.head_dim, "q_norm");
      check_norm(*layer.k_norm, shape_.head_dim, "k_norm");
    }
    check_packed_linear(layer.qkv, hidden_);
    check_packed_linear(layer.o, q_size);
    check_packed_linear(layer.gate_up, hidden_);
    check_packed_linear(layer.down, shape_.intermediate_size);
  }
  check_packed_linear(lm_head_, hidden_);
}

at::Tensor DecoderStep::forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                                const std::vector<at::Tensor>& k_caches,
                                const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                                const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                const at::Tensor& seq_lens, const at::Tensor& logits_indices,
                                int64_t sliding_window, const std::vector<LoraWeights>& lora,
                                const c10::optional<at::Tensor>& lora_rows,
                                const c10::optional<at::Tensor>& lora_starts,
                                const std::vector<int64_t>& layer_windows,
                                const c10::optional<at::Tensor>& local_cos,
                                const c10::optional<at::Tensor>& local_sin,
                                const std::vector<int64_t>& layer_rope, bool fine_activations) const {
  // Every check happens here, before the team starts: inside it nothing may throw.
  const int64_t num_layers = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers && static_cast<int64_t>(v_caches.size()) == num_layers,
              "one K and one V pool per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == hidden_,
              "x must be contiguous float32 [T, ", hidden_, "]");
  const int64_t T = x.size(0);
  const int64_t H = shape_.num_heads, KVH = shape_.num_kv_heads, D = shape_.head_dim;
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping must be int64 [T]");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                    t->size(1) == D,
                "cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(num_layers > 0, "the decoder has no layers");
  // Per-layer windows and rope tables: each layer's attention plan (one per distinct window) and table.
  TORCH_CHECK(layer_windows.empty() || static_cast<int64_t>(layer_windows.size()) == num_layers,
              "layer_windows must be empty or hold one window per layer");
  TORCH_CHECK(layer_rope.empty() || static_cast<int64_t>(layer_rope.size()) == num_layers,
              "layer_rope must be empty or hold one table index per layer");
  TORCH_CHECK(local_cos.has_value() == local_sin.has_value(), "local_cos and local_sin come together");
  if (local_cos.has_value())
    for (const auto* t : {&*local_cos, &*local_sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == T &&
                      t->size(1) == D,
                  "local_cos and local_sin must be contiguous float32 [T, head_dim]");
  for (const int64_t r : layer_rope)
    TORCH_CHECK(r == 0 || (r == 1 && local_cos.has_value()), "layer_rope entries are 0, or 1 with local_cos/sin");
  std::vector<int64_t> windows;  // the distinct windows, in first-use order
  std::vector<int64_t> plan_of(num_layers, 0);
  for (int64_t i = 0; i < num_layers; ++i) {
    const int64_t w = layer_windows.empty() ? sliding_window : layer_windows[i];
    TORCH_CHECK(w >= 0, "sliding_window must be >= 0 (0 for none), got ", w, " for layer ", i);
    int64_t k = 0;
    while (k < static_cast<int64_t>(windows.size()) && windows[k] != w) ++k;
    if (k == static_cast<int64_t>(windows.size())) windows.push_back(w);
    plan_of[i] = k;
  }
  const at::Tensor& pool0 = k_caches[0];
  const at::ScalarType pool_dtype = pool0.scalar_type();
  for (int64_t i = 0; i < num_layers; ++i) {
    for (const auto* pool : {&k_caches[i], &v_caches[i]})
      TORCH_CHECK((pool_dtype == at::kFloat || pool_dtype == at::kBFloat16 || pool_dtype == at::kChar) &&
                      pool->scalar_type() == pool_dtype && pool->is_contiguous() && pool->dim() == 4 &&
                      pool->sizes() == pool0.sizes(),
                  "every K/V pool must be contiguous, of one shape and one dtype (float32, bfloat16 or int8)");
  }
  TORCH_CHECK(pool0.size(2) == KVH && kv_pool_head_dim(pool0) == D, "the K/V pools hold ", pool0.size(2),
              " heads of ", kv_pool_head_dim(pool0), ", the model ", KVH, " of ", D);
  TORCH_CHECK(pool_dtype != at::kChar || D % 16 == 0, "int8 K/V rows need head_dim a multiple of 16, got ", D);
  const int64_t num_slots = pool0.size(0) * pool0.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot ", slots[r], " is outside the K/V pool");
  TORCH_CHECK(logits_indices.scalar_type() == at::kLong && logits_indices.is_contiguous() &&
                  logits_indices.dim() == 1,
              "logits_indices must be int64 [L]");
  const int64_t L = logits_indices.numel();
  const int64_t* picks = logits_indices.data_ptr<int64_t>();
  for (int64_t j = 0; j < L; ++j)
    TORCH_CHECK(picks[j] >= 0 && picks[j] < T, "logits index ", picks[j], " is outside the batch of ", T);
  // LoRA: the groups' rows, and which of the step's linears any group updates (those meet at one more barrier).
  const int64_t I = shape_.intermediate_size, q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size;
  const auto G = static_cast<int64_t>(lora.size());
  TORCH_CHECK(lora_rows.has_value() == (G > 0) && lora_starts.has_value() == (G > 0),
              "lora_rows and lora_starts come with the LoRA groups, and only with them");
  const int64_t* lrows = nullptr;
  const int64_t* lstarts = nullptr;
  int64_t M = 0, lora_scratch = 0;
  std::vector<char> lora_targets(num_layers * 4, 0);
  if (G > 0) {
    TORCH_CHECK(lora_starts->scalar_type() == at::kLong && lora_starts->is_contiguous() &&
                    lora_starts->numel() == G + 1,
                "lora_starts must be int64 [groups + 1]");
    TORCH_CHECK(lora_rows->scalar_type() == at::kLong && lora_rows->is_contiguous() && lora_rows->dim() == 1,
                "lora_rows must be int64 [rows]");
    lrows = lora_rows->data_ptr<int64_t>();
    lstarts = lora_starts->data_ptr<int64_t>();
    M = lora_rows->numel();
    TORCH_CHECK(lstarts[0] == 0 && lstarts[G] == M, "lora_starts must run from 0 to the number of LoRA rows");
    for (int64_t g = 0; g < G; ++g) TORCH_CHECK(lstarts[g] <= lstarts[g + 1], "lora_starts must not decrease");
    std::vector<char> seen(T, 0);
    for (int64_t r = 0; r < M; ++r) {
      TORCH_CHECK(lrows[r] >= 0 && lrows[r] < T, "LoRA row ", lrows[r], " is outside the batch of ", T);
      TORCH_CHECK(!seen[lrows[r]], "LoRA row ", lrows[r], " is in two adapter groups");
      seen[lrows[r]] = 1;
    }
    const int64_t ins[4] = {hidden_, q_size, hidden_, I};
    const int64_t outs[4] = {qkv_size, hidden_, 2 * I, hidden_};
    for (const auto& adapter : lora) {
      TORCH_CHECK(static_cast<int64_t>(adapter.linears.size()) == num_layers * 4,
                  "LoRA weights must hold 4 entries per layer");
      for (int64_t e = 0; e < num_layers * 4; ++e) {
        if (!adapter.linears[e].has_value()) continue;
        check_lora_linear(*adapter.linears[e], ins[e % 4], outs[e % 4]);
        lora_targets[e] = 1;
        lora_scratch = std::max(lora_scratch, lora_scratch_size(*adapter.linears[e]));
      }
    }
  }

  // thread_local: the calling thread's, reused across steps; the team reaches them through these pointers.
  thread_local std::vector<AttentionPlan> step_plans;
  thread_local ActivationCodes step_codes;
  if (step_plans.size() < windows.size()) step_plans.resize(windows.size());
  for (size_t k = 0; k < windows.size(); ++k)
    plan_attention(step_plans[k], block_tables, query_start_loc, seq_lens, T, H, pool0.size(2), D, pool0.size(0),
                   pool0.size(1), windows[k]);
  const AttentionPlan* const plans = step_plans.data();
  ActivationCodes* const codes = &step_codes;

  // The step's activations, written and read by the whole team.
  const auto opts = x.options();
  const at::Tensor h = at::empty({T, hidden_}, opts);
  const at::Tensor qkv = at::empty({T, qkv_size}, opts);
  const at::Tensor attn = at::empty({T, q_size}, opts);
  const at::Tensor o = at::empty({T, hidden_}, opts);
  const at::Tensor gate_up = at::empty({T, 2 * I}, opts);
  const at::Tensor act = at::empty({T, I}, opts);
  const at::Tensor last = at::empty({L, hidden_}, opts);
  at::Tensor logits = at::empty({L, lm_head_.out_features}, opts);
  if (T == 0) return logits;
  codes->fit(T, std::max({hidden_, q_size, I}));
  codes->fine = fine_activations;  // the step's scratch is the thread's: set on every call
  std::vector<std::atomic<int64_t>> next_unit(num_layers);
  for (auto& n : next_unit) n.store(0, std::memory_order_relaxed);

  float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  float* attnp = attn.data_ptr<float>();
  float* op = o.data_ptr<float>();
  float* gup = gate_up.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  const float* cosp = cos.data_ptr<float>();
  const float* sinp = sin.data_ptr<float>();
  const float* local_cosp = local_cos.has_value() ? local_cos->data_ptr<float>() : nullptr;
  const float* local_sinp = local_sin.has_value() ? local_sin->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(shape_.rms_norm_eps);

  // One member's whole step. Row-wise work goes by the member's share of the rows (the same
  // share every time, so a member's row phases need no barrier between them); the linears
  // and the attention meet at the barrier around them.
  const bool timing = phase_timing.load(std::memory_order_relaxed);
  std::array<double, STEP_PHASES> step_seconds{};
  auto member = [&](const Team& team) {
    PhaseClock clock(timing && team.rank == 0);
    int64_t r0 = 0, r1 = 0;
    team.share(T, r0, r1);
    // This member's share of the LoRA rows (in group order), and its scratch.
    int64_t p0 = 0, p1 = 0;
    team.share(M, p0, p1);
    std::vector<float> scratch(lora_scratch);
    // out += each group's update of linear k of layer i, on this member's LoRA rows; then the team
    // meets, since the row phase after a linear takes the rows by the other share.
    auto add_lora = [&](int64_t i, int64_t k, const float* in, int64_t in_features, float* out, int64_t out_features) {
      if (!lora_targets[i * 4 + k]) return;
      for (int64_t g = 0; g < G; ++g) {
        const auto& w = lora[g].linears[i * 4 + k];
        const int64_t b = std::max(p0, lstarts[g]), e = std::min(p1, lstarts[g + 1]);
        if (w.has_value() && b < e) lora_add_rows(*w, in, in_features, out, out_features, lrows + b, e - b, scratch.data());
      }
      team.sync();
    };
    for (int64_t i = 0; i < num_layers; ++i) {
      const LayerWeights& layer = layers_[i];
      for (int64_t r = r0; r < r1; ++r)
        rms_norm_row(xp + r * hidden_, layer.input_norm.data_ptr<float>(), eps, hidden_, hp + r * hidden_);
      clock.mark(NORMS);
      packed_linear_into(layer.qkv, hp, T, hidden_, qkvp, *codes, &team);
      add_lora(i, 0, hp, hidden_, qkvp, qkv_size);
      clock.mark(QKV);
      // This member's tokens: q/k norms, RoPE, and their K/V into the pool, which the attention reads.
      void* kpool = k_caches[i].data_ptr();
      void* vpool = v_caches[i].data_ptr();
      const bool local_rope = !layer_rope.empty() && layer_rope[i] == 1;
      const float* lcos = local_rope ? local_cosp : cosp;
      const float* lsin = local_rope ? local_sinp : sinp;
      for (int64_t r = r0; r < r1; ++r) {
        float* qr = qkvp + r * qkv_size;
        float* kr = qr + q_size;
        const float* vr = kr + kv_size;
        if (layer.q_norm.has_value()) {
          for (int64_t hh = 0; hh < H; ++hh) rms_norm_row(qr + hh * D, layer.q_norm->data_ptr<float>(), eps, D, qr + hh * D);
          for (int64_t hh = 0; hh < KVH; ++hh)
            rms_norm_row(kr + hh * D, layer.k_norm->data_ptr<float>(), eps, D, kr + hh * D);
        }
        rope_row(qr, H, D, lcos + r * D, lsin + r * D, D);
        rope_row(kr, KVH, D, lcos + r * D, lsin + r * D, D);
        if (pool_dtype == at::kBFloat16) {
          // Round to nearest even, as the module path's k.to(torch.bfloat16) does.
          auto* kdst = static_cast<c10::BFloat16*>(kpool) + slots[r] * kv_size;
          auto* vdst = static_cast<c10::BFloat16*>(vpool) + slots[r] * kv_size;
          for (int64_t e = 0; e < kv_size; ++e) kdst[e] = c10::BFloat16(kr[e]);
          for (int64_t e = 0; e < kv_size; ++e) vdst[e] = c10::BFloat16(vr[e]);
        } else if (pool_dtype == at::kChar) {  // as the module path's write_kv_int8_
          const int64_t slot_bytes = KVH * pool0.size(3);
          quantize_kv_slot(kr, KVH, D, static_cast<int8_t*>(kpool) + slots[r] * slot_bytes);
          quantize_kv_slot(vr, KVH, D, static_cast<int8_t*>(vpool) + slots[r] * slot_bytes);
        } else {
          std::memcpy(static_cast<float*>(kpool) + slots[r] * kv_size, kr, kv_size * sizeof(float));
          std::memcpy(static_cast<float*>(vpool) + slots[r] * kv_size, vr, kv_size * sizeof(float));
        }
      }
      team.sync();
      clock.mark(ROPE_KV);
      paged_attention_into(plans[plan_of[i]], qkvp, qkv_size, H, k_caches[i], v_caches[i], attnp, shape_.attention_scale, &team,
                           &next_unit[i]);
      team.sync();  // the o projection quantizes its own rows, which any member's units wrote
      clock.mark(ATTENTION);
      packed_linear_into(layer.o, attnp, T, q_size, op, *codes, &team);
      add_lora(i, 1, attnp, q_size, op, hidden_);
      clock.mark(O_PROJ);
      const bool sandwich = layer.pre_feedforward_norm.has_value();
      for (int64_t r = r0; r < r1; ++r) {
        if (sandwich) {  // x += norm(attention); h = norm(x), as the module path's three operations
          rms_norm_row(op + r * hidden_, layer.post_attention_norm.data_ptr<float>(), eps, hidden_, op + r * hidden_);
          add_row(xp + r * hidden_, op + r * hidden_, hidden_);
          rms_norm_row(xp + r * hidden_, layer.pre_feedforward_norm->data_ptr<float>(), eps, hidden_, hp + r * hidden_);
        } else {
          add_rms_norm_row(op + r * hidden_, xp + r * hidden_, layer.post_attention_norm.data_ptr<float>(), eps,
                           hidden_, hp + r * hidden_);
        }
      }
      clock.mark(NORMS);
      packed_linear_into(layer.gate_up, hp, T, hidden_, gup, *codes, &team);
      add_lora(i, 2, hp, hidden_, gup, 2 * I);
      clock.mark(GATE_UP);
      if (r0 < r1) {
        // ATen's own activation and product, on whole rows: the module path's exact bits. The
        // activation goes straight into the output rows and the product multiplies them in place
        // (elementwise, the same two roundings): a temporary of the gate's size was allocated,
        // page-faulted and freed per layer, which cost twice the arithmetic in prefill steps.
        const at::Tensor rows = gate_up.narrow(0, r0, r1 - r0);
        at::Tensor out_rows = act.narrow(0, r0, r1 - r0);
        const at::Tensor gate = rows.narrow(1, 0, I);
        if (shape_.gelu_tanh)
          at::gelu_out(out_rows, gate, "tanh");
        else
          at::silu_out(out_rows, gate);
        at::mul_out(out_rows, out_rows, rows.narrow(1, I, I));
      }
      clock.mark(ACTIVATION);
      packed_linear_into(layer.down, actp, T, I, op, *codes, &team);
      add_lora(i, 3, actp, I, op, hidden_);
      clock.mark(DOWN);
      for (int64_t r = r0; r < r1; ++r) {
        if (sandwich)
          rms_norm_row(op + r * hidden_, layer.post_feedforward_norm->data_ptr<float>(), eps, hidden_, op + r * hidden_);
        add_row(xp + r * hidden_, op + r * hidden_, hidden_);
      }
    }
    team.sync();  // the picked rows may be any member's
    int64_t j0 = 0, j1 = 0;
    team.share(L, j0, j1);
    float* lastp = last.data_ptr<float>();
    for (int64_t j = j0; j < j1; ++j)
      rms_norm_row(xp + picks[j] * hidden_, final_norm_.data_ptr<float>(), eps, hidden_, lastp + j * hidden_);
    clock.mark(NORMS);
    packed_linear_into(lm_head_, lastp, L, hidden_, logits.data_ptr<float>(), *codes, &team);
    clock.mark(LM_HEAD);
    if (team.rank == 0) step_seconds = clock.seconds;
  };

  const int threads = std::max(1, at::get_num_threads());
  SpinBarrier barrier(threads);
  std::exception_ptr failure;
  std::mutex failure_lock;
  auto guarded = [&](int rank, int size) {
    // The workers are OpenMP threads, not the caller: give them the caller's no-autograd mode
    // for the ATen calls on the step's (possibly inference-mode) tensors.
    c10::InferenceMode no_grad;
    barrier.set_size(size);  // OpenMP may grant fewer threads than asked; every member sets the same size
    try {
      member(Team{rank, size, &barrier});
    } catch (...) {
      barrier.break_();
      std::lock_guard<std::mutex> lock(failure_lock);
      if (!failure) failure = std::current_exception();
    }
  };
  if (threads == 1) {
    guarded(0, 1);
  } else {
#pragma omp parallel num_threads(threads)
    guarded(omp_get_thread_num(), omp_get_num_threads());
  }
  if (failure) std::rethrow_exception(failure);
  if (timing) {
    std::lock_guard<std::mutex> lock(phase_lock);
    for (int k = 0; k < STEP_PHASES; ++k) phase_seconds[k] += step_seconds[k];
    phase_steps += 1;
    phase_tokens += T;
  }
  return logits;
}

}  // namespace protoserve
