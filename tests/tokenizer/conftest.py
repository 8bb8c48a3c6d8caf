"""Shared SmolLM2 tokenizers: ours and transformers' (each built once per session, they are slow to parse)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protoserve.engine.loader.default_model import default_model_path
from protoserve.engine.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    """transformers' GGUF tokenizer conversion of the same file (reads the local file only)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
