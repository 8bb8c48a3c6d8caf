"""Give the C heap's freed pages back to the operating system after a load.

A load builds the whole model in float32 (GGUF blocks dequantized, safetensors
widened), then quantizes and packs it and drops the float32 tensors. glibc
keeps the freed heap: its dynamic mmap threshold rises past the size of the
first large tensors freed, so later ones come from the brk heap, and pages
freed below a live allocation are never trimmed. For SmolLM2 int4 that was
~650 MB of resident memory holding nothing, twice the model as served.
``malloc_trim(0)`` releases every free page of every arena once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return free heap pages to the OS; False where the C library has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
