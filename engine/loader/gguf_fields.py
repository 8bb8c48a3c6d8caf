"""Reading GGUF metadata: the ``<arch>.*`` keys every family maps the same way.

``GGUFFields`` holds the reader, the file's architecture name and its tensors;
``common()`` returns the ModelConfig keyword arguments all families read alike,
and each family adds its own switches (often from which tensors are present).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.models.rope import RopeConfigError
from protoserve.engine.models.rope_config import rope_scaling_from_gguf

if TYPE_CHECKING:
    from gguf import GGUFReader
    from gguf.gguf_reader import ReaderTensor

# Read into the config, not parameters: llama 3.x stores its rope scaling as per-frequency factors,
# Phi-3's longrope its two factor sets.
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
ROPE_TENSORS = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)
# Architectures whose llama.cpp graph scales the softmax by yarn's mscale (reads yarn_log_multiplier).
SOFTMAX_MSCALE_ARCHITECTURES = ("deepseek2",)
_TOKEN_TYPE_CONTROL = 3
# Token texts llama.cpp also treats as end-of-generation when they are control tokens.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
    }
)


def metadata_value(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """The Python value of one metadata key (str, int, float, bool or list), or ``default``."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def eog_token_ids(reader: GGUFReader) -> list[int]:
    """Ids that end generation: eos first, then eot/eom and control tokens llama.cpp treats as such.

    Chat models often end a turn with a token other than the file's eos
    (``<|im_end|>`` vs ``<|endoftext|>``); stopping on either is what llama.cpp does.
    """
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = metadata_value(reader, key)
        if value is not None and value not in ids:
            ids.append(int(value))
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    types = metadata_value(reader, "tokenizer.ggml.token_type")
    if tokens_field is not None and types is not None:
        for token_id, token_type in enumerate(types):
            if token_type == _TOKEN_TYPE_CONTROL and token_id not in ids:
                if tokens_field.contents(token_id) in _EOG_TEXTS:
                    ids.append(token_id)
    return ids


def torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ne0 = row length); torch wants slowest-first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


@dataclass(frozen=True)
class GGUFFields:
    """One GGUF file's metadata under its architecture prefix, and its tensors by name."""

    reader: GGUFReader
    arch: str
    tensors: dict[str, ReaderTensor]
    path: Path

    def error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, problem)

    def get(self, key: str, default: Any = None) -> Any:
        return metadata_value(self.reader, f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise self.error(f"missing metadata key {self.arch}.{key}")
        return value

    def has_tensor(self, name: str) -> bool:
        return name in self.tensors

    def common(self) -> dict[str, Any]:
        """ModelConfig keyword arguments every family reads the same way."""
        hidden = int(self.require("embedding_length"))
        num_heads = int(self.require("attention.head_count"))
        head_dim = int(self.get("attention.key_length", hidden // num_heads))
        rope_theta = float(self.get("rope.freq_base", 10000.0))
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise self.error("missing tensor 'token_embd.weight'")
        bos = metadata_value(self.reader, "tokenizer.ggml.bos_token_id")
        return dict(
            vocab_size=int(self.get("vocab_size", torch_shape(embed)[0])),
            hidden_size=hidden,
            intermediate_size=int(self.require("feed_forward_length")),
            num_layers=int(self.require("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(self.get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=self.rope_scaling(rope_theta, head_dim),
            max_position_embeddings=int(self.require("context_length")),
            attention_bias=self.has_tensor("blk.0.attn_q.bias"),
            qk_norm=self.has_tensor("blk.0.attn_q_norm.weight"),
            tie_word_embeddings="output.weight" not in self.tensors,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eog_token_ids(self.reader),
        )

    def rope_scaling(self, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
        """The Hugging Face ``rope_scaling`` dict the file's rope describes: llama 3's matched from
        ``rope_freqs``, else engine/models/rope_config.py's reading of the ``rope.scaling.*`` keys,
        longrope's factor tensors and ``rope.dimension_count`` (partial rotary)."""
        rope_freqs = self.tensors.get(ROPE_FREQS)
        if rope_freqs is not None:
            return _llama3_scaling(self.path, self._tensor_values(rope_freqs), rope_theta, head_dim)
        prefix = f"{self.arch}.rope.scaling."
        metadata = {key: metadata_value(self.reader, key) for key in self.reader.fields if key.startswith(prefix)}
        try:
            return rope_scaling_from_gguf(
                metadata, self.arch, head_dim, rope_theta, int(self.require("context_length")),
                long_factors=self._factor_list(ROPE_FACTORS_LONG),
                short_factors=self._factor_list(ROPE_FACTORS_SHORT),
                rotary_dim=self._rotary_dim(),
                softmax_mscale=self.arch in SOFTMAX_MSCALE_ARCHITECTURES,
            )
        except RopeConfigError as e:
            raise self.error(f"rope: {e}") from None

    def _rotary_dim(self) -> int | None:
        """``rope.dimension_count``; None where it is not a part of the head: absent, or an MLA file,
        whose rope key is a head of its own beside the latent (DeepSeek's qk_rope_head_dim)."""
        if self.get("attention.kv_lora_rank") is not None:
            return None
        value = self.get("rope.dimension_count")
        return None if value is None else int(value)

    def _factor_list(self, name: str) -> list[float] | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else self._tensor_values(tensor).tolist()

    def _tensor_values(self, tensor: ReaderTensor) -> np.ndarray:
        from protoserve.engine.loader.gguf_dequant import dequantize

        return dequantize(tensor.data, tensor.tensor_type, torch_shape(tensor), source=self.path).numpy()


def llama3_rope_factors(
    rope_theta: float,
    head_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original: int,
) -> np.ndarray:
    """Per-frequency divisors for llama 3 rope scaling, as llama.cpp's converter writes ``rope_freqs``."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    wavelen = 2 * math.pi / freqs
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    ramp = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(
        wavelen < original / high_freq_factor,
        1.0,
        np.where(wavelen > original / low_freq_factor, factor, ramp),
    )
    return out.astype(np.float32)


# (low_freq_factor, high_freq_factor, original_max_position_embeddings) of released llama 3.x models.
_LLAMA3_CANDIDATES = ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 4.0, 16384), (1.0, 4.0, 32768))


def _llama3_scaling(path: Path, factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover the HF llama3 ``rope_scaling`` dict from stored ``rope_freqs`` factors.

    The file keeps only the resulting factors; the parameters are found by
    matching them against the converter's formula, and a file whose factors
    match no known setting is rejected rather than run with wrong positions.
    """
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(path, f"rope_freqs.weight has shape {tuple(factors.shape)}, expected ({head_dim // 2},)")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    for low, high, original in _LLAMA3_CANDIDATES:
        candidate = llama3_rope_factors(rope_theta, head_dim, factor, low, high, original)
        if np.allclose(candidate, factors, rtol=1e-4, atol=1e-5):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise ModelLoadError(path, "rope_freqs.weight does not match any known llama3 rope scaling")
