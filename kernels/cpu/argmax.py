"""Each row's greedy token over float32 logits (``kernels/cpu/argmax.cpp``), rows across threads.

``argmax_rows`` falls back to NumPy where the kernels are not built; ``reference_argmax_rows``
is the definition the tests compare against (NumPy's: the first maximum, or the first NaN).
"""

from __future__ import annotations

import torch

from protoserve.kernels.cpu.extension import load


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The index of each row's first maximum, for float32 ``[rows, vocab]`` CPU logits."""
    ext = load("argmax")
    if ext is None:
        return reference_argmax_rows(logits)
    return ext.argmax_rows(logits).tolist()


def reference_argmax_rows(logits: torch.Tensor) -> list[int]:
    return logits.float().numpy().argmax(axis=1).tolist()
