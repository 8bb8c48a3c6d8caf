"""Open a GGUF checkpoint: its ModelConfig and its weights under Hugging Face names.

llama.cpp's converter renames every tensor (``blk.0.attn_q.weight``) and, for
llama-family models, permutes the rows of the Q and K projections so its rope
kernel can rotate adjacent pairs. Loading undoes both, so the decoder sees the
same state dict a safetensors checkpoint of the model would give it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.gguf_reader import ReaderTensor

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.gguf_dequant import dequantize
from protoserve.engine.loader.progress import tensor_progress
from protoserve.engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

# Architectures whose attn_q/attn_k rows llama.cpp's converter permutes.
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

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
_TOKEN_TYPE_CONTROL = 3

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Read into the config, not a parameter: llama 3.x stores its rope scaling as per-frequency factors.
_ROPE_FREQS = "rope_freqs.weight"


class FastGGUFReader(GGUFReader):
    """GGUFReader that parses metadata from a plain ndarray view of the memory map.

    The stock reader slices its ``np.memmap`` several times per string, and
    every memmap slice runs Python-level ``__array_finalize__``; for a 49k-token
    vocabulary plus merges that is seconds of overhead. A plain ndarray over the
    same mapping yields the same bytes without it (about 3x faster to open).
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """Memory-map and parse a GGUF file; any unreadable file becomes ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "no such file" if not path.exists() else "not a regular file")
    try:
        reader = FastGGUFReader(path)
    except Exception as exc:  # the reader reports corruption with assorted ValueError/KeyError/IndexError
        raise ModelLoadError(path, f"not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data.nbytes != tensor.n_bytes or tensor.data_offset + tensor.n_bytes > size:
            raise ModelLoadError(path, f"truncated: tensor {tensor.name!r} extends past the end of the file")
    return reader


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


class GGUFCheckpoint:
    """An opened GGUF checkpoint: the ModelConfig it describes and its weights under HF names.

    Opening parses metadata and validates names and shapes of every tensor;
    weights are dequantized only when iterated. The reader stays available
    (``.reader``) so the tokenizer can be built without parsing the file again.
    """

    def __init__(self, path: str | os.PathLike[str], reader: GGUFReader | None = None) -> None:
        self.path = Path(path)
        self.reader = reader if reader is not None else open_gguf(self.path)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.config = _config_from_gguf(self.path, self.reader, self._tensors)
        self._plan = _tensor_plan(self.path, self.config, self._tensors)

    @property
    def parameter_names(self) -> list[str]:
        """Hugging Face names of the weights, in file order."""
        return [hf_name for hf_name, _ in self._plan]

    def iter_weights(
        self, *, dtype: torch.dtype = torch.float32, progress: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` one dequantized tensor at a time (peak memory: one tensor)."""
        for hf_name, tensor in tensor_progress(self._plan, desc=f"Loading {self.path.name}", enabled=progress):
            shape = _torch_shape(tensor)
            weight = dequantize(
                tensor.data, tensor.tensor_type, shape, tensor_name=tensor.name, source=self.path
            )
            if self.config.architecture in _PERMUTED_ARCHITECTURES:
                if hf_name.startswith("model.layers.") and ".self_attn.q_proj." in hf_name:
                    weight = unpermute_qk(weight, self.config.num_heads)
                elif hf_name.startswith("model.layers.") and ".self_attn.k_proj." in hf_name:
                    weight = unpermute_qk(weight, self.config.num_kv_heads)
            yield hf_name, weight.to(dtype)

    def load_weights(
        self, *, dtype: torch.dtype = torch.float32, progress: bool = True
    ) -> dict[str, torch.Tensor]:
        """All weights as a state dict with Hugging Face parameter names."""
        return dict(self.iter_weights(dtype=dtype, progress=progress))


