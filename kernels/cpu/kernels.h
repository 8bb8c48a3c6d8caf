// The CPU kernels' C++ entry points, shared by the Python bindings (module.cpp)
// and the fused decoder step (decoder_step.cpp), which calls them without going
// back through Python between layers.
#pragma once

// The Tensor class and ATen's threads, not <ATen/ATen.h> or torch/extension.h: every source parses
// this header, and each source includes the few operators it calls (ATen/ops/*.h), since parsing
// the headers was most of a first build's time (every fresh venv, every kernel change).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "team.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

namespace protoserve {

// Scratch of the integer-dot formats: a batch's activations quantized to int8 codes, reused
// across calls (thread_local for single calls; one shared instance for a team). The bfloat16
// products of linear.cpp keep their rounded rows in `codes` too.
struct ActivationCodes {
  std::vector<int8_t> codes;  // [2, padded_rows(M) / 16, K / 32, 16, 32]: coarse codes, then fine
  std::vector<float> scales;  // [M, K / 32] per block
  std::vector<float> sums;    // [M, K / 32] per block: the exact float sum of x
  std::vector<int32_t> code_sums;  // [2, M, K / 32] per block: the sum of its coarse codes, then of its fine ones
  // Set by the caller before each product: the fine codes of the coarse codes' rounding error ("exact"
  // activation precision), or the coarse codes alone ("fast": llama.cpp's Q8 activations, half the
  // integer products, a coarser result). Either way a row's result does not depend on the batch.
  bool fine = true;

  static constexpr int64_t ROW_GROUP = 16;  // rows per group of the code layout
  static int64_t padded_rows(int64_t M) { return (M + ROW_GROUP - 1) / ROW_GROUP * ROW_GROUP; }

  void fit(int64_t M, int64_t K) {
    const size_t blocks = static_cast<size_t>(M) * (K / 32);
    const int64_t padded = padded_rows(M);
    if (codes.size() < static_cast<size_t>(2 * padded * K)) codes.resize(2 * padded * K);
    if (scales.size() < blocks) scales.resize(blocks);
    if (sums.size() < blocks) sums.resize(blocks);
    if (code_sums.size() < 2 * blocks) code_sums.resize(2 * blocks);
  }
};

// One packed linear layer, as packed_linear.py's PackedWeight describes it.
struct LinearWeights {
  int64_t format = 0;
  at::Tensor data;
  c10::optional<at::Tensor> scales;
  c10::optional<at::Tensor> mins;
  c10::optional<at::Tensor> bias;
  int64_t out_features = 0;
  int64_t group_size = 0;
};

// linear.cpp: y = x @ W^T (+ bias) over a weight packed by packed_linear.py; float32 [M, N].
// fine_activations: the integer-dot formats' fine codes (ActivationCodes::fine); other formats ignore it.
at::Tensor packed_linear(const at::Tensor& x, int64_t format, const at::Tensor& data,
                         const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& mins,
                         const c10::optional<at::Tensor>& bias, int64_t out_features, int64_t group_size,
                         bool fine_activations);
// Throws unless `w` is a well-formed pack for `in_features` inputs; packed_linear_into trusts it.
void check_packed_linear(const LinearWeights& w, int64_t in_features);
// out [M, N] = x [M, K] @ W^T (+ bias), raw rows; as one member of `team` (which then meets at
// its barrier inside: before reading x, after writing out), or alone across ATen's threads.
// `codes` must fit [M, K] for the integer-dot formats.
void packed_linear_into(const LinearWeights& w, const float* x, int64_t M, int64_t K, float* out,
                        ActivationCodes& codes, const Team* team);

// int8_dot_linear.cpp (AVX-512 VNNI, AMX or AVX2): the same over 4- or 8-bit unsigned
// codes (format int4_dot / int8_dot), x quantized to int8 per 32 values.
void int8_dot_linear_into(const LinearWeights& w, int bits, const float* x, int64_t M, int64_t K, float* out,
                          ActivationCodes& codes, const Team* team);
// Whether 16-row groups run on AMX-INT8 tiles (CPU, compiler and OS all allow it); same results.
bool int8_dot_amx_available();

// Whether bfloat16 packs multiply in bfloat16 (x rounded to bf16 once per call, vdpbf16ps) here.
bool linear_multiplies_in_bf16();

// argmax.cpp: each row's first maximum (NumPy's argmax), int64 [rows].
at::Tensor argmax_rows(const at::Tensor& logits);

// norm_rope.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// The same on one row of d values (out may be x): what the tensor entries run per row.
void rms_norm_row(const float* x, const float* weight, float eps, int64_t d, float* out);
// residual += x over one row of d values (the residual stream's add, as ATen's add_ rounds it).
void add_row(float* residual, const float* x, int64_t d);
void add_rms_norm_row(const float* x, float* residual, const float* weight, float eps, int64_t d, float* out);
// x: one token's `heads` heads of d values, head_stride apart; cos/sin: that token's [d].
void rope_row(float* x, int64_t heads, int64_t head_stride, const float* cos, const float* sin, int64_t d);

// paged_attention.cpp
// Whether bfloat16 pools (head_dim a multiple of 32) multiply in bfloat16 (query and probabilities rounded).
bool attention_multiplies_in_bf16();
// Whether int8 pools (head_dim 32, 64 or 128) multiply in int16 (query and block weights quantized to int16).
bool attention_int8_in_int16();
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                           const at::Tensor& seq_lens, double scale, int64_t sliding_window);

