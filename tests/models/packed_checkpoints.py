"""Tiny GPTQ and AWQ checkpoints packed here from known float weights, as the published packers do.

``make_packed_checkpoint(directory, variant)`` saves a tiny random Llama (family_checkpoints' sizes,
byte tokenizer) whose decoder linears are stored packed, and returns the transformers model holding
the reference weights: each float weight rounded onto the grid the packer chose (``(q - zero) *
scale`` with float16 scales), which is exactly what the packed tensors stand for.

The grids are chosen as each quantizer does (AutoGPTQ's ``Quantizer.find_params`` per group, without
GPTQ's error feedback, which changes the values, not the layout; AutoAWQ's ``pseudo_quantize_tensor``
with zero points), and the tensors are packed following AutoGPTQ's ``QuantLinear.pack`` (numpy uint32
words, zero points minus one in the v1 format) and AutoAWQ's ``WQLinear_GEMM.from_linear`` (output
columns interleaved 0, 2, 4, 6, 1, 3, 5, 7) line for line, so an unpacking mistake cannot cancel out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from family_checkpoints import TINY, write_byte_tokenizer
from safetensors.torch import save_file
from torch import nn

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Variant:
    """One checkpoint layout: the format and its ``quantization_config``."""

    method: str  # "gptq" or "awq"
    group_size: int = 32
    bits: int = 4
    act_order: bool = False  # GPTQ desc_act: g_idx permuted
    sym: bool = False
    checkpoint_format: str = "gptq"  # GPTQ: "gptq" (v1, zeros minus one) or "gptq_v2"

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "desc_act": self.act_order,
                "sym": self.sym, "checkpoint_format": self.checkpoint_format, "damp_percent": 0.01,
                "true_sequential": True, "static_groups": False}


VARIANTS = {
    "gptq": Variant("gptq"),
    "gptq-act-order": Variant("gptq", act_order=True),
    "gptq-v2-sym-64": Variant("gptq", group_size=64, sym=True, checkpoint_format="gptq_v2"),
    "gptq-8bit": Variant("gptq", bits=8),
    "awq": Variant("awq"),
}


def make_packed_checkpoint(directory: Path, variant: Variant, seed: int = 0) -> nn.Module:
    """Save the packed checkpoint to ``directory``; return the reference model (float32, eval)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    tensors = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    for i in range(config.num_hidden_layers):
        for linear in LINEARS:
            layer = f"model.layers.{i}.{linear}"
            weight = tensors.pop(layer + ".weight")
            rounded, packed = pack_layer(weight, variant, g)
            tensors.update({f"{layer}.{suffix}": t for suffix, t in packed.items()})
            model.get_submodule(layer).weight.data.copy_(rounded)
    save_file(tensors, str(directory / "model.safetensors"))
    raw = model.config.to_dict()
    raw["quantization_config"] = variant.quantization_config()
    (directory / "config.json").write_text(json.dumps(raw))
    write_byte_tokenizer(directory)
    return model


def pack_layer(weight: torch.Tensor, variant: Variant, g: torch.Generator) -> tuple[torch.Tensor, dict]:
    """(the weight rounded onto its grid, the packed tensors by suffix) for one [out, in] weight."""
    out, k = weight.shape
    size = variant.group_size
    if variant.act_order:  # GPTQ's act-order: groups of consecutive columns in a permuted order
        perm = torch.randperm(k, generator=g)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // size
    else:
        g_idx = torch.arange(k, dtype=torch.int32) // size
    groups = -(-k // size)
    quantize = _awq_grid if variant.method == "awq" else _gptq_grid
    scales = torch.empty(out, groups)
    zeros = torch.empty(out, groups)
    for group in range(groups):
        scales[:, group], zeros[:, group] = quantize(weight[:, g_idx == group], variant)
    scales = scales.half().float()  # stored float16: the codes are chosen against it
    maxq = 2**variant.bits - 1
    s, z = scales[:, g_idx.long()], zeros[:, g_idx.long()]
    codes = torch.clamp(torch.round(weight / s) + z, 0, maxq)
    rounded = (codes - z) * s
    if variant.method == "awq":
        return rounded, awq_pack(rounded, scales.t().contiguous(), zeros.t().contiguous(), size)
    return rounded, gptq_pack(rounded, scales.t().contiguous(), zeros.t().contiguous(), g_idx, variant)


def _gptq_grid(w: torch.Tensor, variant: Variant) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's Quantizer.find_params (per channel over one group's columns)."""
    maxq = 2**variant.bits - 1
    xmin = torch.minimum(w.amin(dim=1), torch.zeros(1))
    xmax = torch.maximum(w.amax(dim=1), torch.zeros(1))
    if variant.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if variant.sym else torch.round(-xmin / scale)
    return scale, zero


def _awq_grid(w: torch.Tensor, variant: Variant) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's pseudo_quantize_tensor with zero points."""
    maxq = 2**variant.bits - 1
    max_val, min_val = w.amax(dim=1), w.amin(dim=1)
    scale = (max_val - min_val).clamp(min=1e-5) / maxq
    zero = (-torch.round(min_val / scale)).clamp(0, maxq)
    return scale, zero


def gptq_pack(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
              variant: Variant) -> dict[str, torch.Tensor]:
    """AutoGPTQ's QuantLinear.pack: ``scales``/``zeros`` [groups, out]."""
    bits = variant.bits
    k = w.shape[1]
    scale_zeros = zeros * scales
    scales16 = scales.half()
    intweight = torch.cat(
        [torch.round((w[:, idx] + scale_zeros[g_idx[idx]]) / scales16[g_idx[idx]]).to(torch.int)[:, None]
         for idx in range(k)], dim=1)
    intweight = intweight.t().contiguous().numpy().astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 32 // bits):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    if variant.checkpoint_format == "gptq":
        assert bool((zeros >= 1).all()), "v1 stores zero - 1: a zero point of 0 would wrap (AutoGPTQ's bug)"
        zeros = zeros - 1
    zeros_np = zeros.to(torch.int64).numpy().astype(np.uint32)
    qzeros = np.zeros((zeros_np.shape[0], zeros_np.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 32 // bits):
            qzeros[:, col] |= zeros_np[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return {
        "qweight": torch.from_numpy(qweight.astype(np.int32)),
        "qzeros": torch.from_numpy(qzeros.astype(np.int32)),
        "scales": scales16,
        "g_idx": g_idx.clone(),
    }


def awq_pack(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ's WQLinear_GEMM.from_linear: ``scales``/``zeros`` [groups, out]."""
    scale_zeros = zeros * scales
    scales16 = scales.half()
    pack_num = 8
    k = w.shape[1]
    intweight = torch.cat(
        [torch.round((w[:, idx] + scale_zeros[idx // group_size]) / scales16[idx // group_size]).to(torch.int)[:, None]
         for idx in range(k)], dim=1)
    intweight = intweight.t().contiguous().to(torch.int32)
    qweight = torch.zeros((intweight.shape[0], intweight.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight[:, col] |= intweight[:, col * pack_num + AWQ_ORDER[i]] << (i * 4)
    zeros = zeros.to(torch.int32)
    qzeros = torch.zeros((zeros.shape[0], zeros.shape[1] // 32 * 4), dtype=torch.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzeros[:, col] |= zeros[:, col * pack_num + AWQ_ORDER[i]] << (i * 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales16}
