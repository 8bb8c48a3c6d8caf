"""What AdapterStack refuses (each with a message naming the problem) and how its slots are managed."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protoserve.engine.errors import AdapterCapacityError, AdapterReloadNeededError, InvalidRequestError
from protoserve.engine.loader.load import load_model
from protoserve.engine.lora.adapter import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, AdapterError
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
    with pytest.raises(AdapterError, match="^does not exist$"):
        stack.load("x", tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(AdapterError, match="^not a directory"):
        stack.load("x", tmp_path / "file")
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
    with pytest.raises(AdapterCapacityError, match="all 2 \\(max_loras\\)"):
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


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("written", "message"),
    [
        # 100,000 deep: past json's own recursion limit.
        (lambda cfg: json.dumps(cfg)[:-1] + ', "x": ' + _nested(100_000) + "}", "nests deeper than"),
        # One level past the cap, well within json's limit.
        (lambda cfg: json.dumps({**cfg, "x": json.loads(_nested(MAX_CONFIG_DEPTH))}),
         f"nests deeper than {MAX_CONFIG_DEPTH} levels"),
        (lambda cfg: json.dumps(cfg) + " " * MAX_CONFIG_BYTES, f"larger than {MAX_CONFIG_BYTES} bytes"),
        (lambda cfg: "{", "not valid JSON"),
        (lambda cfg: "[]", "must hold a JSON object"),
    ],
    ids=["deep", "one-too-deep", "large", "malformed", "not-object"],
)
def test_hostile_config_refused(base, make_adapter, tmp_path, written, message) -> None:
    path = _copy(make_adapter("llama")[0], tmp_path / "bad")
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(written(cfg))
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    with pytest.raises(AdapterError, match=message) as err:
        stack.load("bad", path)
    assert err.value.field == "path" and len(str(err.value)) < 1024
    assert stack.list() == []


def test_config_values_quoted_bounded(base, make_adapter, tmp_path) -> None:
    path = _copy(make_adapter("llama")[0], tmp_path / "bad")
    _edit_config(path, target_modules=["q_proj", "x" * 100_000])
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    with pytest.raises(AdapterError, match="target_modules .* are not supported") as err:
        stack.load("bad", path)
    assert len(str(err.value)) < 1024


def test_unreadable_paths_worded(base, tmp_path) -> None:
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    with pytest.raises(AdapterError, match="too long for the file system"):
        stack.load("x", tmp_path / ("n" * 300))  # one name over NAME_MAX: ENAMETOOLONG
    with pytest.raises(AdapterError, match="too long for the file system"):
        stack.load("x", str(tmp_path) + "/d" * 3000)  # over PATH_MAX
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    with pytest.raises(AdapterError, match="too many levels of symbolic links"):
        stack.load("x", tmp_path / "loop-a")
    (tmp_path / "file").write_text("")
    with pytest.raises(AdapterError, match="a component of the path is not a directory"):
        stack.load("x", tmp_path / "file" / "adapter")


@pytest.mark.parametrize("change", ["edit", "delete"])
def test_changed_files_of_an_idle_adapter_need_a_reload(base, make_adapter, tmp_path, caplog, change) -> None:
    path = _copy(make_adapter("llama", seed=40)[0], tmp_path / "a0")
    stack = AdapterStack(base.config, base.dtype, max_loras=1)
    stack.load("a0", path)
    stack.load("a1", make_adapter("llama", seed=41)[0])  # a0 leaves memory
    if change == "edit":
        _edit_config(path, lora_alpha=3)
    else:
        (path / "adapter_model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="protoserve.engine.lora.stack"):
        with pytest.raises(AdapterReloadNeededError, match="'a0' must be reloaded") as err:
            stack.acquire("a0")
        with pytest.raises(AdapterReloadNeededError):  # stays refused, without reading the files again
            stack.acquire("a0")
    assert str(path) not in str(err.value) and str(tmp_path) not in str(err.value)  # users are not admins
    [record] = caplog.records  # logged once, with the admin's detail
    assert record.levelno == logging.WARNING and str(path) in record.getMessage()
    assert {a.name: a.needs_reload for a in stack.list()} == {"a0": True, "a1": False}
    stack.acquire("a1")  # the others keep serving
    stack.unload("a0")
    shutil.rmtree(path)
    stack.load("a0", _copy(make_adapter("llama", seed=40)[0], path))  # what an admin does: load it again
    stack.release("a1")
    stack.acquire("a0")
    assert not stack.list()[0].needs_reload


def test_no_slot_for_the_adapter_sheds_no_waiting_request(base, make_adapter) -> None:
    """At a full queue a newcomer may displace another tenant's waiting request; one refused for
    want of an adapter slot must not have displaced anyone (whose caller would never hear of it)."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.request import Tenant, TokenizedRequest

    engine = LLMEngine(base, EngineConfig(max_kv_blocks=64, max_queue=2))
    stack = engine.enable_lora(1)
    stack.load("a0", make_adapter("llama", seed=50)[0])
    stack.load("a1", make_adapter("llama", seed=51)[0])
    engine.add_request(TokenizedRequest("r0", [1, 2, 3], adapter="a0"))
    engine.step()  # r0 runs: a0 holds the only slot
    for rid in ("x1", "x2"):  # the queue is full, all of it x's: a newcomer of y's would displace x2
        engine.add_request(TokenizedRequest(rid, [1, 2, 3], tenant=Tenant("x", "x")))
    with pytest.raises(AdapterCapacityError, match="all 1 \\(max_loras\\)"):
        engine.add_request(TokenizedRequest("y1", [1, 2, 3], adapter="a1", tenant=Tenant("y", "y")))
    assert [s.request_id for s in engine.scheduler.waiting] == ["x1", "x2"] and "x2" in engine.requests
    assert {a.name: a.active_requests for a in stack.list()} == {"a0": 1, "a1": 0}
