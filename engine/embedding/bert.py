"""A BERT encoder in plain torch, read top to bottom, loaded from a safetensors file by name.

Only what an embedding model needs: absolute position embeddings, post-norm
layers (attention -> residual LayerNorm -> FFN -> residual LayerNorm), a key
padding mask, no pooler head (sentence embeddings pool the hidden states
themselves) and no dropout (inference only). The query/key/value projections
are fused into one matmul at load time: one GEMM instead of three per layer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from protoserve.engine.loader.errors import ModelLoadError

# config.json's hidden_act -> the function Hugging Face means by that name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def parse_bert_config(raw: dict[str, Any], path: Path) -> BertConfig:
    """config.json -> BertConfig; ModelLoadError naming the key for anything this encoder cannot run."""
    if raw.get("model_type", "bert") != "bert":
        raise ModelLoadError(path, f"model_type {raw.get('model_type')!r} is not 'bert'")
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ModelLoadError(
            path, f"position_embedding_type {position_type!r} is not supported (only 'absolute')"
        )
    hidden_act = raw.get("hidden_act", "gelu")
    if hidden_act not in ACTIVATIONS:
        raise ModelLoadError(
            path, f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(sorted(ACTIVATIONS))}"
        )
    try:
        config = BertConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_positions=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=hidden_act,
        )
    except KeyError as e:
        raise ModelLoadError(path, f"missing key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(path, f"malformed value: {e}") from e
    if config.hidden_size % config.num_heads:
        raise ModelLoadError(
            path,
            f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {config.num_heads}",
        )
    return config


def read_bert_config(path: Path) -> BertConfig:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(path, "missing: a BERT model directory needs this file") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"not readable JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return parse_bert_config(raw, path)


def _embedding(rows: int, dim: int) -> nn.Embedding:
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        # _weight skips the random init: on the meta device load_bert builds on, nn.Embedding's
        # normal_ runs torch's Python reference, which imports torch._dynamo (~1 s of a server's start).
        self.word = _embedding(c.vocab_size, c.hidden_size)
        self.position = _embedding(c.max_positions, c.hidden_size)
        self.token_type = _embedding(c.type_vocab_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        # Single-segment inputs: every token is type 0.
        x = self.word(input_ids) + self.position.weight[:seq_len] + self.token_type.weight[0]
        return self.norm(x)


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        self.head_dim = c.head_dim
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size)
        self.attn_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.ffn_in = nn.Linear(c.hidden_size, c.intermediate_size)
        self.ffn_out = nn.Linear(c.intermediate_size, c.hidden_size)
        self.ffn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, H]; key_mask [B, 1, 1, T], True where the key is a real token."""
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        attn = attn.transpose(1, 2).reshape(b, t, h)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.ffn_norm(x + self.ffn_out(self.act(self.ffn_in(x))))


class BertEncoder(nn.Module):
    """input_ids [B, T] + attention_mask [B, T] (1 = token, 0 = padding) -> last hidden states [B, T, H]."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        key_mask = attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


def _checkpoint_names(c: BertConfig) -> dict[str, str]:
    """Our parameter name -> the Hugging Face BertModel tensor name (without any ``bert.`` prefix).

    The fused ``qkv`` parameters are absent here: load_bert builds them from
    the three ``attention.self`` tensors.
    """
    names = {
        "embeddings.word.weight": "embeddings.word_embeddings.weight",
        "embeddings.position.weight": "embeddings.position_embeddings.weight",
        "embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
        "embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "embeddings.norm.bias": "embeddings.LayerNorm.bias",
    }
    for i in range(c.num_layers):
        hf = f"encoder.layer.{i}"
        for ours, theirs in (
            ("attn_out", "attention.output.dense"),
            ("attn_norm", "attention.output.LayerNorm"),
            ("ffn_in", "intermediate.dense"),
            ("ffn_out", "output.dense"),
            ("ffn_norm", "output.LayerNorm"),
        ):
            for kind in ("weight", "bias"):
                names[f"layers.{i}.{ours}.{kind}"] = f"{hf}.{theirs}.{kind}"
    return names


def _tensor_prefix(keys: set[str], path: Path) -> str:
    # BertModel checkpoints name tensors "embeddings...."; BertFor* heads save them under "bert.".
    for prefix in ("", "bert."):
        if f"{prefix}embeddings.word_embeddings.weight" in keys:
            return prefix
    raise ModelLoadError(path, "no 'embeddings.word_embeddings.weight' tensor: not a BERT checkpoint")


def load_bert(config_path: Path, weights_path: Path) -> BertEncoder:
    """Build the encoder from config.json and fill it from model.safetensors (shapes checked, nothing left unset)."""
    config = read_bert_config(config_path)
    with torch.device("meta"):
        model = BertEncoder(config)
    expected = {name: p.shape for name, p in model.named_parameters()}
    if not weights_path.is_file():
        raise ModelLoadError(weights_path, "missing: the encoder weights")
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            keys = set(f.keys())
            prefix = _tensor_prefix(keys, weights_path)

            def read(name: str) -> torch.Tensor:
                full = prefix + name
                if full not in keys:
                    raise ModelLoadError(weights_path, f"missing tensor {full!r}")
                return f.get_tensor(full).to(torch.float32)

            for ours, theirs in _checkpoint_names(config).items():
                state[ours] = read(theirs)
            for i in range(config.num_layers):
                self_attn = f"encoder.layer.{i}.attention.self"
                for kind in ("weight", "bias"):
                    parts = [read(f"{self_attn}.{proj}.{kind}") for proj in ("query", "key", "value")]
                    state[f"layers.{i}.qkv.{kind}"] = torch.cat(parts, dim=0)
    except ModelLoadError:
        raise
    except Exception as e:  # safetensors raises its own types for truncated/corrupt files
        raise ModelLoadError(weights_path, f"cannot read safetensors: {e}") from e
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ModelLoadError(
                weights_path,
                f"tensor for {name!r} has shape {tuple(state[name].shape)}, expected {tuple(shape)}",
            )
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)
