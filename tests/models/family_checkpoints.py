"""Tiny random checkpoints of the families with per-layer attention (Gemma 3, Qwen2/3 sliding windows).

Each is saved with transformers' own classes and a byte-level tokenizer (so the
engine can serve it) by bench/tiny_checkpoints.py, whose names the model tests take from here; ``WINDOW`` is much shorter than the test prompts, so
sliding and global layers see different contexts.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from bench.tiny_checkpoints import (  # noqa: F401 - the names the model tests import from here
    EOS,
    TINY,
    VOCAB,
    hf_greedy,
    random_model,
    save_checkpoint,
    write_byte_tokenizer,
)

WINDOW = 8
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


def make_checkpoint(family: str, directory: Path, seed: int = 0) -> nn.Module:
    """Save a tiny random model of ``family`` (with a tokenizer) to ``directory``; return it (float32, eval)."""
    # Gemma's norms hold w of x * (1 + w).
    return save_checkpoint(random_model(hf_config(family), seed, 0.0 if family == "gemma3" else 1.0), directory)
