"""The decoder's forward as one C++ call (``kernels/cpu/decoder_step.cpp``).

Once every linear layer of a float32 ``Decoder`` sits on the CPU kernel, the
module-by-module forward is mostly Python: a dozen small calls per layer per
step. ``FusedStep`` hands the same weights to a C++ loop that
calls the same kernels in the same order, so its logits are bit-identical to
the module path and the step loses that overhead. The Decoder keeps its module
path for everything this cannot take (the ContiguousKVCache, a machine without
the kernels) and for the tests that compare the two.

A bfloat16 model runs here too, on its bf16 weights with float32 activations
between operations (the module path rounds them to bfloat16 after each one):
embeddings and norms widen exactly, and each linear layer either rounds its
input rows to bf16 and multiplies in bf16 (AVX512-BF16: vdpbf16ps, as a bf16
matmul does) or widens the weights in registers, which keeps it closer to the
float32 model than the module path's per-operation rounding (figures in
docs/performance.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.models.kv_cache import KVCache, PagedKVCache
from protoserve.engine.models.linear import KernelPackable
from protoserve.kernels.cpu import packed_linear
from protoserve.kernels.cpu.extension import load

if TYPE_CHECKING:
    from protoserve.engine.models.decoder import Decoder


def _linear_weights(ext, layer: torch.nn.Module):
    """The C++ view of one packed linear layer, or None when it is not on the kernel."""
    if not isinstance(layer, KernelPackable) or layer.packed is None:
        return None
    p = layer.packed
    bias = getattr(layer, "bias", None)
    return ext.LinearWeights(
        format=packed_linear.FORMATS[p.format],
        data=p.data,
        scales=p.scales,
        mins=p.mins,
        bias=None if bias is None else bias.detach().float().contiguous(),
        out_features=p.out_features,
        group_size=p.group_size,
    )


class FusedStep:
    """A Decoder's packed weights bound to the C++ layer loop."""

    def __init__(self, step) -> None:
        self._step = step

    def __deepcopy__(self, memo: dict) -> None:
        # A copied Decoder has new weight tensors this step does not see: the copy runs its module
        # path until its own pack_for_kernels binds a step to them.
        return None

    @classmethod
    def build(cls, model: Decoder) -> FusedStep | None:
        """The fused step for ``model``, or None where it cannot run it (then the module path serves)."""
        ext = load("decoder_step")
        if ext is None or model.dtype not in (torch.float32, torch.bfloat16):
            return None
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = [_linear_weights(ext, m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(w is None for w in linears):
                return None
            layers.append(
                ext.LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach().float().contiguous(),
                    post_attention_norm=layer.post_attention_layernorm.weight.detach().float().contiguous(),
                    q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach().float().contiguous(),
                    k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach().float().contiguous(),
                    qkv=linears[0],
                    o=linears[1],
                    gate_up=linears[2],
                    down=linears[3],
                )
            )
        head = _linear_weights(ext, model.lm_head)
        if head is None:
            return None
        cfg = model.config
        shape = ext.DecoderShape(
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            rms_norm_eps=cfg.rms_norm_eps,
            attention_scale=cfg.head_dim**-0.5,  # Attention.scale's own expression, bit for bit
        )
        return cls(ext.DecoderStep(shape, layers, model.norm.weight.detach().float().contiguous(), head))

    @staticmethod
    def accepts(kv_cache: KVCache) -> bool:
        """The C++ loop reads and writes float32 or bfloat16 paged pools through the attention kernel."""
        return (isinstance(kv_cache, PagedKVCache) and kv_cache.use_kernel
                and kv_cache.dtype in (torch.float32, torch.bfloat16))

    def __call__(
        self,
        batch: ForwardBatch,
        kv_cache: PagedKVCache,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32 of the embedded batch ``x`` (updated in place)."""
        return self._step.forward(
            x,
            cos,
            sin,
            kv_cache.k,
            kv_cache.v,
            batch.slot_mapping,
            batch.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            batch.logits_indices,
            sliding_window or 0,
        )
