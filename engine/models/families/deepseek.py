"""DeepSeek-V2/V3: multi-head latent attention (engine/models/latent_attention.py: the compressed KV
latent and the decoupled rope key cached in place of K/V) and mixture-of-experts layers with shared
experts and group-limited routing (V2's softmax ``greedy``/``group_limited_greedy``, V3's sigmoid
``noaux_tc`` with ``e_score_correction_bias``), dense MLPs on the first ``first_k_dense_replace``
layers. Rope turns adjacent pairs (V2 always, V3 unless ``rope_interleave`` is false); with yarn's
``mscale_all_dim`` the softmax scale is multiplied by its mscale squared, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families import moe_family
from protoserve.engine.models.families.family import Family
from protoserve.engine.models.latent_attention import latent_attention_shapes
from protoserve.engine.models.moe import DEEPSEEK_EXPERT_NAMES
from protoserve.engine.models.rope import yarn_mscale

if TYPE_CHECKING:  # the loader builds these and hands them over; families never import the loader
    from protoserve.engine.loader.gguf_fields import GGUFFields
    from protoserve.engine.loader.hf_fields import HFFields

NAMES = moe_family.MoeNames("mlp.", DEEPSEEK_EXPERT_NAMES)
_GQA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# topk_method -> (moe_routing, scoring_func it goes with), per model type.
_ROUTINGS = {
    "deepseek_v2": {"greedy": ("group_limited_greedy", "softmax"),
                    "group_limited_greedy": ("group_limited_greedy", "softmax")},
    "deepseek_v3": {"noaux_tc": ("noaux_tc", "sigmoid")},
}
_DEFAULT_TOPK_METHOD = {"deepseek_v2": "greedy", "deepseek_v3": "noaux_tc"}
# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType) -> moe_routing.
_GGUF_GATING = {1: "group_limited_greedy", 2: "noaux_tc"}


def moe_layers(num_layers: int, first_dense: int, freq: int) -> list[bool]:
    """DeepSeek's rule: layer i is MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0."""
    return [i >= first_dense and i % freq == 0 for i in range(num_layers)]


def attention_mscale(scaling: dict | None) -> float:
    """The softmax scale's factor: yarn's mscale(factor, mscale_all_dim) squared where the rope is scaled
    and mscale_all_dim set (transformers' ``yarn_apply_mscale``), else 1."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
    return m * m


def _routing(hf: HFFields, model_type: str) -> tuple[str, int, int]:
    """(moe_routing, groups, groups kept) of the config's topk_method and scoring_func; refused by name
    when they are not DeepSeek's pairing for the model type."""
    method = hf.get("topk_method", _DEFAULT_TOPK_METHOD[model_type])
    known = _ROUTINGS[model_type]
    if method not in known:
        raise hf.error(f"unsupported topk_method {method!r} for {model_type} (supported: {', '.join(known)})")
    routing, scoring = known[method]
    if hf.get("scoring_func", scoring) != scoring:
        raise hf.error(f"unsupported scoring_func {hf.get('scoring_func')!r} with topk_method {method!r} "
                       f"(supported: {scoring})")
    if method == "greedy":  # one group holding every expert
        return routing, 1, 1
    return routing, int(hf.get("n_group", 1)), int(hf.get("topk_group", 1))


def _refuse_unsupported(hf: HFFields, model_type: str) -> None:
    if hf.get("attention_bias", False):
        raise hf.error("unsupported attention_bias=true")
    # DeepSeek-V2's own code renormalises *instead of* scaling; transformers scales without renormalising.
    # No V2 checkpoint sets it, so the ambiguity is refused rather than guessed.
    if model_type == "deepseek_v2" and hf.get("norm_topk_prob", False):
        raise hf.error("unsupported norm_topk_prob=true for deepseek_v2")


def from_hf(hf: HFFields) -> ModelConfig:
    model_type = str(hf.need("model_type"))
    hf.require_activation("silu")
    _refuse_unsupported(hf, model_type)
    common = hf.common()
    routing, groups, kept = _routing(hf, model_type)
    num_layers = common["num_layers"]
    shared = int(hf.get("n_shared_experts", 0))
    config = ModelConfig(
        architecture="deepseek",
        **{**common, "head_dim": int(hf.need("qk_rope_head_dim")), "num_kv_heads": common["num_heads"]},
        rope_interleaved=model_type == "deepseek_v2" or bool(hf.get("rope_interleave", True)),
        num_experts=int(hf.need("n_routed_experts")),
        experts_per_token=int(hf.need("num_experts_per_tok")),
        moe_intermediate_size=int(hf.need("moe_intermediate_size")),
        moe_routing=routing,
        moe_normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        moe_shared_intermediate_size=shared * int(hf.need("moe_intermediate_size")),
        moe_layers=moe_layers(num_layers, int(hf.get("first_k_dense_replace", 0)), int(hf.get("moe_layer_freq", 1))),
        moe_num_groups=groups,
        moe_topk_groups=kept,
        moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        kv_lora_rank=int(hf.need("kv_lora_rank")),
        q_lora_rank=int(hf.get("q_lora_rank", 0)),
        qk_nope_head_dim=int(hf.need("qk_nope_head_dim")),
        v_head_dim=int(hf.need("v_head_dim")),
        attention_mscale=attention_mscale(common["rope_scaling"]),
        num_mtp_layers=int(hf.get("num_nextn_predict_layers", 0)),
    )
    return _checked(config, hf.error)


