"""ModelConfig: the architecture hyper-parameters every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Families the decoder implements; the loaders map checkpoint names onto these.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, independent of file format.

    Weights use Hugging Face parameter names (``model.layers.0.self_attn.q_proj.weight``)
    whatever the source, so one decoder serves safetensors and GGUF checkpoints.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # Hugging Face `rope_scaling` dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # Mistral: attend to at most this many previous tokens
    attention_bias: bool = False  # Qwen2: q/k/v projections have biases
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
