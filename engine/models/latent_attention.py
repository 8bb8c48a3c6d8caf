"""Multi-head latent attention (DeepSeek-V2/V3), cached compressed and attended in the absorbed form.

Per token, ``kv_a_proj_with_mqa`` gives the compressed latent ``c`` (``kv_lora_rank`` values, then
``kv_a_layernorm``) and one rope key ``k_pe`` (``qk_rope_head_dim``) shared by every head. transformers
expands ``c`` through ``kv_b_proj`` into per-head ``k_nope`` and ``v``; here the paged pool keeps
``[c ; rope(k_pe)]``, one vector per token and layer (``ModelConfig.kv_layout``), and ``kv_b_proj`` is
absorbed instead, with W_UK[h] and W_UV[h] its key and value rows of head h:

    q_nope[h] . (W_UK[h] c)  =  (W_UK[h]^T q_nope[h]) . c
    sum_t p_t W_UV[h] c_t    =  W_UV[h] (sum_t p_t c_t)

So every head attends with the query ``[W_UK[h]^T q_nope[h] ; rope(q_pe[h])]`` over the keys
``[c ; rope(k_pe)]`` and takes the key's latent part as its value: the pool is read as V too
(``PagedKVCache(shared_kv=True)``), the attention returns ``[sum p c ; sum p k_pe]`` and the tail is
dropped; W_UV[h] then takes each head to ``v_head_dim`` before ``o_proj``. That is multi-query
attention over one ``kv_lora_rank + qk_rope_head_dim`` vector, which every attention path of
kv_cache.py (the C++ kernel, the Triton kernels on a GPU, the deterministic tiles, SDPA) already runs.

Why absorbed rather than expanded per block at read time: the pool holds ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer instead of ``num_heads * (qk_nope + qk_rope + v_head_dim)``
(DeepSeek-V3: 576 instead of 40,960), and no step re-expands the context it reads. The per-head products
with W_UK and W_UV run on fixed row tiles in deterministic mode, so a token's result does not depend on
its batch. ``kv_b_proj`` stays in the model's float dtype (quantization does not reach it): it is read
per head, not as one Linear.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch
from torch import nn

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.kv_cache import AttentionMetadata, KVCache
from protoserve.engine.models.linear import ROW_TILE, Linear
from protoserve.engine.models.rope import apply_rope, apply_rope_interleaved

# (dim) -> an RMSNorm of that size with the model's eps and dtype (the decoder's own class).
NormFactory = Callable[[int], nn.Module]


def per_head_matmul(x: torch.Tensor, w: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """x [T, H, a] times w [H, a, b] head by head -> [T, H, b]; in deterministic mode on fixed
    ``ROW_TILE``-row tiles, so a row's result does not depend on how many rows share the call."""
    xh = x.transpose(0, 1)  # [H, T, a]
    if not deterministic:
        return torch.matmul(xh, w).transpose(0, 1)
    heads, rows, a = xh.shape
    padded = -(-rows // ROW_TILE) * ROW_TILE
    xp = x.new_zeros(heads, padded, a)
    xp[:, :rows] = xh
    tiles = torch.matmul(xp.view(heads, padded // ROW_TILE, ROW_TILE, a), w.unsqueeze(1))
    return tiles.view(heads, padded, w.shape[-1])[:, :rows].transpose(0, 1)


class LatentAttention(nn.Module):
    """MLA: low-rank (or plain) queries, a compressed KV latent plus a decoupled rope key, cached as one
    vector per token; kv_b_proj absorbed into the query and the output (see the module docstring)."""

    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, norm: NormFactory):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads = c.num_heads
        self.rank = c.kv_lora_rank
        self.nope_dim = c.qk_nope_head_dim
        self.rope_dim = c.head_dim
        self.v_dim = c.v_head_dim
        self.scale = c.attention_scale
        self.rotate = apply_rope_interleaved if c.rope_interleaved else apply_rope
        q_size = c.num_heads * (self.nope_dim + self.rope_dim)
        if c.q_lora_rank:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = norm(c.q_lora_rank)
            self.q_b_proj = Linear(c.q_lora_rank, q_size, dtype=dtype)
        else:
            self.q_proj = Linear(c.hidden_size, q_size, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, self.rank + self.rope_dim, dtype=dtype)
        self.kv_a_layernorm = norm(self.rank)
        # kv_b_proj split per head: W_UK [H, qk_nope, rank] and W_UV [H, v_head_dim, rank].
        self.w_uk = nn.Parameter(torch.empty(c.num_heads, self.nope_dim, self.rank, dtype=dtype), requires_grad=False)
        self.w_uv = nn.Parameter(torch.empty(c.num_heads, self.v_dim, self.rank, dtype=dtype), requires_grad=False)
        self.o_proj = Linear(c.num_heads * self.v_dim, c.hidden_size, dtype=dtype)
        self.deterministic = True

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lora: object = None,  # adapters are refused for MLA models at load (engine/lora/adapter.py)
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self._queries(x).view(t, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        query = torch.cat([per_head_matmul(q_nope, self.w_uk, self.deterministic),
                           self.rotate(q_pe, cos, sin)], dim=-1)
        key = torch.cat([latent.unsqueeze(1), self.rotate(k_pe.unsqueeze(1), cos, sin)], dim=-1)
        out = kv_cache.attend(self.layer_idx, query, key, key, meta, self.scale)  # the key is its own value
        heads = per_head_matmul(out[..., : self.rank], self.w_uv.transpose(1, 2), self.deterministic)
        return self.o_proj(heads.reshape(t, self.num_heads * self.v_dim))


def latent_attention_state(
    config: ModelConfig, weights: MutableMapping[str, torch.Tensor], hf: str, ours: str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A LatentAttention's parameters (named under ``ours``) from its Hugging Face tensors under ``hf``
    (``model.layers.N.self_attn.``), consumed from ``weights``: kv_b_proj split into W_UK and W_UV."""
    c = config
    queries = ("q_a_proj", "q_a_layernorm", "q_b_proj") if c.q_lora_rank else ("q_proj",)
    state = {
        f"{ours}{name}.weight": weights.pop(f"{hf}{name}.weight").to(dtype)
        for name in (*queries, "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj")
    }
    if c.mla_kv_b_split:
        state[f"{ours}w_uk"] = weights.pop(f"{hf}k_b_proj.weight").to(dtype).transpose(1, 2).contiguous()
        state[f"{ours}w_uv"] = weights.pop(f"{hf}v_b_proj.weight").to(dtype).contiguous()
        return state
    kv_b = weights.pop(f"{hf}kv_b_proj.weight").to(dtype).view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim,
                                                               c.kv_lora_rank)
    state[f"{ours}w_uk"] = kv_b[:, : c.qk_nope_head_dim].contiguous()
    state[f"{ours}w_uv"] = kv_b[:, c.qk_nope_head_dim :].contiguous()
    return state


def latent_attention_shapes(config: ModelConfig, hf: str) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors of one layer's MLA under ``hf`` (``model.layers.N.self_attn.``), by shape."""
    c = config
    q_size = c.num_heads * (c.qk_nope_head_dim + c.head_dim)
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank:
        shapes[f"{hf}q_a_proj.weight"] = (c.q_lora_rank, c.hidden_size)
        shapes[f"{hf}q_a_layernorm.weight"] = (c.q_lora_rank,)
        shapes[f"{hf}q_b_proj.weight"] = (q_size, c.q_lora_rank)
    else:
        shapes[f"{hf}q_proj.weight"] = (q_size, c.hidden_size)
    shapes[f"{hf}kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.head_dim, c.hidden_size)
    shapes[f"{hf}kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    if c.mla_kv_b_split:
        shapes[f"{hf}k_b_proj.weight"] = (c.num_heads, c.kv_lora_rank, c.qk_nope_head_dim)
        shapes[f"{hf}v_b_proj.weight"] = (c.num_heads, c.v_head_dim, c.kv_lora_rank)
    else:
        shapes[f"{hf}kv_b_proj.weight"] = (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    shapes[f"{hf}o_proj.weight"] = (c.hidden_size, c.num_heads * c.v_head_dim)
    return shapes
