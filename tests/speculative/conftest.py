"""Fixtures for the speculative-decoding tests: the engine tests' tiny random Llama, loaded once."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"


def _engine_fixtures():
    """tests/engine/conftest.py under its own name (``from conftest import`` picks whichever conftest came first)."""
    if str(_ENGINE_TESTS) not in sys.path:
        sys.path.insert(0, str(_ENGINE_TESTS))  # for its `from tiny_checkpoint_ids import ...`
    spec = importlib.util.spec_from_file_location("engine_tests_conftest", _ENGINE_TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def spec_tiny_loaded(tmp_path_factory):
    from protoserve.engine.loader.load import load_model

    directory = _engine_fixtures().write_tiny_llama(tmp_path_factory.mktemp("spec-tiny-llama"))
    return load_model(str(directory), dtype="float32", quantization="none", progress=False)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
