"""Gemma 2, StarCoder2 and Command-R against transformers, on tiny random checkpoints and GGUF files of them.

Gemma 2 here alternates local and global layers with a window (8) shorter than the
prompts and soft-caps attention scores hard enough to matter; StarCoder2 has LayerNorms
with biases, the ungated GELU MLP and a sliding window on every layer; Command-R the
parallel block, interleaved rope and a logit scale. Checked per family: every position's
logits within 1e-4 of transformers (float32) over one prefill and over a random mix of
prefill chunks and cached decodes, deterministic and fast mode; the schedules bit-identical;
32 greedy tokens equal transformers' alone, batched, and inside a mixed continuous batch
(LLMEngine); the same model from a GGUF file of llama.cpp's layout; the module path with
the fused step's reason; guards that each family's own block changes the output; refusals.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from decoder_test_helpers import (
    Driver,
    all_at_once,
    contiguous_cache,
    greedy_generate,
    paged_cache,
    random_mix,
)
from dense_family_checkpoints import FAMILIES, make_checkpoint, write_gguf
from family_checkpoints import VOCAB, WINDOW, hf_greedy
from tiny_families import checkpoint_cache, mixed_batch, worst_diff

from bench.tiny_checkpoints import hf_logits, random_prompts
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.load import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = (5, 23, 41)  # 41 > 5 * WINDOW
GREEDY = 32
FUSED_STEP_LACKS = {
    "gemma2": "attention-logit soft-capping",
    "starcoder2": "LayerNorm, an MLP without a gate",
    "command_r": "LayerNorm, a parallel attention/MLP block, interleaved rope",
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


def _prompts(seed: int = 1) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, seed)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoint, family: str, deterministic: bool) -> None:
    """One prefill of three prompts, then a random mix of prefill chunks and single-token decodes over
    the cache: every position within 1e-4 of transformers."""
    path, hf = checkpoint(family)
    loaded = load_model(path, progress=False, deterministic=deterministic)
    assert loaded.config.architecture == family and loaded.format == "hf"
    prompts = _prompts()
    for schedule in (all_at_once, random_mix(3)):
        ours = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, schedule)
        worst = worst_diff(hf, prompts, ours)
        print(f"{family} deterministic={deterministic}: max |logit diff| vs transformers = {worst:.2e}")
        assert worst < 1e-4


def test_gemma2_soft_caps_on_the_contiguous_reference_cache(checkpoint) -> None:
    """The second cache implementation (per-sequence, written-out softmax when capped) agrees too."""
    path, hf = checkpoint("gemma2")
    model = load_model(path, progress=False).model
    prompts = _prompts()
    assert worst_diff(hf, prompts, Driver(model, contiguous_cache(model)).run(prompts, random_mix(4))) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_schedules_bit_identical(checkpoint, family: str) -> None:
    loaded = load_model(checkpoint(family)[0], progress=False)
    prompts = _prompts(2)
    one = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once)
    mixed = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, random_mix(5))
    for a, b in zip(one, mixed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(checkpoint, family: str) -> None:
    """32 greedy tokens per prompt, each prompt alone and the three batched in every step."""
    path, hf = checkpoint(family)
    model = load_model(path, progress=False).model
    prompts = _prompts(4)
    batched = greedy_generate(model, prompts, GREEDY)
    for prompt, tokens in zip(prompts, batched, strict=True):
        theirs = hf_greedy(hf, prompt, GREEDY)
        assert greedy_generate(model, [prompt], GREEDY)[0] == theirs
        assert tokens == theirs


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_continuous_batch_matches_transformers(checkpoint, family: str) -> None:
    """Three greedy prompts among seeded sampling requests of random lengths, chunked prefill beside
    decodes: each greedy request's 32 tokens equal transformers' greedy continuation."""
    path, hf = checkpoint(family)
    prompts = _prompts(6)
    engine, done = mixed_batch(path, prompts, GREEDY)
    assert engine.stats().num_steps > GREEDY  # chunked: the batch really mixed prefills and decodes
    for i, prompt in enumerate(prompts):
        tokens = done[f"greedy-{i}"]
        assert all(t < VOCAB for t in tokens)
        assert tokens == hf_greedy(hf, prompt, GREEDY), f"{family} greedy-{i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_serves_the_same_model(checkpoint, tmp_path: Path, family: str) -> None:
    """The weights in llama.cpp's layout for the family's GGUF architecture: the same switches, logits
    bit-identical to the safetensors load, 32 greedy tokens equal transformers'."""
    path, hf = checkpoint(family)
    from_gguf = load_model(write_gguf(tmp_path / f"{family}.gguf", hf, family), progress=False,
                           load_tokenizer=False)
    from_hf = load_model(path, progress=False)
    assert from_gguf.format == "gguf"
    for key in ("architecture", "norm", "norm_bias", "norm_placement", "mlp", "mlp_bias", "attention_bias",
                "o_proj_bias", "qk_norm", "rope_interleaved", "attn_logit_softcapping", "final_logit_softcapping",
                "logit_scale", "query_pre_attn_scalar", "scale_embeddings", "tie_word_embeddings", "head_dim"):
        assert getattr(from_gguf.config, key) == getattr(from_hf.config, key), key
    assert from_gguf.config.layer_windows() == from_hf.config.layer_windows()
    assert from_gguf.config.rms_norm_eps == pytest.approx(from_hf.config.rms_norm_eps)
    prompts = _prompts(9)
    a = Driver(from_gguf.model, paged_cache(from_gguf.model)).run(prompts, random_mix(2))
    b = Driver(from_hf.model, paged_cache(from_hf.model)).run(prompts, random_mix(2))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    prompt = prompts[2]
    assert greedy_generate(from_gguf.model, [prompt], GREEDY)[0] == hf_greedy(hf, prompt, GREEDY)


