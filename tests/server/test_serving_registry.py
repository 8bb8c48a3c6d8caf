"""ModelRegistry and ModelSpec: names and aliases of both kinds route one way; a model of the wrong
kind is INVALID_ARGUMENT on ``model``, an unknown name NOT_FOUND; several engines split the KV budget."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
from server_engine_double import EngineDouble

from protoserve.engine.api import EngineConfig
from protoserve.server.errors import ServiceError
from protoserve.server.models.model_registry import ModelRegistry
from protoserve.server.models.model_spec import ModelSpec, engine_config_for, model_specs, parse_names
from protoserve.server.models.served_model import ModelCard, ServedModel
from protoserve.server.services.embeddings import ServedEmbedder


def served(name: str, *aliases: str) -> ServedModel:
    engine = EngineDouble()
    engine.model_name = name
    return ServedModel(engine, ModelCard("float32", "none", f"/models/{name}"), aliases=aliases)


def embedder(*aliases: str) -> ServedEmbedder:
    model = SimpleNamespace(name="all-MiniLM-L6-v2", dimensions=384, max_tokens=256, vocab_size=30522)
    return ServedEmbedder(model, worker=None, aliases=aliases, source="/models/minilm")


@pytest.fixture
def registry() -> ModelRegistry:
    models = ModelRegistry()
    models.add(served("chat-a", "a"))
    models.add(served("chat-b"))
    models.add_embedder(embedder("text-embedding-3-small"))
    return models


def refusal(call) -> ServiceError:
    with pytest.raises(ServiceError) as raised:
        call()
    return raised.value


def test_names_and_aliases_route_to_their_model(registry):
    assert registry.get("").name == "chat-a"  # the first is the default
    assert registry.get("a").name == "chat-a"
    assert registry.get("chat-b").name == "chat-b"
    assert registry.embedder("").name == registry.embedder("text-embedding-3-small").name == "all-MiniLM-L6-v2"
    assert registry.describe("text-embedding-3-small").kind == "embedding"
    assert [m.name for m in registry.listing()] == ["chat-a", "chat-b", "all-MiniLM-L6-v2"]
    assert registry.names == ["chat-a", "chat-b"]


def test_a_model_of_the_wrong_kind_is_invalid_argument_on_model(registry):
    to_embedder = refusal(lambda: registry.get("text-embedding-3-small"))
    from_chat = refusal(lambda: registry.embedder("a"))
    for error in (to_embedder, from_chat):
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [field for field, _ in error.violations] == ["model"]
    assert "an embedding model" in to_embedder.message and "chat-a, chat-b" in to_embedder.message
    assert "a chat model and does not embed" in from_chat.message
    assert refusal(lambda: registry.get("nope")).code == grpc.StatusCode.NOT_FOUND
    assert refusal(lambda: registry.embedder("nope")).code == grpc.StatusCode.NOT_FOUND


def test_model_info_carries_kind_and_aliases(registry):
    chat = registry.describe("a")  # its ModelInfo is checked live (test_multi_model_live.py)
    assert (chat.name, chat.kind, chat.aliases) == ("chat-a", "chat", ("a",))
    info = registry.describe("all-MiniLM-L6-v2").model_info(with_path=False)
    assert (info.kind, info.max_model_len, info.source) == ("embedding", 256, "minilm")


def test_a_name_is_served_once_across_kinds(registry):
    with pytest.raises(ValueError, match="already served by chat-a"):
        registry.add(served("other", "a"))
    with pytest.raises(ValueError, match="already served by chat-b"):
        registry.add_embedder(SimpleNamespace(name="chat-b", aliases=(), kind="embedding"))
    assert registry.names == ["chat-a", "chat-b"]


def test_removing_a_model_by_alias_frees_all_its_names(registry):
    assert registry.remove("a").name == "chat-a"
    assert refusal(lambda: registry.get("chat-a")).code == grpc.StatusCode.NOT_FOUND
    assert registry.get("").name == "chat-b"
    registry.add(served("chat-a", "a"))  # its names can be served again
    assert registry.get("a").name == "chat-a"


def test_served_names_flag_values():
    assert parse_names("gpt-4o, smol") == ("gpt-4o", "smol")
    for bad in ("a,,b", "a,a", ""):
        with pytest.raises(ValueError):
            parse_names(bad)


def test_specs_pair_names_and_kv_blocks_with_the_models():
    specs = model_specs(["x", "y"], [("x1", "xa")], [64])
    assert specs == (ModelSpec("x", ("x1", "xa"), 64), ModelSpec("y", (), 64))
    assert model_specs([], [("solo",)], []) == (ModelSpec(None, ("solo",)),)
    assert model_specs(["x", "y"], [], [8, 16])[1].max_kv_blocks == 16
    for sources, names, blocks in ((["x"], [("a",), ("b",)], []), (["x", "y", "z"], [], [1, 2]),
                                   (["x", "y"], [("a",), ("a",)], [])):
        with pytest.raises(ValueError):
            model_specs(sources, names, blocks)


def test_several_engines_split_the_kv_budget_unless_their_pools_are_set():
    base = EngineConfig()
    shares = [engine_config_for(ModelSpec(), base, 2).kv_cache_bytes for _ in range(2)]
    assert sum(shares) <= base.kv_cache_bytes and shares[0] == base.kv_cache_bytes // 2
    assert engine_config_for(ModelSpec(), base, 1) is base
    assert engine_config_for(ModelSpec(max_kv_blocks=40), base, 2).max_kv_blocks == 40
