"""What AdapterStack refuses (each with a message naming the problem) and how its slots are managed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protoserve.engine.errors import InvalidRequestError, QueueFullError
from protoserve.engine.loader.load import load_model
from protoserve.engine.lora.adapter import AdapterError
from protoserve.engine.lora.stack import NO_ADAPTER, AdapterInUseError, AdapterStack, UnknownAdapterError


@pytest.fixture(scope="module")
def base(tiny_family):
    return load_model(tiny_family("llama")[0], progress=False)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


FIRST_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
FIRST_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"r": 128}, None, "r must be an integer in [1, 64]"),
        ({"use_dora": True}, None, "use_dora"),
        ({"bias": "all"}, None, "bias 'all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, None, "target_modules ['lm_head'] are not supported"),
        ({"rank_pattern": {"q_proj": 4}}, None, "rank_pattern"),
        ({"peft_type": "IA3"}, None, "peft_type 'IA3'"),
        (None, lambda t: t.pop(FIRST_B), "missing 1 tensor(s)"),
        (None, lambda t: t.__setitem__(FIRST_A, torch.zeros(8, 32)), "has shape [8, 32], the base model needs [8, 64]"),
        (None, lambda t: t.__setitem__("base_model.model.lm_head.lora_A.weight", torch.zeros(8, 64)),
         "'base_model.model.lm_head.lora_A.weight' is not a LoRA A/B"),
    ],
    ids=["rank", "dora", "bias", "modules_to_save", "target", "rank_pattern", "peft_type", "missing", "shape",
         "extra"],
)
def test_malformed_adapter_refused(base, make_adapter, tmp_path, config, tensors, message) -> None:
    path = _copy(make_adapter("llama")[0], tmp_path / "bad")
    if config:
        _edit_config(path, **config)
    if tensors:
        _edit_tensors(path, tensors)
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    with pytest.raises(AdapterError) as err:
        stack.load("bad", path)
    assert message in str(err.value)
    assert stack.list() == []  # nothing registered


def test_missing_files_refused(base, tmp_path) -> None:
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    with pytest.raises(AdapterError, match="not a directory"):
        stack.load("x", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        stack.load("x", tmp_path / "empty")


def test_adapter_for_another_model_refused(base, make_adapter) -> None:
    """A Qwen3 adapter (head_dim 32, other shapes) on the Llama base."""
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    with pytest.raises(AdapterError, match="the base model needs"):
        stack.load("q3", make_adapter("qwen3")[0])


def test_lru_eviction_pins_and_unload(base, make_adapter) -> None:
    stack = AdapterStack(base.config, base.dtype, max_loras=2)
    for i in range(3):
        stack.load(f"a{i}", make_adapter("llama", seed=30 + i)[0])
    resident = {a.name: a.resident for a in stack.list()}
    assert resident == {"a0": False, "a1": True, "a2": True}  # a0, least recently used, left memory
    stack.acquire("a1")  # a1 pinned and most recent
    stack.acquire("a0")  # read back from disk into a2's slot (a2 is the LRU unpinned one)
    assert {a.name: (a.resident, a.active_requests) for a in stack.list()} == {
        "a0": (True, 1), "a1": (True, 1), "a2": (False, 0)}
    with pytest.raises(QueueFullError, match="all 2 \\(max_loras\\)"):
        stack.acquire("a2")  # both slots pinned
    with pytest.raises(AdapterInUseError, match="in use by 1 request"):
        stack.unload("a0")
    stack.release("a0")
    stack.acquire("a2")  # a0 now idle: evicted
    assert stack.slot_of("a2") != NO_ADAPTER and stack.slots[stack.slot_of("a2")].name == "a2"
    stack.unload("a0")
    with pytest.raises(UnknownAdapterError):
        stack.unload("a0")
    with pytest.raises(AdapterError, match="already loaded"):
        stack.load("a1", make_adapter("llama", seed=30)[0])
    with pytest.raises(InvalidRequestError, match="adapter: no adapter named 'a0'"):
        stack.acquire("a0")


def test_engine_refuses_unknown_adapter(base, make_adapter) -> None:
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.request import TokenizedRequest

    engine = LLMEngine(base, EngineConfig(max_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        engine.add_request(TokenizedRequest("r", [1, 2, 3], adapter="a"))
    engine.enable_lora(1).load("a", make_adapter("llama")[0])
    with pytest.raises(InvalidRequestError, match="no adapter named 'b' is loaded \\(loaded: a\\)"):
        engine.add_request(TokenizedRequest("r", [1, 2, 3], adapter="b"))
