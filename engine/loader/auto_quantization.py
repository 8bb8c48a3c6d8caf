"""``--quantization auto``: serve a checkpoint at the precision it is stored in.

A GGUF file was quantized by its author: llama.cpp serves it as stored, and so
do we. The linear layers' storage types decide (the embedding and norms are not
quantized by us either way):

- 4-bit types of 32-value affine blocks (Q4_0, Q4_1, Q4_K) -> ``int4``, whose
  groups of 32 with a float16 scale and min hold those blocks as they are;
- any other quantized type (Q5_*, Q6_K, Q8_0, ...) -> ``int8`` per channel,
  never fewer bits than the file has;
- float types (F32, F16, BF16) -> ``none``.

In a mixed file (Q4_K_M keeps some layers in Q6_K) the widest layer type
decides, so no layer is served below its stored precision. A Hugging Face
directory holds float weights: ``none``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

AUTO = "auto"

# The decoder's linear layers in GGUF naming (llama.cpp's blk.N.* tensors).
_LINEAR_TENSOR = re.compile(r"^blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight$")
_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_WIDTH = {"int4": 0, "int8": 1, "none": 2}


def mode_for_type(type_name: str) -> str:
    """The quantization mode that holds one GGML storage type without losing precision."""
    if type_name in _FLOAT_TYPES:
        return "none"
    if type_name in _INT4_TYPES:
        return "int4"
    return "int8"


def mode_for_gguf_tensors(tensors: Iterable[tuple[str, str]]) -> str:
    """The mode for a GGUF file's (tensor name, GGML type name) pairs: its widest linear layer's."""
    modes = {mode_for_type(type_name) for name, type_name in tensors if _LINEAR_TENSOR.match(name)}
    if not modes:
        return "none"  # no decoder linears recognised: nothing says the file is quantized
    return max(modes, key=_WIDTH.__getitem__)
