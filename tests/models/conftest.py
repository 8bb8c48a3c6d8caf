"""Session fixtures for the model tests: tiny random HF checkpoints and the SmolLM2 GGUF models.

``tiny_checkpoint(family)`` -> (directory, transformers model): built once per
session. qwen2 is saved sharded (several safetensors files + index).

``smollm2`` -> LoadedModel of the default SmolLM2-135M-Instruct GGUF (float32,
deterministic); skipped when the model package is not installed.
``smollm2_chat`` -> (prompt ids of a chat-templated prompt, our 32 greedy tokens after it).
``smollm2_hf`` -> the same GGUF loaded by transformers (the independent reference).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from decoder_test_helpers import greedy_generate, make_hf_checkpoint
from gguf_reference import fast_gguf_parsing

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SHARDED = {"qwen2": "40KB"}


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test on one intra-op thread.

    With libgomp's default active wait, two threads on this 2-core machine are
    10x slower than one as soon as other processes compete for the cores
    (measured: 8 SmolLM2 greedy tokens 1.7s on one thread, 21s on two, at load
    4). Invariance holds for any fixed thread count; the kernel-level tests and
    one test per model keep the default count.
    """
    with intra_op_threads(1):
        yield


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    built: dict[str, tuple[Path, Any]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in built:
            directory = tmp_path_factory.mktemp(f"tiny-{family}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = make_hf_checkpoint(family, directory, max_shard_size=SHARDED.get(family))
            built[family] = (directory, model)
        return built[family]

    return get


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from protoserve.engine.loader.default_model import default_model_path

    # `make install` installs the weights package: a missing model is a failure, not a skip.
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):
    from protoserve.engine.loader.load import load_model

    return load_model(smollm2_path, progress=False)


CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
GREEDY_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2_chat(smollm2) -> tuple[list[int], list[int]]:
    """A chat-templated prompt's ids and our float32 model's 32 greedy tokens after it."""
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template(CHAT))
    with intra_op_threads(1):  # see one_thread
        return prompt, greedy_generate(smollm2.model, [prompt], GREEDY_TOKENS)[0]


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: Path):
    """transformers' own GGUF loading of the same file (its config mapping, dequantization, un-permute)."""
    from transformers import AutoModelForCausalLM

    with fast_gguf_parsing():
        model = AutoModelForCausalLM.from_pretrained(
            str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
        )
    return model.eval()
