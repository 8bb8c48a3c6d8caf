"""PEFT LoRA adapters in SmolLM2-135M's shapes (the live server's default model), written without PEFT:
random, large enough to change greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# SmolLM2-135M: hidden 576, 9 query heads and 3 KV heads of 64, MLP 1536, 30 layers.
SHAPES = {"q_proj": (576, 576), "k_proj": (192, 576), "v_proj": (192, 576), "o_proj": (576, 576),
          "gate_proj": (1536, 576), "up_proj": (1536, 576), "down_proj": (576, 1536)}
LAYERS = 30


def write_adapter(path: Path, seed: int, r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
                  **config) -> Path:
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(LAYERS):
        for p in targets:
            out_f, in_f = SHAPES[p]
            parent = "mlp" if p in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{i}.{parent}.{p}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(r, in_f, generator=g) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_f, r, generator=g) * 0.1
    save_file(tensors, path / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "bias": "none"}
    cfg.update(config)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path