// A batch's attention work, checked and cut into units once: every layer of a step shares it.
struct AttentionTile {
  int64_t row;   // first query row (of T)
  int32_t n;     // queries in the tile
  int32_t seq;   // sequence
  int32_t pos0;  // position of the first query
  // A shared tile: one decode query of each of n sequences whose tables hold the same blocks from the
  // start of pos0's partition up to pos0 (whole key blocks), all of which each of them sees. Its
  // queries' rows, and the (split) tile of each, which the rest of its partition's walk and its state
  // go to; null for a tile of consecutive queries.
  const int64_t* rows = nullptr;
  const int32_t* members = nullptr;
};
// One unit of work: KV heads kvh0 .. kvh0 + nkv - 1 of a tile, over its whole key range (part < 0)
// or only over its keys in partition `part` (paged_attention.cpp's PARTITION), all heads.
struct AttentionUnit {
  int32_t tile;
  int16_t kvh0;
  int16_t nkv;
  int32_t part;
};
struct AttentionPlan {
  std::vector<AttentionTile> tiles;
  std::vector<int64_t> shared_rows;     // what shared tiles' rows point into
  std::vector<int32_t> shared_members;  // and their members
  std::vector<AttentionUnit> units;  // handed out in this order
  std::vector<int64_t> tile_slot;    // where a split tile's slots (one per partition) start in `partials`; -1: not split
  int64_t total_work = 0;  // query heads x visible keys x head_dim, for the fork/join decision
  const int32_t* block_tables = nullptr;
  int64_t max_blocks = 0;
  int64_t num_tokens = 0;
  int64_t sliding_window = 0;
  // Written during a call by whichever threads run a split tile's units (the plan is otherwise read-only
  // there): each partition's softmax state, and per tile the partitions done (back to 0 once merged).
  mutable std::vector<float> partials;
  mutable std::unique_ptr<std::atomic<int32_t>[]> done;
  int64_t done_size = 0;
};
// Throws on inconsistent indices (block ids are checked against num_blocks). The units are cut for
// at::get_num_threads() threads; which units exist changes no result.
void plan_attention(AttentionPlan& plan, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                    const at::Tensor& seq_lens, int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t sliding_window);
// The head size of a K/V pool: [num_blocks, bs, KVH, D] float32 or bfloat16, [.., D + 4] int8.
int64_t kv_pool_head_dim(const at::Tensor& pool);
// Of the plan paged_attention would make for these indices: its shared tiles and the queries in them.
std::tuple<int64_t, int64_t> attention_shared_tiles(const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                                    const at::Tensor& seq_lens, int64_t num_heads,
                                                    int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                                                    int64_t block_size, int64_t sliding_window);
// One token's `heads` rows of D values (D % 16 == 0) into an int8 pool's slot: per head D codes, then the
// float32 scale.
void quantize_kv_slot(const float* x, int64_t heads, int64_t D, int8_t* slot);
// pool's slots[t] rows = rows[t] ([T, KVH, D] float32), quantized (the module path's K/V write).
void write_kv_int8_(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& rows);
// out [T, H, D] dense; q rows q_stride floats apart; caches float32, bfloat16 or int8 (kv_pool_head_dim).
// In a team, members take units from `next` (zero before the first member starts) and do not sync.
void paged_attention_into(const AttentionPlan& plan, const float* q, int64_t q_stride, int64_t num_heads,
                          const at::Tensor& k_cache, const at::Tensor& v_cache, float* out, double scale,
                          const Team* team, std::atomic<int64_t>* next);

