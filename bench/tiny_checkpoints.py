"""Tiny random checkpoints written with transformers' own classes, and transformers' answers on them.

Shared by the model tests (tests/models) and the families bench section: ``random_model`` builds a
transformers model from a config with weights large enough that logits are O(1), so a comparison is
not between near-zeros; ``save_checkpoint`` writes it with a byte-level tokenizer the engine can
serve; ``hf_greedy`` and ``hf_logits`` are the reference it is held to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

VOCAB = 320  # 256 byte tokens + <|endoftext|>; ids above have no text
EOS = 256
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


def random_model(config: Any, seed: int = 0, norm_center: float = 1.0) -> nn.Module:
    """transformers' model of ``config`` (float32, eval): weights N(0, 0.3), norm weights
    ``norm_center`` + N(0, 0.1) (0 for Gemma's norms, which hold w of x * (1 + w))."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model


def save_checkpoint(model: nn.Module, directory: Path) -> nn.Module:
    """Write ``model`` as safetensors with a byte-level tokenizer to ``directory``; returns it."""
    model.save_pretrained(directory, safe_serialization=True)
    write_byte_tokenizer(directory)
    return model


def write_byte_tokenizer(directory: Path) -> None:
    """One token per byte plus an EOS special token (ids as in tests/engine's tiny checkpoint)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from protoserve.engine.runtime import byte_level_alphabet

    vocab = dict(sorted(byte_level_alphabet().items(), key=lambda kv: kv[1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


def random_prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    """One prompt of byte tokens per length (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS, (n,), generator=g).tolist() for n in lengths]


def hf_logits(model: nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' logits at every position of ``prompt`` [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def hf_greedy(model: nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, the whole sequence re-run each step (no cache to trust)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]