def from_gguf(meta: GGUFFields) -> ModelConfig:
    """llama.cpp's deepseek2 as its converter writes it: MLA as multi-query attention over the latent
    (``key_length`` = kv_lora_rank + rope, ``key_length_mla`` = a head's nope + rope), kv_b_proj split per
    head into ``attn_k_b`` (transposed) and ``attn_v_b``, or whole as ``attn_kv_b`` in older files."""
    common = meta.common()
    rope = int(meta.require("rope.dimension_count"))
    rank = int(meta.require("attention.kv_lora_rank"))
    qk_head = int(meta.get("attention.key_length_mla", common["head_dim"]))
    gating = int(meta.get("expert_gating_func", 1))
    if gating not in _GGUF_GATING:
        raise meta.error(f"unsupported expert_gating_func {gating} (supported: {', '.join(map(str, _GGUF_GATING))})")
    num_experts = int(meta.require("expert_count"))
    scaling = common["rope_scaling"]  # yarn_log_multiplier read as mscale = mscale_all_dim (rope_config)
    expert_size = int(meta.require("expert_feed_forward_length"))
    config = ModelConfig(
        architecture="deepseek",
        **{**common, "head_dim": rope, "num_kv_heads": common["num_heads"], "rope_scaling": scaling,
           "qk_norm": False},
        rope_interleaved=True,  # llama.cpp's deepseek2 turns adjacent pairs, on unpermuted weights
        num_experts=num_experts,
        experts_per_token=int(meta.require("expert_used_count")),
        moe_intermediate_size=expert_size,
        moe_routing=_GGUF_GATING[gating],
        moe_normalize_top_k=bool(meta.get("expert_weights_norm", False)),
        moe_shared_intermediate_size=int(meta.get("expert_shared_count", 0)) * expert_size,
        moe_layers=moe_layers(common["num_layers"], int(meta.get("leading_dense_block_count", 0)), 1),
        moe_num_groups=int(meta.get("expert_group_count", 1)),
        moe_topk_groups=int(meta.get("expert_group_used_count", 1)),
        moe_routed_scaling_factor=float(meta.get("expert_weights_scale", 1.0)),
        kv_lora_rank=rank,
        q_lora_rank=int(meta.get("attention.q_lora_rank", 0)),
        qk_nope_head_dim=qk_head - rope,
        v_head_dim=int(meta.get("attention.value_length_mla", common["head_dim"])),
        attention_mscale=attention_mscale(scaling),
        mla_kv_b_split=meta.has_tensor("blk.0.attn_k_b.weight"),
    )
    return _checked(config, meta.error)


def _checked(config: ModelConfig, error: Callable[[str], Exception]) -> ModelConfig:
    """The config, once its MoE block is one MoEConfig accepts (group sizes, top-k); else ``error``."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "head_dim"):
        if getattr(config, name) < 1:
            raise error(f"{name} must be a positive integer, got {getattr(config, name)}")
    if config.head_dim % 2:
        raise error(f"qk_rope_head_dim must be even, got {config.head_dim}")
    try:
        moe_family.block_config(config)  # MoEConfig checks itself
    except ValueError as e:
        raise error(str(e)) from None
    return config


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor: the MoE model's, each layer's GQA attention replaced by its MLA tensors."""
    shapes = moe_family.hf_shapes(config, NAMES)
    for i in range(config.num_layers):
        p = f"model.layers.{i}.self_attn."
        for name in _GQA_ATTENTION:
            del shapes[f"{p}{name}.weight"]
        shapes.update(latent_attention_shapes(config, p))
    return shapes


def active_parameters(config: ModelConfig) -> int:
    """Parameters a token passes through: all but the routed experts it is not sent to."""
    total = sum(math.prod(s) for s in hf_shapes(config).values())
    all_experts, active = moe_family.block_config(config).parameter_counts()
    return total - (all_experts - active) * sum(config.is_moe_layer(i) for i in range(config.num_layers))


FAMILY = Family(
    name="deepseek",
    hf_model_types=("deepseek_v2", "deepseek_v3"),
    gguf_architectures=("deepseek2",),
    config_from_hf=from_hf,
    config_from_gguf=from_gguf,
    gguf_layer_names={
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.k_b_proj",
        "attn_v_b": "self_attn.v_b_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate",
        "exp_probs_b": "mlp.gate.e_score_correction_{kind}",  # transformers' e_score_correction_bias
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
    gguf_expert_names={"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                       "ffn_down_exps": "mlp.experts.{e}.down_proj"},
    hf_shapes=hf_shapes,
    active_parameters=active_parameters,
    moe_names=NAMES,
    fused_step_unsupported=lambda config: "multi-head latent attention and mixture-of-experts layers",
    summary="DeepSeek-V2/V3: multi-head latent attention (compressed KV cache), group-routed MoE with shared experts",
)