// One decoder block's weights (engine/models/decoder.py: DecoderLayer).
struct LayerWeights {
  at::Tensor input_norm;
  at::Tensor post_attention_norm;
  c10::optional<at::Tensor> q_norm;  // Qwen3, Gemma 3: RMSNorm over each head of q and k
  c10::optional<at::Tensor> k_norm;
  LinearWeights qkv;
  LinearWeights o;
  LinearWeights gate_up;
  LinearWeights down;
  // Gemma's "sandwich" block: with these, post_attention_norm norms the attention's output before the
  // residual add, pre_feedforward_norm the MLP's input and post_feedforward_norm its output.
  c10::optional<at::Tensor> pre_feedforward_norm;
  c10::optional<at::Tensor> post_feedforward_norm;
};

// lora.cpp: one adapter's low-rank update of one fused linear layer (engine/lora/adapter.py's
// FusedDelta), out[r] += B (A x[r]) on the rows that run the adapter.
struct LoraLinear {
  // float32: a [R, in rounded up to 16], bt = B^T [R, out + 16]. bfloat16 (AVX512-BF16 only, even
  // rank): a [R, in rounded up to 32], bt = B in rank pairs [R / 2, (out + 32) * 2]. Zero padding
  // makes every weight load a whole vector; the targets' A rows are stacked, `rank` rows each.
  at::Tensor a;
  at::Tensor bt;  // the scale folded in
  std::vector<int64_t> slice_begin;  // target j (rows j * rank .. of a and bt) writes out[slice_begin[j], slice_end[j])
  std::vector<int64_t> slice_end;
  int64_t rank = 0;
};
// One adapter's updates at [layer * 4 + k], k = qkv, o, gate_up, down: none where it does not target the layer.
struct LoraWeights {
  std::vector<c10::optional<LoraLinear>> linears;
};
// Whether bfloat16 LoRA weights can be multiplied here (vdpbf16ps).
bool lora_multiplies_in_bf16();
// Throws unless `w` is well formed for a layer of in_features inputs and out_features outputs.
void check_lora_linear(const LoraLinear& w, int64_t in_features, int64_t out_features);
// Floats of scratch lora_add_rows needs for `w`.
int64_t lora_scratch_size(const LoraLinear& w);
// out[rows[i]] += B (A x[rows[i]]) for i < n; x rows `in` floats apart, out rows out_stride apart.
// Each row on its own, in a fixed order: a row's result does not depend on the others.
void lora_add_rows(const LoraLinear& w, const float* x, int64_t in, float* out, int64_t out_stride,
                   const int64_t* rows, int64_t n, float* scratch);
// The same on tensors (out float32 [T, out] in place, x float32 [T, in], rows int64 [n]).
void lora_add_(at::Tensor& out, const at::Tensor& x, const LoraLinear& w, const at::Tensor& rows);

// The shape numbers every layer shares.
struct DecoderShape {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  double rms_norm_eps = 0.0;
  double attention_scale = 0.0;  // the model's own attention scale (Attention.scale), bit for bit
  bool gelu_tanh = false;        // the MLP gate's activation: gelu (tanh approximation) instead of SiLU
};

// The decoder's layers, final norm and LM head run as one C++ call per forward.
// Where the fused step's time goes, for bench/step_profile.py --phases: the wall time of each phase
// of the layer loop as member 0 of the team sees it (a linear's phase ends at the barrier after it, so
// it includes waiting for the slower member), summed over the steps run while timing is on. Off by
// default; off, the step reads no clock.
enum StepPhase { NORMS, QKV, ROPE_KV, ATTENTION, O_PROJ, GATE_UP, ACTIVATION, DOWN, LM_HEAD, STEP_PHASES };
extern const char* const STEP_PHASE_NAMES[STEP_PHASES];
void set_step_phase_timing(bool enabled);
// Seconds per phase, then the steps and tokens they cover; resets the totals.
std::vector<double> take_step_phase_totals();