@pytest.mark.parametrize("family", FAMILIES)
def test_module_path_with_the_reason(checkpoint, family: str, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="protoserve.engine.models.decoder"):
        loaded = load_model(checkpoint(family)[0], progress=False)
    assert loaded.model.fused_step is None
    assert loaded.model.fused_step_unsupported() == FUSED_STEP_LACKS[family]
    assert any(f"{family}: the fused C++ step does not run {FUSED_STEP_LACKS[family]}" in r.getMessage()
               for r in caplog.records)


def test_config_and_summary(checkpoint) -> None:
    gemma = load_model(checkpoint("gemma2")[0], progress=False)
    c = gemma.config
    assert (c.mlp, c.norm_placement, c.scale_embeddings, c.qk_norm, c.rope_local_theta) == (
        "geglu", "sandwich", True, False, None)
    assert (c.attn_logit_softcapping, c.final_logit_softcapping, c.query_pre_attn_scalar) == (5.0, 30.0, 16.0)
    assert gemma.summary().layer_pattern == ["sliding", "global", "sliding", "global"]
    starcoder = load_model(checkpoint("starcoder2")[0], progress=False)
    c = starcoder.config
    assert (c.norm, c.norm_bias, c.mlp, c.mlp_bias, c.attention_bias, c.o_proj_bias) == (
        "layer", True, "gelu", True, True, True)
    assert starcoder.summary().layer_pattern == ["sliding", "sliding"] and c.tie_word_embeddings
    command = load_model(checkpoint("command_r")[0], progress=False)
    c = command.config
    assert (c.norm, c.norm_bias, c.norm_placement, c.rope_interleaved, c.logit_scale) == (
        "layer", False, "parallel", True, 0.5)
    assert command.summary().layer_pattern == ["global", "global"] and c.tie_word_embeddings
    for family, loaded in (("gemma2", gemma), ("starcoder2", starcoder), ("command_r", command)):
        hf_count = sum(p.numel() for p in checkpoint(family)[1].parameters())
        assert loaded.summary().parameters == loaded.num_parameters == hf_count, family


