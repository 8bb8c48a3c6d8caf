"""The KV cache the decoder reads and writes through.

Per step the model calls ``prepare(batch, ...)`` once, then for every layer
``attend(layer, q, k, v, meta, scale)``: the new tokens' K/V are written at
``batch.slot_mapping`` and the batch's queries attend over each sequence's
context (cached + new), causally, with an optional sliding window and GQA.

Two implementations of that interface:

* ``PagedKVCache``: preallocated per-layer ``[num_blocks, block_size, kv_heads,
  head_dim]`` K and V pools addressed by block tables, the engine's cache (one pool
  read as both K and V for multi-head latent attention, ``shared_kv``). Its
  attention is the C++ kernel ``kernels/cpu/paged_attention.cpp`` when the CPU
  can run it: batch invariant by construction, so it serves both modes, and it
  reads K/V in place, so a step builds no per-batch plan; on a CUDA device, the
  Triton kernels of kernels/triton (engine/models/device_ops.py). Otherwise the PyTorch
  paths of ``protoserve.engine.models.attention`` (deterministic tiles, or the fast gather
  + SDPA).
* ``ContiguousKVCache``: one contiguous ``[max_seq_len, kv_heads, head_dim]``
  region per sequence and the plain per-sequence SDPA; a second, simpler
  implementation that tests compare the paged cache against.

Slots: ``slot = block_id * block_size + offset``. For ``ContiguousKVCache`` a
sequence's "block table" is the single row it owns and ``block_size`` is
``max_seq_len``, so one slot formula serves both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.models.attention import (
    DecodePlan,
    TilePlan,
    build_decode_plan,
    build_tile_plan,
    context_slots,
    decode_attention,
    sdpa_attention,
    tiled_attention,
)
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.device_ops import ops_for

# How a PagedKVCache step attends: the C++ kernel (both modes), or the PyTorch fallbacks.
AttentionPath = Literal["kernel", "tiled", "fast", "sdpa"]

# An int8 pool's row per (token, KV head): head_dim codes, then the row's float32 scale in 4 bytes
# (kernels/cpu/paged_attention.cpp, "int8 rows").
INT8_SCALE_BYTES = 4


def kv_row_elements(head_dim: int, dtype: torch.dtype) -> int:
    """Pool elements one (token, KV head) row takes."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def resolve_kv_dtype(setting: str, activation_dtype: torch.dtype, quantization: str) -> torch.dtype:
    """The K/V pools' dtype for ``EngineConfig.kv_cache_dtype``.

    ``auto`` is the activation dtype, except for a model served with quantized weights,
    whose K and V are stored in bfloat16, as llama.cpp keeps a quantized model's K/V in
    f16: its weights already carry far more rounding than bf16 K/V add (SmolLM2's Q4_1
    served int4: mean logit error against float32 0.056, 0.059 with bf16 K/V), and the
    same budget then holds twice the tokens while a decode step streams half the bytes.
    """
    if setting != "auto":
        return getattr(torch, setting)
    if quantization != "none" and activation_dtype == torch.float32:
        return torch.bfloat16
    return activation_dtype


def int8_pool_values(pool: torch.Tensor) -> torch.Tensor:
    """What an int8 pool ``[..., head_dim + 4]`` holds, as float32 ``[..., head_dim]``: code * scale."""
    codes, scales = pool[..., :-INT8_SCALE_BYTES], pool[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return codes.float() * scales


@dataclass
class AttentionMetadata:
    """What every layer's attention needs from one batch, computed once per forward.

    ``path`` says which implementation the step's layers run: "kernel" (the C++ paged
    attention, in either mode, needing nothing beyond the batch), "tiled" (deterministic
    PyTorch fallback, with ``tile_plan``), "fast" (PyTorch fallback, with ``decode_plan``
    and ``context_slots``) or "sdpa" (ContiguousKVCache's per-sequence reference).
    """

    batch: ForwardBatch
    sliding_window: int | None
    deterministic: bool
    num_heads: int
    tile_plan: TilePlan | None  # path "tiled"
    decode_plan: DecodePlan | None  # path "fast": the single-token sequences, attended together
    context_slots: dict[int, torch.Tensor]  # path "fast", other sequences: slots of positions 0..seq_len-1
    path: AttentionPath
    logit_softcap: float | None = None  # Gemma 2's attention-logit soft-capping


class KVCache(ABC):
    """Per-layer K/V storage plus the attention that reads it."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @abstractmethod
    def prepare(
        self, batch: ForwardBatch, *, num_heads: int, sliding_window: int | None, deterministic: bool,
        logit_softcap: float | None = None,
    ) -> AttentionMetadata:
        """Index tensors for this batch, shared by all layers (of one window); ``logit_softcap``
        caps their attention scores."""

    @abstractmethod
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Write k/v [T, KVH, D] at the batch's slots, return attention of q [T, H, D] -> [T, H, D]."""

    def _write(
        self,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        k_pool.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k.to(self.dtype))
        if v_pool is not k_pool:  # a shared pool (MLA's latent) is written once
            v_pool.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v.to(self.dtype))


