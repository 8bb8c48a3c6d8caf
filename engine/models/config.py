"""ModelConfig: the architecture hyper-parameters every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# Per-layer attention kinds, in Hugging Face's ``layer_types`` spelling.
SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# How a layer's MLP computes: SwiGLU (silu gate), GeGLU (tanh-approximated gelu gate), or "gelu":
# no gate, ``down(gelu_tanh(up(x)))`` (StarCoder2's c_fc/c_proj).
MlpKind = Literal["swiglu", "geglu", "gelu"]
# Where a layer's norms sit: "pre" (Llama: before attention and before the MLP), "sandwich"
# (Gemma: before and after each of them, four per layer) or "parallel" (Command-R: one norm whose
# output feeds attention and the MLP side by side, ``x + attn(h) + mlp(h)``).
NormPlacement = Literal["pre", "sandwich", "parallel"]
# Which norm every norm of the model is: RMSNorm, or LayerNorm (mean removed; StarCoder2, Command-R).
NormKind = Literal["rms", "layer"]
# How an MoE layer picks a token's experts: a softmax top-k over a router (Mixtral, Qwen-MoE),
# integer arithmetic on the token id (the token-routed family), or DeepSeek's group-limited top-k
# (engine/models/moe.py): over softmax scores ranked by group maximum (V2's "group_limited_greedy"), or
# over sigmoid scores plus a learned bias ranked by each group's two best (V3's "noaux_tc").
MoeRouting = Literal["softmax_top_k", "token", "group_limited_greedy", "noaux_tc"]


@dataclass(frozen=True)
class KVLayout:
    """What the paged pool keeps per token and layer: ``num_heads`` vectors of ``head_dim`` as K, and
    as many again as V unless ``shared`` (multi-head latent attention: the compressed latent and the
    rope key are one vector, read as key and value alike)."""

    num_heads: int
    head_dim: int
    shared: bool = False


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, independent of file format.

    Weights use Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)
    whatever the source, so one decoder serves safetensors and GGUF checkpoints.
    ``architecture`` names the family (engine/models/families), which sets the switches below.
    """

    architecture: str  # a family name of engine/models/families
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6  # every norm's epsilon, a LayerNorm's too
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Hugging Face `rope_scaling` dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096
    # The window (in tokens, the current one included) of sliding layers: with ``layer_types``
    # None every layer slides (Mistral); otherwise only the layers typed SLIDING do.
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer, SLIDING or FULL (Qwen2/3 max_window_layers, Gemma 3)
    rope_local_theta: float | None = None  # rope base of sliding layers, without scaling (Gemma 3); None: rope_theta
    norm: NormKind = "rms"
    norm_bias: bool = False  # LayerNorms with a bias (StarCoder2)
    attention_bias: bool = False  # Qwen2: q/k/v projections have biases
    o_proj_bias: bool = False  # Llama, Qwen3: attention_bias covers o_proj too
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on q and k per head
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (Gemma); None: head_dim
    # Rotate adjacent pairs (2i, 2i+1) of each head instead of halves (i, i + d/2): Command-R.
    rope_interleaved: bool = False
    attn_logit_softcapping: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    mlp: MlpKind = "swiglu"
    mlp_bias: bool = False  # the MLP's projections have biases (StarCoder2)
    norm_placement: NormPlacement = "pre"
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the activation dtype
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    logit_scale: float | None = None  # Command-R: logits times this
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Mixture of experts (engine/models/moe.py): num_experts > 0 makes the layers ``moe_layers``
    # names (all when None) MoE blocks of experts of ``moe_intermediate_size``; the rest stay dense.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    moe_routing: MoeRouting = "softmax_top_k"
    moe_normalize_top_k: bool = True  # renormalise the top-k weights (Mixtral; Qwen's norm_topk_prob)
    moe_token_shift: int = 0  # token routing: expert = (token_id >> shift) & (num_experts - 1)
    moe_shared_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0: none)
    moe_shared_expert_gate: bool = False  # its sigmoid gate
    moe_layers: list[bool] | None = None
    # DeepSeek's routing (moe_routing "group_limited_greedy" / "noaux_tc"): experts in ``moe_num_groups``
    # groups, a token's top-k taken within its ``moe_topk_groups`` best groups; weights times the scale.
    moe_num_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek-V2/V3, engine/models/latent_attention.py): kv_lora_rank > 0
    # compresses K/V into one latent of that rank per token; ``head_dim`` is then the decoupled rope
    # key's (qk_rope_head_dim), ``qk_nope_head_dim`` each query/key head's rope-free part and
    # ``v_head_dim`` each value head; q_lora_rank > 0 puts the queries through a low rank too.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    attention_mscale: float = 1.0  # multiplies the softmax scale (DeepSeek's yarn mscale_all_dim, squared)
    # kv_b_proj stored per head as k_b [H, rank, qk_nope] and v_b [H, v_head_dim, rank] (llama.cpp's GGUF form).
    mla_kv_b_split: bool = False
    # DeepSeek-V3's multi-token-prediction modules (num_nextn_predict_layers), stored as the layers after the
    # last: they only draft for speculative decoding, which they do not here, so their tensors are skipped
    # at load, as vLLM skips them unless MTP speculation is asked for.
    num_mtp_layers: int = 0

    def is_moe_layer(self, index: int) -> bool:
        if self.num_experts == 0:
            return False
        return self.moe_layers is None or self.moe_layers[index]

    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: attends to the whole context)."""
        if self.sliding_window is None:
            return [None] * self.num_layers
        if self.layer_types is None:
            return [self.sliding_window] * self.num_layers
        return [self.sliding_window if t == SLIDING else None for t in self.layer_types]

    def layer_pattern(self) -> list[str]:
        """Each layer as "sliding" or "global", what GetModel reports."""
        return ["global" if w is None else "sliding" for w in self.layer_windows()]

    @property
    def attention_scale(self) -> float:
        if self.kv_lora_rank:  # MLA: over the whole query/key head, rope-free part and rope part
            return (self.qk_nope_head_dim + self.head_dim) ** -0.5 * self.attention_mscale
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    @property
    def kv_layout(self) -> KVLayout:
        """What the KV pool holds per token and layer (MLA: the latent and the rope key, once)."""
        if self.kv_lora_rank:
            return KVLayout(1, self.kv_lora_rank + self.head_dim, shared=True)
        return KVLayout(self.num_kv_heads, self.head_dim)