def test_each_familys_blocks_matter(checkpoint) -> None:
    """Guards for the comparisons above: without Gemma 2's attention soft-cap, StarCoder2's window or
    Command-R's interleaved rope, the logits past the first tokens differ from transformers'."""
    prompt = _prompts()[2]

    def diff(family: str, change) -> torch.Tensor:
        path, hf = checkpoint(family)
        loaded = load_model(path, progress=False)
        change(loaded.model)
        got = Driver(loaded.model, paged_cache(loaded.model)).run([prompt], all_at_once)[0]
        return (got - hf_logits(hf, prompt)).abs().amax(-1)

    assert diff("gemma2", lambda m: setattr(m.config, "attn_logit_softcapping", None)).max() > 1e-2
    no_window = diff("starcoder2", lambda m: setattr(m.config, "sliding_window", None))
    assert no_window[:WINDOW].max() < 1e-4 and no_window[WINDOW + 1 :].max() > 1e-2

    def halves(model) -> None:
        for layer in model.layers:
            layer.self_attn.rope_interleaved = False

    rotated_halves = diff("command_r", halves)
    assert rotated_halves[0] < 1e-4 and rotated_halves.max() > 1e-2  # position 0 does not rotate


def _edited_checkpoint(checkpoint, family: str, tmp_path: Path, **changes) -> Path:
    source = checkpoint(family)[0]
    target = tmp_path / family
    shutil.copytree(source, target)
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, **changes}))
    return target


@pytest.mark.parametrize(
    ("family", "changes", "named"),
    [
        ("command_r", {"use_qk_norm": True}, "use_qk_norm"),
        ("command_r", {"hidden_act": "gelu"}, "hidden_act"),
        ("starcoder2", {"hidden_act": "relu"}, "hidden_act"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma2", {"hidden_activation": "silu"}, "hidden_activation"),
    ],
)
def test_unsupported_options_refused_by_name(checkpoint, tmp_path: Path, family: str, changes: dict,
                                             named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        load_model(_edited_checkpoint(checkpoint, family, tmp_path, **changes), progress=False)


def test_gemma2_caps_default_as_transformers(checkpoint, tmp_path: Path) -> None:
    """A config.json without the cap keys takes transformers' defaults (50, 30); an explicit null turns one off."""
    path = _edited_checkpoint(checkpoint, "gemma2", tmp_path)
    raw = json.loads((path / "config.json").read_text())
    del raw["attn_logit_softcapping"], raw["final_logit_softcapping"]
    (path / "config.json").write_text(json.dumps({**raw, "final_logit_softcapping": None}))
    c = load_model(path, progress=False).config
    assert (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, None)


def test_command_r_gguf_with_qk_norms_refused(checkpoint, tmp_path: Path) -> None:
    """Command R+'s per-head q/k LayerNorms, as llama.cpp writes them ([heads, head_dim]), are refused."""
    _, hf = checkpoint("command_r")
    qk = {f"blk.{i}.attn_{x}_norm.weight": torch.ones(heads, 16)
          for i in range(2) for x, heads in (("q", 4), ("k", 2))}
    path = write_gguf(tmp_path / "qk.gguf", hf, "command_r", extra=qk)
    with pytest.raises(ModelLoadError, match="use_qk_norm"):
        load_model(path, progress=False, load_tokenizer=False)


def test_starcoder2_lora_on_the_gate_is_refused_at_load(checkpoint) -> None:
    from protoserve.engine.lora.adapter import AdapterError, check_adapter_targets

    config = load_model(checkpoint("starcoder2")[0], progress=False).config
    check_adapter_targets(config, ("q_proj", "v_proj", "down_proj"))  # c_proj takes a LoRA as down_proj
    with pytest.raises(AdapterError, match=r"\['gate_proj', 'up_proj'\] are gated-MLP projections"):
        check_adapter_targets(config, ("q_proj", "gate_proj", "up_proj"))