class PagedKVCache(KVCache):
    """Block-paged K/V pools, ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer.

    Zero-initialized: the PyTorch fallbacks read stale slots beyond a sequence's
    length (masked to probability exactly 0), and 0 * garbage must stay 0, never NaN.

    ``use_kernel``: None (default) uses the C++ attention kernel whenever it is
    available for this cache's dtype; False forces the PyTorch paths (comparisons,
    benchmarks); True requires the kernel.

    ``shared_kv``: one pool per layer, read as K and as V (``self.v is self.k``): multi-head latent
    attention caches ``[latent ; rope key]`` per token and attends with the latent as its value
    (engine/models/latent_attention.py), so the pool holds half the bytes of separate K and V.

    ``dtype=torch.int8``: each (token, KV head) row is quantized on write to int8 codes with one float32
    scale (max|x| / 127), as llama.cpp's ``-ctk q8_0 -ctv q8_0`` and vLLM's 8-bit ``--kv-cache-dtype``
    store K/V: half a bfloat16 pool's bytes. Only the C++ kernel reads such a pool (head_dim a multiple
    of 16, no soft-capped scores).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        use_kernel: bool | None = None,
        device: torch.device | str = "cpu",
        shared_kv: bool = False,
    ):
        device = torch.device(device)
        self.ops = ops_for(device)
        kernel_ok = self.ops.paged_attention is not None and dtype in self.ops.kv_dtypes
        if use_kernel and not kernel_ok:
            raise RuntimeError(f"the paged attention kernel cannot serve a {dtype} cache on {device}")
        if dtype == torch.int8 and (not kernel_ok or use_kernel is False or head_dim % 16):
            raise ValueError(
                "kv_cache_dtype int8 is read only by the CPU attention kernel (AVX-512 or AVX2), with head_dim a "
                f"multiple of 16; here: device {device}, kernel {'available' if kernel_ok else 'unavailable'}"
                f"{', not used' if use_kernel is False else ''}, head_dim {head_dim}")
        self.use_kernel = kernel_ok if use_kernel is None else use_kernel
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.shared_kv = shared_kv
        shape = (num_blocks, block_size, num_kv_heads, kv_row_elements(head_dim, dtype))
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = self.k if shared_kv else [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(
        cls, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
        use_kernel: bool | None = None, device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """The pool of ``config``'s KV layout (ModelConfig.kv_layout): its heads, head size, shared or not."""
        layout = config.kv_layout
        return cls(config.num_layers, num_blocks, block_size, layout.num_heads, layout.head_dim, dtype, use_kernel,
                   device, shared_kv=layout.shared)

    @staticmethod
    def block_bytes(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
        shared_kv: bool = False,
    ) -> int:
        """Bytes of one block across all layers, K and V (one pool when ``shared_kv``)."""
        row_bytes = kv_row_elements(head_dim, dtype) * dtype.itemsize
        return (1 if shared_kv else 2) * num_layers * block_size * num_kv_heads * row_bytes

    @classmethod
    def model_block_bytes(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """``block_bytes`` of ``config``'s KV layout."""
        layout = config.kv_layout
        return cls.block_bytes(config.num_layers, block_size, layout.num_heads, layout.head_dim, dtype, layout.shared)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's K/V take in the pool, over all layers (what GetModel reports)."""
        return self.block_bytes(self.num_layers, 1, self.num_kv_heads, self.head_dim, self.dtype, self.shared_kv)

    @classmethod
    def from_budget(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        budget_bytes: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        use_kernel: bool | None = None,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        """As many blocks as fit in ``budget_bytes`` (at least one)."""
        per_block = cls.block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype)
        num_blocks = max(1, budget_bytes // per_block)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, use_kernel, device)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token

    def _write(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slots: torch.Tensor) -> None:
        if self.dtype != torch.int8:
            return super()._write(k_pool, v_pool, k, v, slots)
        from protoserve.kernels.cpu.paged_attention import write_int8_rows

        write_int8_rows(k_pool, slots, k)
        if v_pool is not k_pool:
            write_int8_rows(v_pool, slots, v)

    def prepare(
        self, batch: ForwardBatch, *, num_heads: int, sliding_window: int | None, deterministic: bool,
        logit_softcap: float | None = None,
    ) -> AttentionMetadata:
        # Neither the C++ kernel nor SDPA cap scores: there a soft-capped model takes the tiles in both
        # modes; the Triton kernels cap them (DeviceOps.attention_softcap).
        if logit_softcap is not None and not (self.use_kernel and self.ops.attention_softcap):
            plan = build_tile_plan(
                batch, self.block_size, sliding_window, num_heads // self.num_kv_heads, self.num_kv_heads
            )
            return AttentionMetadata(batch, sliding_window, deterministic, num_heads, plan, None, {}, "tiled",
                                     logit_softcap)
        if self.use_kernel:  # no plan to build: the kernel walks the block tables itself
            return AttentionMetadata(
                batch, sliding_window, deterministic, num_heads, None, None, {}, "kernel", logit_softcap
            )
        if deterministic:
            plan = build_tile_plan(
                batch, self.block_size, sliding_window, num_heads // self.num_kv_heads, self.num_kv_heads
            )
            return AttentionMetadata(batch, sliding_window, True, num_heads, plan, None, {}, "tiled")
        decodes = [i for i, n in enumerate(batch.query_lens_list) if n == 1]
        decode_plan = build_decode_plan(batch, decodes, self.block_size, sliding_window) if decodes else None
        slots = {
            i: context_slots(batch.block_tables[i], torch.arange(n), self.block_size)
            for i, n in enumerate(batch.seq_lens_list)
            if batch.query_lens_list[i] > 1
        }
        return AttentionMetadata(batch, sliding_window, False, num_heads, None, decode_plan, slots, "fast")

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        batch = meta.batch
        # First the new K/V into the pool: every path (the kernel too) reads the context from it.
        self._write(self.k[layer], self.v[layer], k, v, batch.slot_mapping)
        if meta.path == "kernel":
            out = self.ops.paged_attention(q, self.k[layer], self.v[layer], batch, scale, meta.sliding_window,
                                           meta.logit_softcap)
            return out if out.dtype == q.dtype else out.to(q.dtype)
        k_slots = self.k[layer].view(-1, self.num_kv_heads, self.head_dim)
        v_slots = self.v[layer].view(-1, self.num_kv_heads, self.head_dim)
        if meta.path == "tiled":
            assert meta.tile_plan is not None
            return tiled_attention(q, k_slots, v_slots, meta.tile_plan, scale, meta.logit_softcap)
        out = torch.empty_like(q)
        if meta.decode_plan is not None:
            rows = meta.decode_plan.rows
            out[rows] = decode_attention(q[rows], k_slots, v_slots, meta.decode_plan, scale)
        starts = batch.query_start_loc.tolist()
        for i, slots in meta.context_slots.items():
            a, b = starts[i], starts[i + 1]
            out[a:b] = sdpa_attention(
                q[a:b], k_slots[slots], v_slots[slots], batch.positions[a:b], scale, meta.sliding_window
            )
        return out


class ContiguousKVCache(KVCache):
    """One contiguous ``[max_seq_len, kv_heads, head_dim]`` region per sequence row.

    A sequence owns row ``r``: its block table is ``[r]`` and its slots are
    ``r * max_seq_len + position`` (``block_size == max_seq_len``). Attention reads
    the row's first ``seq_len`` positions as they are and runs plain SDPA, in both
    modes: this cache is the simple reference, not a batch-invariant one.
    """

    def __init__(
        self,
        num_layers: int,
        max_seqs: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ):
        self.num_layers = num_layers
        self.max_seqs = max_seqs
        self.block_size = max_seq_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (max_seqs, max_seq_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]

    def prepare(
        self, batch: ForwardBatch, *, num_heads: int, sliding_window: int | None, deterministic: bool,
        logit_softcap: float | None = None,
    ) -> AttentionMetadata:
        return AttentionMetadata(batch, sliding_window, deterministic, num_heads, None, None, {}, "sdpa",
                                 logit_softcap)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        batch = meta.batch
        self._write(self.k[layer], self.v[layer], k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        starts = batch.query_start_loc.tolist()
        for i, seq_len in enumerate(batch.seq_lens_list):
            row = int(batch.block_tables[i, 0])
            a, b = starts[i], starts[i + 1]
            out[a:b] = sdpa_attention(
                q[a:b],
                self.k[layer][row, :seq_len],
                self.v[layer][row, :seq_len],
                batch.positions[a:b],
                scale,
                meta.sliding_window,
                meta.logit_softcap,
            )
        return out
