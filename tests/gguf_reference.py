"""transformers' own GGUF loading, fast enough to serve as the tests' reference.

transformers parses a GGUF file twice with ``gguf.GGUFReader``, whose element-by-element
parsing of a 49k- or 262k-token vocabulary costs seconds to a minute, and rebuilds the same
tensor-name map once per module. Inside ``fast_gguf_parsing`` it parses with our reader (only
for speed: it yields exactly the stock reader's fields, which
tests/loader/test_gguf_checkpoint.py::test_fast_reader_parses_like_the_stock_reader checks),
the name map (a pure function of its arguments) is cached, and gguf's warnings are quiet.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def fast_gguf_parsing() -> Iterator[None]:
    import gguf

    from protoserve.engine.loader.gguf_checkpoint import FastGGUFReader

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.setattr(gguf, "GGUFReader", FastGGUFReader)
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        yield
