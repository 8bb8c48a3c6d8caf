"""Tiny random checkpoints of the families with per-layer attention (Gemma 3, Qwen2/3 sliding windows).

Each is saved with transformers' own classes and a byte-level tokenizer (so the
engine can serve it); ``WINDOW`` is much shorter than the test prompts, so
sliding and global layers see different contexts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

VOCAB = 320  # 256 byte tokens + <|endoftext|>; ids above have no text
EOS = 256
WINDOW = 8
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    eos_token_id=EOS,
    bos_token_id=None,
    pad_token_id=None,
)
FAMILIES = ("gemma3", "qwen2-swa", "qwen3-swa")


def hf_config(family: str):
    from transformers import Gemma3TextConfig, Qwen2Config, Qwen3Config

    if family == "gemma3":  # local/global every other layer, both rope kinds, a scalar != head_dim, soft-cap
        return Gemma3TextConfig(
            **TINY,
            num_hidden_layers=4,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if family == "qwen2-swa":  # layers 1 and 2 slide (max_window_layers=1), q/k/v biases
        return Qwen2Config(
            **TINY, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        )
    if family == "qwen3-swa":  # layer 2 slides, q/k norms
        return Qwen3Config(
            **TINY, num_hidden_layers=3, head_dim=16, use_sliding_window=True, sliding_window=WINDOW,
            max_window_layers=2,
        )
    raise ValueError(family)


def write_byte_tokenizer(directory: Path) -> None:
    """One token per byte plus an EOS special token (ids as in tests/engine's tiny checkpoint)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from protoserve.engine.tokenizer.tokenizer import byte_level_alphabet

    vocab = dict(sorted(byte_level_alphabet().items(), key=lambda kv: kv[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def make_checkpoint(family: str, directory: Path, seed: int = 0) -> nn.Module:
    """Save a tiny random model of ``family`` (with a tokenizer) to ``directory``; return it (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32).eval()
    # Weights large enough that logits are O(1); Gemma's norms hold w of x * (1 + w).
    norm_center = 0.0 if family == "gemma3" else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    write_byte_tokenizer(directory)
    return model


def hf_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, the whole sequence re-run each step (no cache to trust)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
