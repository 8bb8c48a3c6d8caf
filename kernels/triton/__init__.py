"""Triton kernels for the GPU path, each beside its plain PyTorch reference.

Modules (import them directly; importing this package loads nothing heavy):

* ``paged_attention``: decode attention, one query per sequence, over the paged KV cache;
* ``prefill_attention``: causal attention of a ragged batch of new query rows (prefill
  chunks and decodes mixed) over the paged KV cache, the CPU kernel's exact contract;
* ``quantized_matmul``: ``x @ W.T`` from the CPU path's int8 / int4 packs, dequantized in the kernel;
* ``norm_rope``: RMSNorm, residual-add + RMSNorm, rotate-half RoPE in place;
* ``moe``: fused MoE experts over (token, expert) pairs sorted by expert.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton is imported) on CPU tensors: that is how the tests check them here.
"""

from __future__ import annotations

import importlib.util
import os


def available() -> bool:
    """True when triton can be imported (the kernels' modules need it)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (``TRITON_INTERPRET`` set to a true value)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
