"""What a persisted KV block's bits depend on beyond its tokens: a block is loaded only under the same.

The block's name (its chained hash, engine/scheduling/block_manager.py) fixes its tokens, the tokens
before it and the cache salt (identity and LoRA adapter). Its K/V bits also depend on the weights and
on how they are run: the checkpoint, dtype, quantization, KV dtype, activation precision, kernels and
device, and the pool's shape. Those make the fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class KVFingerprint:
    model: str  # the checkpoint's identity: resolved path, and each file's size and modification time
    dtype: str
    kv_dtype: str
    quantization: str
    group_size: int | None
    activation_precision: str
    deterministic: bool
    device: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def digest(self) -> bytes:
        """32 bytes naming this fingerprint (sha256 of its fields)."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).digest()


def checkpoint_identity(source: Path) -> str:
    """The checkpoint by path, size and modification time of each file: a replaced or re-quantized file
    changes it, without hashing gigabytes of weights at every start."""
    source = source.resolve()
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else [source]
    parts = [str(source)]
    for path in files:
        stat = path.stat()
        parts.append(f"{os.path.relpath(path, source) if source.is_dir() else path.name}:{stat.st_size}:"
                     f"{stat.st_mtime_ns}")
    return "|".join(parts)
