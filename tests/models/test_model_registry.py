"""The model registry: every family module declares what it must, and unknown names list the known ones."""

from __future__ import annotations

import dataclasses
import pkgutil
import warnings
from pathlib import Path

import pytest
import torch

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_checkpoint import parse_hf_config
from protoserve.engine.models import families
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family
from protoserve.engine.models.families.summary import model_summary

# The registry's own machinery; every other module of the package is a family.
INFRASTRUCTURE = {"family", "hf_fields", "gguf_fields", "weights", "summary", "moe_family"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def family_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(families.__path__) if m.name not in INFRASTRUCTURE)


def test_every_family_module_is_registered() -> None:
    assert family_modules() == sorted(families._MODULES)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma3"} <= set(families.FAMILIES)


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_family_declares_what_it_must(name: str) -> None:
    family = families.FAMILIES[name]
    assert isinstance(family, Family) and family.name == name
    assert family.hf_model_types and family.summary
    assert family.gguf_architectures or family.moe_names is not None  # only MoE families lack a GGUF form
    for hook in (family.config_from_hf, family.config_from_gguf, family.hf_shapes, family.hf_weight,
                 family.gguf_weight, family.fused_step_unsupported):
        assert callable(hook)
    # GGUF layer parts map onto distinct Hugging Face names.
    assert len(set(family.gguf_layer_names.values())) == len(family.gguf_layer_names)
    for model_type in family.hf_model_types:
        assert families.for_hf_model_type(model_type) is family
    for arch in family.gguf_architectures:
        assert families.for_gguf_architecture(arch) is family


def test_checkpoint_names_are_claimed_once() -> None:
    types = [t for f in families.FAMILIES.values() for t in f.hf_model_types]
    archs = [a for f in families.FAMILIES.values() for a in f.gguf_architectures]
    assert len(types) == len(set(types)) and len(archs) == len(set(archs))


# token_moe has no transformers implementation (tests/models/test_moe_families.py checks it).
@pytest.mark.parametrize("model_type", sorted(set(families.HF_MODEL_TYPES) - {"token_moe"}))
def test_weight_names_are_transformers_names(model_type: str, tmp_path: Path) -> None:
    """Each family's config mapping and weight list agree with transformers' own model of that type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"head_dim": 16} if model_type in ("qwen3", "gemma3_text", "qwen3_moe") else {}
    if model_type.startswith("deepseek"):  # MLA and routing sizes (DeepSeek-V2's defaults leave top-k unset)
        extra = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
                 "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
                 "moe_intermediate_size": 16, "first_k_dense_replace": 1}
    if model_type == "phi3":  # Phi3Config's default pad id (32000) is past the tiny vocabulary
        extra = {"pad_token_id": None}
    hf_config = AutoConfig.for_model(model_type, **TINY, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    config = parse_hf_config(hf_config.to_dict(), None, tmp_path / "config.json")
    assert isinstance(config, ModelConfig) and config.architecture == families.HF_MODEL_TYPES[model_type].name
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    if config.num_experts:  # transformers 5 fuses experts in memory; checkpoints keep them per expert
        from safetensors import safe_open

        model.save_pretrained(tmp_path / "saved")
        theirs = {}
        for file in (tmp_path / "saved").glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                theirs.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert families.hf_shapes(config) == theirs
    summary = model_summary(config)
    # Tied embedding once; checkpoint tensors transformers holds as buffers (DeepSeek-V3's score bias) count.
    saved_buffers = sum(b.numel() for n, b in model.named_buffers() if n in theirs)
    assert summary.parameters == sum(p.numel() for p in model.parameters()) + saved_buffers
    assert len(summary.layer_pattern) == config.num_layers
    if config.num_experts:  # each token skips the experts it is not routed to
        assert summary.active_parameters < summary.parameters
    else:
        assert summary.active_parameters == summary.parameters


def test_summary_takes_a_family_s_active_parameters(tmp_path: Path) -> None:
    """A family whose tokens use part of the weights (MoE) declares its count; dense ones use all."""
    from transformers import AutoConfig

    config = parse_hf_config(AutoConfig.for_model("qwen3", **TINY, head_dim=16).to_dict(), None, tmp_path)
    dense = model_summary(config)
    assert dense.active_parameters == dense.parameters
    partial = dataclasses.replace(families.FAMILIES["qwen3"], active_parameters=lambda c: 1234)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(families.FAMILIES, "qwen3", partial)
        summary = model_summary(config)
    assert (summary.parameters, summary.active_parameters) == (dense.parameters, 1234)


def test_unknown_names_list_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config({"model_type": "gpt2"}, None, tmp_path / "config.json")
    assert "unknown model_type 'gpt2'" in info.value.problem
    assert all(t in info.value.problem for t in families.HF_MODEL_TYPES)
    for lookup, kind, names in (
        (families.for_hf_model_type, "model_type", families.HF_MODEL_TYPES),
        (families.for_gguf_architecture, "architecture", families.GGUF_ARCHITECTURES),
        (families.get, "architecture", families.FAMILIES),
    ):
        with pytest.raises(families.UnknownFamilyError) as err:
            lookup("falcon")
        assert f"unknown {kind} 'falcon'" in str(err.value)
        assert all(n in str(err.value) for n in names)


def test_gemma3_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    from transformers import AutoConfig

    raw = AutoConfig.for_model("gemma3_text", **TINY, head_dim=16).to_dict()
    # Attention soft-capping is Gemma 2's block, shared: taken, not refused.
    assert parse_hf_config({**raw, "attn_logit_softcapping": 50.0}, None, tmp_path).attn_logit_softcapping == 50.0
    for key, value, named in (
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("hidden_activation", "relu", "hidden_activation"),
    ):
        with pytest.raises(ModelLoadError, match=named):
            parse_hf_config({**raw, key: value}, None, tmp_path / "config.json")
