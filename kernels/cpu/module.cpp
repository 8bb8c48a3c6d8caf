// The Python bindings of every CPU kernel: one extension module, so the fused
// decoder step can call the kernels directly (kernels.h). Each call releases
// the GIL while it computes: the engine runs in a worker thread beside the
// server's event loop, which must keep serving during a forward.

#include "kernels.h"

// pybind11 with ATen's tensor casters, not <torch/extension.h>: that one parses the whole C++
// frontend (autograd, nn, optim) and took three times as long to compile.
#include <torch/csrc/utils/pybind.h>

namespace py = pybind11;
using protoserve::DecoderShape;
using protoserve::DecoderStep;
using protoserve::LayerWeights;
using protoserve::LinearWeights;
using protoserve::LoraLinear;
using protoserve::LoraWeights;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("packed_linear", &protoserve::packed_linear, "y = x @ W^T (+ bias) over a packed weight (float32 out)",
        py::arg("x"), py::arg("format"), py::arg("data"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
        py::arg("out_features"), py::arg("group_size"), py::arg("fine_activations") = true, no_gil);
  m.def("linear_multiplies_in_bf16", &protoserve::linear_multiplies_in_bf16,
        "whether bfloat16 packs multiply in bfloat16 here (x rounded to bf16 once per call)");
  m.def("int8_dot_amx_available", &protoserve::int8_dot_amx_available,
        "whether the integer-dot formats run their 16-row groups on AMX tiles here");
  m.def("argmax_rows", &protoserve::argmax_rows, "each row's first maximum, as NumPy's argmax (int64)", no_gil);
  m.def("rms_norm", &protoserve::rms_norm, "RMSNorm over the last dim (float32)", no_gil);
  m.def("add_rms_norm_", &protoserve::add_rms_norm_, "residual += x; return RMSNorm(residual)", no_gil);
  m.def("rope_", &protoserve::rope_, "rotate-half RoPE in place", no_gil);
  m.def("attention_multiplies_in_bf16", &protoserve::attention_multiplies_in_bf16,
        "whether bfloat16 K/V pools (head_dim % 32 == 0) multiply in bfloat16 (query and probabilities rounded)");
  m.def("attention_int8_in_int16", &protoserve::attention_int8_in_int16,
        "whether int8 K/V pools (head_dim 32, 64 or 128) multiply in int16 (query and block weights quantized)");
  m.def("paged_attention", &protoserve::paged_attention,
        "Causal batch-invariant attention of q [T, H, D] over a paged K/V cache (float32 out)", no_gil);
  m.def("attention_shared_tiles", &protoserve::attention_shared_tiles,
        "(shared tiles, queries in them) of the attention plan for these indices: decodes walking a "
        "partition of cache blocks their tables share together");
  m.def("write_kv_int8_", &protoserve::write_kv_int8_,
        "pool rows at slots = rows [T, KVH, D] float32 quantized to int8 codes and a float32 scale each",
        py::arg("pool"), py::arg("slots"), py::arg("rows"), no_gil);

  py::class_<LinearWeights>(m, "LinearWeights")
      .def(py::init([](int64_t format, at::Tensor data, c10::optional<at::Tensor> scales,
                       c10::optional<at::Tensor> mins, c10::optional<at::Tensor> bias, int64_t out_features,
                       int64_t group_size) {
             return LinearWeights{format, std::move(data), std::move(scales), std::move(mins), std::move(bias),
                                  out_features, group_size};
           }),
           py::arg("format"), py::arg("data"), py::arg("scales"), py::arg("mins"), py::arg("bias"),
           py::arg("out_features"), py::arg("group_size"));
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init([](at::Tensor input_norm, at::Tensor post_attention_norm,
                       c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, LinearWeights qkv,
                       LinearWeights o, LinearWeights gate_up, LinearWeights down,
                       c10::optional<at::Tensor> pre_feedforward_norm,
                       c10::optional<at::Tensor> post_feedforward_norm) {
             return LayerWeights{std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                                 std::move(k_norm), std::move(qkv), std::move(o), std::move(gate_up),
                                 std::move(down), std::move(pre_feedforward_norm), std::move(post_feedforward_norm)};
           }),
           py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("pre_feedforward_norm") = py::none(), py::arg("post_feedforward_norm") = py::none());
  py::class_<LoraLinear>(m, "LoraLinear")
      .def(py::init([](at::Tensor a, at::Tensor bt, std::vector<int64_t> slice_begin,
                       std::vector<int64_t> slice_end, int64_t rank) {
             return LoraLinear{std::move(a), std::move(bt), std::move(slice_begin), std::move(slice_end), rank};
           }),
           py::arg("a"), py::arg("bt"), py::arg("slice_begin"), py::arg("slice_end"), py::arg("rank"));
  py::class_<LoraWeights>(m, "LoraWeights")
      .def(py::init([](std::vector<c10::optional<LoraLinear>> linears) { return LoraWeights{std::move(linears)}; }),
           py::arg("linears"));
  m.def("lora_multiplies_in_bf16", &protoserve::lora_multiplies_in_bf16,
        "whether bfloat16 LoRA weights multiply in bf16 pairs here (AVX512-BF16)");
  m.def("lora_add_", &protoserve::lora_add_, "out[rows] += B (A x[rows]) in place (float32)", py::arg("out"),
        py::arg("x"), py::arg("w"), py::arg("rows"), no_gil);
  py::class_<DecoderShape>(m, "DecoderShape")
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size,
                       double rms_norm_eps, double attention_scale, bool gelu_tanh) {
             return DecoderShape{num_heads,    num_kv_heads,    head_dim, intermediate_size,
                                 rms_norm_eps, attention_scale, gelu_tanh};
           }),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate_size"),
           py::arg("rms_norm_eps"), py::arg("attention_scale"), py::arg("gelu_tanh") = false);
  py::class_<DecoderStep>(m, "DecoderStep")
      .def(py::init<DecoderShape, std::vector<LayerWeights>, at::Tensor, LinearWeights>(), py::arg("shape"),
           py::arg("layers"), py::arg("final_norm"), py::arg("lm_head"))
      .def("forward", &DecoderStep::forward, "logits of one flattened batch (float32)", py::arg("x"), py::arg("cos"),
           py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("logits_indices"),
           py::arg("sliding_window"), py::arg("lora") = std::vector<LoraWeights>(), py::arg("lora_rows") = py::none(),
           py::arg("lora_starts") = py::none(), py::arg("layer_windows") = std::vector<int64_t>(),
           py::arg("local_cos") = py::none(), py::arg("local_sin") = py::none(),
           py::arg("layer_rope") = std::vector<int64_t>(), py::arg("fine_activations") = true, no_gil);
  m.def("set_step_phase_timing", &protoserve::set_step_phase_timing,
        "time the fused step's phases from now on (True) or stop (False)", py::arg("enabled"));
  m.def(
      "take_step_phase_totals",
      [] {
        const std::vector<double> totals = protoserve::take_step_phase_totals();
        py::dict out;
        for (int k = 0; k < protoserve::STEP_PHASES; ++k) out[protoserve::STEP_PHASE_NAMES[k]] = totals[k];
        out["steps"] = static_cast<int64_t>(totals[protoserve::STEP_PHASES]);
        out["tokens"] = static_cast<int64_t>(totals[protoserve::STEP_PHASES + 1]);
        return out;
      },
      "seconds per phase of the fused steps timed since the last call, with their steps and tokens; resets them");
  m.def("moe_experts", &protoserve::moe_experts,
        "a MoE block's routed experts, grouped by expert over packed weights (float32 [T, H])", py::arg("x"),
        py::arg("expert_ids"), py::arg("weights"), py::arg("gate_up"), py::arg("down"), no_gil);
}
