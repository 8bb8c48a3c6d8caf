// The CPU kernels' C++ entry points, shared by the Python bindings (module.cpp)
// and the fused decoder step (decoder_step.cpp), which calls them without going
// back through Python between layers.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace protoserve {

// linear.cpp: y = x @ W^T (+ bias) over a weight packed by packed_linear.py; float32 [M, N].
torch::Tensor packed_linear(const torch::Tensor& x, int64_t format, const torch::Tensor& data,
                            const c10::optional<torch::Tensor>& scales, const c10::optional<torch::Tensor>& mins,
                            const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t group_size);

// int8_dot_linear.cpp (needs AVX-512 VNNI: int8_dot_available()): the same over 4- or 8-bit unsigned codes, x quantized to int8 per 32 values.
torch::Tensor int8_dot_linear(const torch::Tensor& x, int64_t bits, const torch::Tensor& data,
                              const torch::Tensor& scales, const torch::Tensor& mins,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t group_size,
                              bool fine);
bool int8_dot_available();

// norm_rope.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm_(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);
void rope_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);

// paged_attention.cpp
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                              const torch::Tensor& seq_lens, double scale, int64_t sliding_window);

// decoder_step.cpp: one packed linear layer, as packed_linear.py's PackedWeight describes it.
struct LinearWeights {
  int64_t format = 0;
  torch::Tensor data;
  c10::optional<torch::Tensor> scales;
  c10::optional<torch::Tensor> mins;
  c10::optional<torch::Tensor> bias;
  int64_t out_features = 0;
  int64_t group_size = 0;

  torch::Tensor operator()(const torch::Tensor& x) const {
    return packed_linear(x, format, data, scales, mins, bias, out_features, group_size);
  }
};

// One pre-norm decoder block's weights (engine/models/decoder.py: DecoderLayer).
struct LayerWeights {
  torch::Tensor input_norm;
  torch::Tensor post_attention_norm;
  c10::optional<torch::Tensor> q_norm;  // Qwen3: RMSNorm over each head of q and k
  c10::optional<torch::Tensor> k_norm;
  LinearWeights qkv;
  LinearWeights o;
  LinearWeights gate_up;
  LinearWeights down;
};

// The shape numbers every layer shares.
struct DecoderShape {
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  double rms_norm_eps = 0.0;
  double attention_scale = 0.0;  // the model's own head_dim ** -0.5, bit for bit
};

// The decoder's layers, final norm and LM head run as one C++ call per forward.
class DecoderStep {
 public:
  DecoderStep(DecoderShape shape, std::vector<LayerWeights> layers, torch::Tensor final_norm, LinearWeights lm_head);

  // x: the batch's embedded tokens [T, hidden] float32 (consumed: updated in place);
  // cos/sin [T, head_dim]; k_caches/v_caches: one [num_blocks, block_size, KVH, D] float32 pool per layer.
  // sliding_window: 0 for none. Returns float32 logits [len(logits_indices), vocab].
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                        const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                        const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                        const torch::Tensor& logits_indices, int64_t sliding_window) const;

 private:
  DecoderShape shape_;
  std::vector<LayerWeights> layers_;
  torch::Tensor final_norm_;
  LinearWeights lm_head_;
};

}  // namespace protoserve
