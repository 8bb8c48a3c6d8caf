// The whole decoder forward in one C++ call: the layer loop of
// engine/models/decoder.py, calling the same kernels in the same order, so its
// logits are bit-identical to the module-by-module path.
//
// Why: at decode batch sizes a SmolLM2 step is ~30 layers x a dozen small ops.
// Driven from Python each op costs a module call, argument checks and a dispatch
// (measured ~0.4 ms per layer, a third of an int4 step); here the loop costs
// microseconds, and the GIL is released for the whole step, so the server's
// event loop keeps streaming while the model runs.

#include "kernels.h"

#include <ATen/ATen.h>

#include <utility>

namespace protoserve {

DecoderStep::DecoderStep(DecoderShape shape, std::vector<LayerWeights> layers, torch::Tensor final_norm,
                         LinearWeights lm_head)
    : shape_(shape), layers_(std::move(layers)), final_norm_(std::move(final_norm)), lm_head_(std::move(lm_head)) {
  TORCH_CHECK(shape_.num_heads > 0 && shape_.num_kv_heads > 0 && shape_.head_dim > 0,
              "the decoder step needs positive head counts and head_dim");
  TORCH_CHECK(shape_.num_heads % shape_.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t qkv = (shape_.num_heads + 2 * shape_.num_kv_heads) * shape_.head_dim;
  for (const auto& layer : layers_) {
    TORCH_CHECK(layer.qkv.out_features == qkv, "qkv projection has ", layer.qkv.out_features, " outputs, expected ",
                qkv);
    TORCH_CHECK(layer.gate_up.out_features == 2 * shape_.intermediate_size, "gate_up projection size mismatch");
    TORCH_CHECK(layer.q_norm.has_value() == layer.k_norm.has_value(), "q_norm and k_norm come together");
  }
}

torch::Tensor DecoderStep::forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                   const std::vector<torch::Tensor>& k_caches,
                                   const std::vector<torch::Tensor>& v_caches, const torch::Tensor& slot_mapping,
                                   const torch::Tensor& block_tables, const torch::Tensor& query_start_loc,
                                   const torch::Tensor& seq_lens, const torch::Tensor& logits_indices, int64_t sliding_window) const {
  const int64_t num_layers = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers && static_cast<int64_t>(v_caches.size()) == num_layers,
              "one K and one V pool per layer");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be contiguous float32 [T, hidden]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.numel() == x.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t t = x.size(0);
  const int64_t H = shape_.num_heads, KVH = shape_.num_kv_heads, D = shape_.head_dim;
  const int64_t q_size = H * D, kv_size = KVH * D;
  for (int64_t i = 0; i < num_layers; ++i) {
    const LayerWeights& layer = layers_[i];
    // Attention block.
    const torch::Tensor h = rms_norm(x, layer.input_norm, shape_.rms_norm_eps);
    const torch::Tensor qkv = layer.qkv(h);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({t, H, D});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, KVH, D});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, KVH, D});
    if (layer.q_norm.has_value()) {
      q = rms_norm(q.contiguous(), *layer.q_norm, shape_.rms_norm_eps);
      k = rms_norm(k.contiguous(), *layer.k_norm, shape_.rms_norm_eps);
    }
    rope_(q, cos, sin);
    rope_(k, cos, sin);
    // The new K/V go into the pool first: the attention reads each context from it.
    k_caches[i].view({-1, KVH, D}).index_copy_(0, slot_mapping, k);
    v_caches[i].view({-1, KVH, D}).index_copy_(0, slot_mapping, v);
    const torch::Tensor attn = paged_attention(q, k_caches[i], v_caches[i], block_tables, query_start_loc, seq_lens,
                                               shape_.attention_scale, sliding_window);
    const torch::Tensor o = layer.o(attn.view({t, q_size}));
    // MLP block: x += o, then its norm, in one pass.
    const torch::Tensor h2 = add_rms_norm_(o, x, layer.post_attention_norm, shape_.rms_norm_eps);
    const torch::Tensor gate_up = layer.gate_up(h2);
    const torch::Tensor act = at::mul(at::silu(gate_up.narrow(1, 0, shape_.intermediate_size)),
                                      gate_up.narrow(1, shape_.intermediate_size, shape_.intermediate_size));
    x.add_(layer.down(act));
  }
  const torch::Tensor last = x.index_select(0, logits_indices);
  return lm_head_(rms_norm(last, final_norm_, shape_.rms_norm_eps));
}

}  // namespace protoserve