def load_gguf_checkpoint(
    path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32, progress: bool = True
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file into ``(config, state_dict)``; every failure is ModelLoadError."""
    checkpoint = GGUFCheckpoint(path)
    return checkpoint.config, checkpoint.load_weights(dtype=dtype, progress=progress)


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K row permutation for ``n_heads`` heads.

    The converter regroups each head's rows from HF's rotate-half layout
    (first half, second half) into interleaved pairs; this puts them back.
    Works for weights ``(rows, cols)`` and biases ``(rows,)``.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _torch_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first (ne0 = row length); torch wants slowest-first.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    return None


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter the decoder needs for ``config``, with its HF shape."""
    h, d = config.hidden_size, config.head_dim
    q_rows, kv_rows = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_rows, h),
            p + "self_attn.k_proj.weight": (kv_rows, h),
            p + "self_attn.v_proj.weight": (kv_rows, h),
            p + "self_attn.o_proj.weight": (h, q_rows),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_rows,),
                p + "self_attn.k_proj.bias": (kv_rows,),
                p + "self_attn.v_proj.bias": (kv_rows,),
            }
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _tensor_plan(
    path: Path, config: ModelConfig, tensors: dict[str, ReaderTensor]
) -> list[tuple[str, ReaderTensor]]:
    """Pair each GGUF tensor with its HF name, checking names and shapes against the config."""
    expected = _expected_shapes(config)
    plan: list[tuple[str, ReaderTensor]] = []
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name = _hf_name(name)
        if hf_name is None or hf_name not in expected:
            raise ModelLoadError(path, f"unexpected tensor {name!r} for a {config.architecture} model")
        shape = _torch_shape(tensor)
        if shape != expected[hf_name]:
            raise ModelLoadError(
                path, f"tensor {name!r} has shape {shape}, expected {expected[hf_name]} for {hf_name}"
            )
        plan.append((hf_name, tensor))
    missing = sorted(set(expected) - {hf_name for hf_name, _ in plan})
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(path, f"missing tensors: {', '.join(missing[:5])}{more}")
    return plan


def _config_from_gguf(path: Path, reader: GGUFReader, tensors: dict[str, ReaderTensor]) -> ModelConfig:
    arch = metadata_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            path, f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        return metadata_value(reader, f"{arch}.{key}", default)

    def require(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelLoadError(path, f"missing metadata key {arch}.{key}")
        return value

    hidden = int(require("embedding_length"))
    num_heads = int(require("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    rope_theta = float(get("rope.freq_base", 10000.0))
    context_length = int(require("context_length"))
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(path, "missing tensor 'token_embd.weight'")
    vocab_size = int(get("vocab_size", _torch_shape(embed)[0]))
    sliding_window = get("attention.sliding_window")
    bos = metadata_value(reader, "tokenizer.ggml.bos_token_id")

    return ModelConfig(
        architecture=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(require("feed_forward_length")),
        num_layers=int(require("block_count")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(path, reader, arch, tensors.get(_ROPE_FREQS), rope_theta, head_dim),
        max_position_embeddings=context_length,
        sliding_window=int(sliding_window) if sliding_window else None,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eog_token_ids(reader),
    )


def _rope_scaling(
    path: Path,
    reader: GGUFReader,
    arch: str,
    rope_freqs: ReaderTensor | None,
    rope_theta: float,
    head_dim: int,
) -> dict[str, Any] | None:
    """The Hugging Face ``rope_scaling`` dict the file's rope metadata describes."""
    if rope_freqs is not None:
        factors = dequantize(rope_freqs.data, rope_freqs.tensor_type, _torch_shape(rope_freqs), source=path)
        return _llama3_scaling(path, factors.numpy(), rope_theta, head_dim)

    kind = metadata_value(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(metadata_value(reader, f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": factor}
        original = metadata_value(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = metadata_value(reader, f"{arch}.rope.scaling.{gguf_key}")
            if value is not None:
                scaling[hf_key] = float(value)
        return scaling
    raise ModelLoadError(path, f"unsupported rope scaling type {kind!r}")


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


def _llama3_scaling(
    path: Path, factors: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any] | None:
    """Recover the HF llama3 ``rope_scaling`` dict from stored ``rope_freqs`` factors.

    The file keeps only the resulting factors; the parameters are found by
    matching them against the converter's formula, and a file whose factors
    match no known setting is rejected rather than run with wrong positions.
    """
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(
            path, f"rope_freqs.weight has shape {tuple(factors.shape)}, expected ({head_dim // 2},)"
        )
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
