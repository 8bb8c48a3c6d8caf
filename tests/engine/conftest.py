"""Fixtures for engine tests: a tiny random Llama checkpoint (made with transformers) loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_checkpoint_ids import TINY_EOS, TINY_VOCAB

from bench.tiny_checkpoints import write_byte_tokenizer


def write_tiny_llama(directory: Path, max_positions: int = 4096) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        eos_token_id=TINY_EOS,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
        initializer_range=0.2,  # peaked next-token distributions, so greedy is not a coin toss
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    write_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from protoserve.engine.loader.load import load_model

    return load_model(str(tiny_model_dir), dtype="float32", quantization="none", progress=False)


@pytest.fixture
def make_engine(tiny_loaded):
    """LLMEngine factory over the shared tiny model (each engine gets its own KV pool)."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine

    def make(**config) -> LLMEngine:
        config.setdefault("max_kv_blocks", 512)
        return LLMEngine(tiny_loaded, EngineConfig(**config))

    return make


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Run engine tests on one intra-op thread, restoring the setting afterwards.

    The tiny model's ops are far too small to gain from a second thread, and when
    the machine is oversubscribed (other test processes, servers) OpenMP's thread
    barriers make two threads 10-20x slower than one (measured: 1.6 s vs 34 s for
    the 32-request run at load average 7 on 2 cores).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
