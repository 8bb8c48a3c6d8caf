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
docs/notes/performance-log.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.lora.adapter import LoraAdapter
from protoserve.engine.lora.batch import LoraBatch
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


# The fused linears of a layer in the C++ step's order (LoraWeights holds 4 entries per layer).
_LORA_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Adapters whose float32 copies the step keeps (more than max_loras: eviction does not tell the step).
_LORA_CACHE = 16


def lora_linear(ext, a: torch.Tensor, b: torch.Tensor, out_slices, rank: int, dtype: torch.dtype):
    """The C++ view of one fused layer's update (kernels/cpu/lora.cpp) from A [targets * rank, in] and
    B [out, targets * rank]: float32 as A [R, in rounded up to 16] and B^T [R, out + 16]; bfloat16 with
    each target's rank padded to even (a zero row of A, a zero column of B), as A [R, in rounded up
    to 32] and B in rank pairs [R / 2, (out + 32) * 2]."""
    targets = len(out_slices)
    n_out, n_in = b.shape[0], a.shape[1]
    begins, ends = [s for s, _ in out_slices], [e for _, e in out_slices]
    if dtype == torch.float32:
        a_padded = torch.zeros(a.shape[0], -(-n_in // 16) * 16)
        a_padded[:, :n_in] = a
        bt = torch.zeros(a.shape[0], n_out + 16)
        bt[:, :n_out] = b.t()
        return ext.LoraLinear(a=a_padded, bt=bt, slice_begin=begins, slice_end=ends, rank=rank)
    even = rank + rank % 2
    a_padded = torch.zeros(targets * even, -(-n_in // 32) * 32)
    b_padded = torch.zeros(n_out + 32, targets * even)
    for j in range(targets):
        a_padded[j * even : j * even + rank, :n_in] = a[j * rank : (j + 1) * rank]
        b_padded[:n_out, j * even : j * even + rank] = b[:, j * rank : (j + 1) * rank]
    pairs = b_padded.reshape(n_out + 32, targets * even // 2, 2).transpose(0, 1).reshape(targets * even // 2, -1)
    return ext.LoraLinear(a=a_padded.to(dtype), bt=pairs.to(dtype).contiguous(), slice_begin=begins,
                          slice_end=ends, rank=even)


def _lora_weights(ext, adapter: LoraAdapter, num_layers: int, dtype: torch.dtype):
    linears = []
    for i in range(num_layers):
        for name in _LORA_LINEARS:
            d = adapter.deltas.get((i, name))
            linears.append(None if d is None else lora_linear(ext, d.a, d.b, d.out_slices, adapter.rank, dtype))
    return ext.LoraWeights(linears)


class FusedStep:
    """A Decoder's packed weights bound to the C++ layer loop."""

    def __init__(self, step, ext: Any = None, num_layers: int = 0, lora_dtype: torch.dtype = torch.float32) -> None:
        self._step = step
        self._ext = ext
        self._num_layers = num_layers
        self._lora_dtype = lora_dtype
        self._lora: dict[int, tuple[LoraAdapter, Any]] = {}  # id(adapter) -> (adapter, its LoraWeights)
        # The integer-dot layers' fine activation codes (Decoder.set_activation_precision).
        self.fine_activations = True

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
        def norm(module) -> torch.Tensor | None:
            return None if module is None else module.weight.detach().float().contiguous()

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
                    # Gemma's sandwich block: two more norms around the MLP.
                    pre_feedforward_norm=norm(getattr(layer, "pre_feedforward_layernorm", None)),
                    post_feedforward_norm=norm(getattr(layer, "post_feedforward_layernorm", None)),
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
            attention_scale=cfg.attention_scale,  # Attention.scale's own expression, bit for bit
            gelu_tanh=cfg.mlp == "geglu",
        )
        step = ext.DecoderStep(shape, layers, model.norm.weight.detach().float().contiguous(), head)
        # LoRA weights in the precision class of the layers they update: float32 over float32 layers,
        # bfloat16 over bfloat16 or quantized ones where the CPU multiplies in bf16 (half the bytes a
        # decode step streams per adapter, twice the products per instruction; its rounding is far
        # below what int8/int4 base weights already carry).
        formats = {m.packed.format for layer in model.layers for m in layer.modules()
                   if isinstance(m, KernelPackable) and m.packed is not None}
        bf16 = formats != {"float32"} and ext.lora_multiplies_in_bf16()
        lora_dtype = torch.bfloat16 if bf16 else torch.float32
        fused = cls(step, ext, len(layers), lora_dtype)
        fused.fine_activations = getattr(model, "activation_precision", "exact") == "exact"
        return fused

    @staticmethod
    def accepts(kv_cache: KVCache) -> bool:
        """The C++ loop reads and writes float32, bfloat16 or int8 paged pools through the attention kernel."""
        return (isinstance(kv_cache, PagedKVCache) and kv_cache.use_kernel
                and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.int8))

    def __call__(
        self,
        batch: ForwardBatch,
        kv_cache: PagedKVCache,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        sliding_window: int | None | list[int | None],
        lora: LoraBatch | None = None,
        local_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        layer_ropes: list[int] | None = None,
    ) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32 of the embedded batch ``x`` (updated in place);
        ``lora``'s adapter rows get their adapter's updates inside the step. ``sliding_window`` is one
        window for every layer or a list with each layer's; the layers ``layer_ropes`` marks 1 rotate by
        ``local_rope``'s (cos, sin) instead of ``cos``/``sin``."""
        weights, rows, starts = self._lora_args(lora, x.shape[0])
        per_layer = isinstance(sliding_window, list)
        local_cos, local_sin = local_rope if local_rope is not None else (None, None)
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
            0 if per_layer else sliding_window or 0,
            weights,
            rows,
            starts,
            [w or 0 for w in sliding_window] if per_layer else [],
            local_cos,
            local_sin,
            layer_ropes or [],
            self.fine_activations,
        )

    def _lora_args(self, lora: LoraBatch | None, num_tokens: int) -> tuple[list, torch.Tensor | None, torch.Tensor | None]:
        """(LoraWeights per group, the groups' rows in group order, each group's start in them)."""
        if lora is None:
            return [], None, None
        weights, rows, starts = [], [], [0]
        for group in lora.groups:
            weights.append(self._adapter_weights(group.adapter))
            group_rows = torch.arange(num_tokens) if group.rows is None else group.rows
            rows.append(group_rows)
            starts.append(starts[-1] + len(group_rows))
        if len(self._lora) > _LORA_CACHE:  # the rest left their slots since; rebuilt if they come back
            used = {id(g.adapter) for g in lora.groups}
            self._lora = {k: v for k, v in self._lora.items() if k in used}
        return weights, torch.cat(rows).contiguous(), torch.tensor(starts, dtype=torch.int64)

    def _adapter_weights(self, adapter: LoraAdapter) -> Any:
        hit = self._lora.get(id(adapter))
        if hit is not None and hit[0] is adapter:
            return hit[1]
        weights = _lora_weights(self._ext, adapter, self._num_layers, self._lora_dtype)
        self._lora[id(adapter)] = (adapter, weights)
        return weights
