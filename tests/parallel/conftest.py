"""Tiny random checkpoints for the tensor-parallel tests, built with transformers once per session.

Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (q/k norms, head_dim 32) are tests/models' own
(decoder_test_helpers.make_hf_checkpoint: 4 query heads, 2 KV heads, intermediate 128). ``llama`` is
Llama with ``attention_bias`` (q/k/v and o_proj biases: a row-parallel bias must count once) and
GQA 4/2, initialised as those are; ``odd_heads`` has 3 heads, which 2 ranks cannot split.
``gemma3-kv1`` and ``gemma3-kv2`` are tests/models' tiny Gemma 3 (q/k norms, sandwich norms, local
and global layers) with 4 query heads over 1 and 2 KV heads: KV heads replicated at TP=2 and TP=4.
``gemma2``, ``starcoder2``, ``command_r``, ``phi3`` and ``phi4-mini`` are tests/models' dense-family
checkpoints (soft-capped attention, an ungated GELU MLP with biases, a parallel block with interleaved
rope, fused projections with longrope and a window, partial rotary with tied embeddings).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from decoder_test_helpers import TINY, make_hf_checkpoint  # noqa: E402
from dense_family_checkpoints import make_checkpoint as make_dense_checkpoint  # noqa: E402
from family_checkpoints import hf_config, random_model  # noqa: E402
from tiny_families import checkpoint_cache  # noqa: E402

DENSE_FAMILIES = ("gemma2", "starcoder2", "command_r", "phi3", "phi4-mini")

GEMMA3_KV_HEADS = {"gemma3-kv1": 1, "gemma3-kv2": 2}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    get = checkpoint_cache(tmp_path_factory, _make, prefix="tp-")
    return lambda family: get(family)[0]


def _make(family: str, directory: Path) -> None:
    if family == "llama":
        _llama(directory)
    elif family == "odd_heads":
        _odd_heads(directory)
    elif family in GEMMA3_KV_HEADS:
        _gemma3(directory, GEMMA3_KV_HEADS[family])
    elif family in DENSE_FAMILIES:
        make_dense_checkpoint(family, directory)
    else:
        make_hf_checkpoint(family, directory)


def _llama(directory: Path) -> None:
    from transformers import LlamaConfig

    random_model(LlamaConfig(**TINY, attention_bias=True)).save_pretrained(directory, safe_serialization=True)


def _odd_heads(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=48, intermediate_size=128, num_hidden_layers=1, num_attention_heads=3,
                         num_key_value_heads=3, vocab_size=256, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def _gemma3(directory: Path, kv_heads: int) -> None:
    config = hf_config("gemma3")
    config.num_key_value_heads = kv_heads
    # Gemma's norms hold w of x * (1 + w).
    random_model(config, norm_center=0.0).save_pretrained(directory, safe_serialization=True)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Rank 0 on one intra-op thread (the workers take rank 0's count): two ranks on two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