class DecoderStep {
 public:
  DecoderStep(DecoderShape shape, std::vector<LayerWeights> layers, at::Tensor final_norm, LinearWeights lm_head);

  // x: the batch's embedded tokens [T, hidden] float32 (consumed: updated in place);
  // cos/sin [T, head_dim]; k_caches/v_caches: one [num_blocks, block_size, KVH, D] pool per layer, all
  // float32 or all bfloat16 (K/V rounded to nearest even as they are stored).
  // sliding_window: 0 for none. lora: the adapters of the batch's adapter groups; group g's rows are
  // lora_rows[lora_starts[g] : lora_starts[g + 1]] (each row in at most one group; rows in none run the
  // base model alone). layer_windows: each layer's window (0 for none) where layers differ; empty: every
  // layer takes sliding_window. local_cos/local_sin: a second rope table [T, head_dim], which the layers
  // with layer_rope[i] == 1 rotate by (empty layer_rope: every layer takes cos/sin). fine_activations:
  // ActivationCodes::fine for every integer-dot layer of the step.
  // Returns float32 logits [len(logits_indices), vocab].
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     const at::Tensor& logits_indices, int64_t sliding_window,
                     const std::vector<LoraWeights>& lora, const c10::optional<at::Tensor>& lora_rows,
                     const c10::optional<at::Tensor>& lora_starts, const std::vector<int64_t>& layer_windows,
                     const c10::optional<at::Tensor>& local_cos, const c10::optional<at::Tensor>& local_sin,
                     const std::vector<int64_t>& layer_rope, bool fine_activations) const;

 private:
  DecoderShape shape_;
  int64_t hidden_ = 0;
  std::vector<LayerWeights> layers_;
  at::Tensor final_norm_;
  LinearWeights lm_head_;
};

}  // namespace protoserve

// moe_experts.cpp: a MoE block's routed experts (engine/models/moe.py: GroupedExperts).
// gate_up[e] packs [2I, H] (gate rows, then up), down[e] packs [H, I]; per token, the sum over its
// slots in order of weight * down(silu(gate) * up), each expert's rows gathered into one product.
namespace protoserve {
// A batch's (token, slot) pairs p = t * k + s grouped by expert (a stable counting sort).
struct ExpertGroups {
  std::vector<int64_t> start;  // [E + 1]: expert e's pairs are order[start[e] .. start[e + 1])
  std::vector<int64_t> order;  // [T * k]
  int64_t most = 0;            // the largest group's size
};
// Throws on an id outside 0..num_experts - 1.
void group_by_expert(const int64_t* ids, int64_t num_pairs, int64_t num_experts, ExpertGroups& groups);
// One thread's buffers for running an expert (float32): rows [most, H], gate_up [most, 2I],
// act [most, I], y [most, H], and the integer-dot and bf16 formats' activation codes.
struct MoEBuffers {
  at::Tensor rows, gate_up, act, y;
  ActivationCodes codes;
};
// The pass's buffers, grown as needed and reused: one MoEBuffers per team member (members[0] serves
// the whole team when it shares each product) and pairs [T * k, H].
struct MoEScratch {
  std::vector<MoEBuffers> members;
  at::Tensor pairs;
  void fit(int64_t num_members, int64_t most, int64_t num_pairs, int64_t H, int64_t I);
};
// Throws unless the experts are well-formed packs of one shape for H inputs; moe_experts_into trusts them.
void check_moe_experts(const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down, int64_t H);
// out [T, H] from x [T, H] and weights [T, k] (float32, raw rows) over `groups` of the batch's expert
// ids; as one member of `team` (meeting at its barrier; all of out written when it returns), or alone
// across ATen's threads. With at least two active experts per member, members run whole experts on
// their own buffers (no barrier between them); otherwise they share each product. `scratch` must fit
// the team's size, groups.most and T * k.
void moe_experts_into(const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down,
                      const float* x, int64_t T, int64_t H, int64_t k, const float* weights,
                      const ExpertGroups& groups, MoEScratch& scratch, float* out, const Team* team);
// The same from tensors, checked: x [T, H] float32, expert_ids int64 and weights float32 [T, k];
// runs as one team of ATen's thread count. Returns float32 [T, H].
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids, const at::Tensor& weights,
                       const std::vector<LinearWeights>& gate_up, const std::vector<LinearWeights>& down);
}  // namespace protoserve
