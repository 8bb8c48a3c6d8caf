"""Phi-3 / Phi-4-mini against transformers, on tiny random checkpoints and GGUF files of them.

``phi3`` has fused qkv/gate_up, longrope whose pretraining context (PHI_ORIGINAL, 48) is far below
max_position_embeddings (512), and a sliding window (24); ``phi4-mini`` adds partial rotary (12 of
16 dims) and tied embeddings. The engine serves a context of max_position_embeddings, past the
original, so it rotates by the long factors, as transformers does for a sequence past the original
length: the prompts here are longer than that. A model whose rope is fixed for a context within the
original takes the short factors, as transformers does for short sequences. Checked per family:
logits within 1e-4 of transformers (float32) over one prefill and over random mixes of prefill chunks
and cached decodes; schedules bit-identical; 32 greedy tokens equal transformers' alone, batched and
in a mixed continuous batch; the GGUF form bit-identical to the safetensors load; guards that the
factor set and the window matter; refusals by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, greedy_generate, paged_cache, random_mix
from dense_family_checkpoints import PHI_FAMILIES, PHI_ORIGINAL, PHI_WINDOW, make_checkpoint, write_gguf
from family_checkpoints import VOCAB, hf_greedy
from tiny_families import checkpoint_cache, logit_diffs, mixed_batch, worst_diff

from bench.tiny_checkpoints import random_prompts
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.load import load_model
from protoserve.engine.models.rope import rope_spec

pytestmark = pytest.mark.usefixtures("one_thread")

LONG_PROMPTS = (50, 61, 77)  # past PHI_ORIGINAL: transformers takes the long factors
SHORT_PROMPTS = (5, 11, 16)  # with 32 tokens generated still within PHI_ORIGINAL: the short ones
GREEDY = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


def _short_context(model) -> None:
    """The rope the engine fixes for a served context within the original one: the short factors."""
    model.serve_context(PHI_ORIGINAL)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_logits_match_transformers(checkpoint, family: str, deterministic: bool) -> None:
    path, hf = checkpoint(family)
    loaded = load_model(path, progress=False, deterministic=deterministic)
    assert loaded.config.architecture == "phi3" and loaded.format == "hf"
    assert loaded.config.rope_scaling["rope_type"] == "longrope"
    prompts = random_prompts(LONG_PROMPTS)
    for schedule in (all_at_once, random_mix(3)):
        ours = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, schedule)
        worst = worst_diff(hf, prompts, ours)
        print(f"{family} deterministic={deterministic}: max |logit diff| vs transformers = {worst:.2e}")
        assert worst < 1e-4


@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_short_factors_within_the_original_context(checkpoint, family: str) -> None:
    """Served within the original context, logits and 32 greedy tokens of short prompts equal
    transformers' (which rotates by the short factors while a sequence is that short)."""
    path, hf = checkpoint(family)
    model = load_model(path, progress=False).model
    _short_context(model)
    prompts = random_prompts(SHORT_PROMPTS, seed=2)
    ours = Driver(model, paged_cache(model)).run(prompts, random_mix(4))
    assert worst_diff(hf, prompts, ours) < 1e-4
    for prompt, tokens in zip(prompts, greedy_generate(model, prompts, GREEDY), strict=True):
        assert len(prompt) + GREEDY <= PHI_ORIGINAL
        assert tokens == hf_greedy(hf, prompt, GREEDY)


@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_the_factor_set_matters(checkpoint, family: str) -> None:
    """Guards for the comparisons above: long factors on short sequences, or short ones on long
    sequences, give logits far from transformers' past the first position (which does not rotate)."""
    path, hf = checkpoint(family)
    long_model = load_model(path, progress=False).model
    short_model = load_model(path, progress=False).model
    _short_context(short_model)
    for model, lengths in ((long_model, SHORT_PROMPTS), (short_model, LONG_PROMPTS)):
        prompts = random_prompts(lengths, seed=3)
        diffs = logit_diffs(hf, prompts, Driver(model, paged_cache(model)).run(prompts, all_at_once))
        assert all(d[0] < 1e-4 and d.max() > 1e-2 for d in diffs)


@pytest.mark.parametrize("max_model_len", [PHI_ORIGINAL, None], ids=["within-original", "default"])
def test_the_engine_fixes_the_factor_set_for_its_served_context(checkpoint, max_model_len: int | None) -> None:
    """LLMEngine hands the max_model_len it resolves to the rope. Served within the original context,
    short prompts' greedy tokens through the engine equal transformers' (short factors, as transformers
    and vLLM take at that length); served at the config's context (the default), the model rotates by
    the long factors, which transformers' short-sequence logits do not match."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm import LLM
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.request import TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams

    path, hf = checkpoint("phi3")
    loaded = load_model(path, progress=False)
    c = loaded.config
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=256, block_size=4, max_model_len=max_model_len))
    assert engine.max_model_len == (max_model_len or c.max_position_embeddings)
    long = max_model_len is None
    expected = rope_spec(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings,
                         max_model_len=None if long else PHI_ORIGINAL)
    assert torch.equal(engine.runner.model.rope.inv_freq, expected.inv_freq)
    prompts = random_prompts(SHORT_PROMPTS, seed=8)
    if long:
        model = engine.runner.model
        diffs = logit_diffs(hf, prompts, Driver(model, paged_cache(model)).run(prompts, all_at_once))
        assert all(d[0] < 1e-4 and d.max() > 1e-2 for d in diffs)
        return
    requests = [TokenizedRequest(f"short-{i}", p, SamplingParams(max_tokens=GREEDY, temperature=0.0,
                                                                   ignore_eos=True))
                for i, p in enumerate(prompts)]
    done = {c.request_id: c for c in LLM(engine=engine).run(requests)}
    for i, prompt in enumerate(prompts):
        assert done[f"short-{i}"].choices[0].token_ids == hf_greedy(hf, prompt, GREEDY), f"short-{i}"


@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_schedules_bit_identical(checkpoint, family: str) -> None:
    loaded = load_model(checkpoint(family)[0], progress=False)
    prompts = random_prompts(LONG_PROMPTS, seed=4)
    one = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once)
    mixed = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, random_mix(5))
    for a, b in zip(one, mixed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_greedy_tokens_match_transformers(checkpoint, family: str) -> None:
    """32 greedy tokens per prompt, each prompt alone and the three batched in every step."""
    path, hf = checkpoint(family)
    model = load_model(path, progress=False).model
    prompts = random_prompts(LONG_PROMPTS, seed=5)
    batched = greedy_generate(model, prompts, GREEDY)
    for prompt, tokens in zip(prompts, batched, strict=True):
        theirs = hf_greedy(hf, prompt, GREEDY)
        assert greedy_generate(model, [prompt], GREEDY)[0] == theirs
        assert tokens == theirs


@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_mixed_continuous_batch_matches_transformers(checkpoint, family: str) -> None:
    """Three greedy prompts among seeded sampling requests of random lengths, chunked prefill beside
    decodes: each greedy request's 32 tokens equal transformers' greedy continuation."""
    path, hf = checkpoint(family)
    prompts = random_prompts(LONG_PROMPTS, seed=6)
    engine, done = mixed_batch(path, prompts, GREEDY, sampled_len=60)
    assert engine.stats().num_steps > GREEDY  # chunked: the batch really mixed prefills and decodes
    for i, prompt in enumerate(prompts):
        tokens = done[f"greedy-{i}"]
        assert all(t < VOCAB for t in tokens)
        assert tokens == hf_greedy(hf, prompt, GREEDY), f"{family} greedy-{i}"


@pytest.mark.parametrize("family", PHI_FAMILIES)
def test_gguf_serves_the_same_model(checkpoint, tmp_path: Path, family: str) -> None:
    """llama.cpp's phi3 layout (fused attn_qkv and ffn_up, the factor sets as tensors, the rotated dims
    as rope.dimension_count): the same rope and switches, logits bit-identical to the safetensors
    load, 32 greedy tokens equal transformers'."""
    path, hf = checkpoint(family)
    from_gguf = load_model(write_gguf(tmp_path / f"{family}.gguf", hf, family), progress=False,
                           load_tokenizer=False)
    from_hf = load_model(path, progress=False)
    assert from_gguf.format == "gguf"
    for key in ("architecture", "head_dim", "tie_word_embeddings", "max_position_embeddings", "rope_theta"):
        assert getattr(from_gguf.config, key) == getattr(from_hf.config, key), key
    assert from_gguf.config.layer_windows() == from_hf.config.layer_windows()
    ours, theirs = from_gguf.model.rope, from_hf.model.rope
    assert ours.rotary_dim == theirs.rotary_dim and torch.equal(ours.inv_freq, theirs.inv_freq)
    assert ours.attention_factor == pytest.approx(theirs.attention_factor, rel=1e-7)  # stored as float32
    prompts = random_prompts(LONG_PROMPTS, seed=9)
    a = Driver(from_gguf.model, paged_cache(from_gguf.model)).run(prompts, random_mix(2))
    b = Driver(from_hf.model, paged_cache(from_hf.model)).run(prompts, random_mix(2))
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    prompt = prompts[2]
    assert greedy_generate(from_gguf.model, [prompt], GREEDY)[0] == hf_greedy(hf, prompt, GREEDY)


def test_config_summary_and_step(checkpoint) -> None:
    """Switches as the configs say; Phi-3 runs the fused C++ step, partial rotary the module path."""
    phi3 = load_model(checkpoint("phi3")[0], progress=False)
    c = phi3.config
    assert (c.sliding_window, c.tie_word_embeddings, c.rms_norm_eps, phi3.model.rope.rotary_dim) == (
        PHI_WINDOW, False, 1e-5, 16)
    assert phi3.model.fused_step is not None
    mini = load_model(checkpoint("phi4-mini")[0], progress=False)
    c = mini.config
    assert (c.sliding_window, c.tie_word_embeddings, mini.model.rope.rotary_dim) == (None, True, 12)
    assert mini.model.fused_step is None and mini.model.fused_step_unsupported() == "partial rotary"
    for family, loaded in (("phi3", phi3), ("phi4-mini", mini)):
        hf_count = sum(p.numel() for p in checkpoint(family)[1].parameters())
        assert loaded.summary().parameters == loaded.num_parameters == hf_count, family


def test_the_window_matters(checkpoint) -> None:
    path, hf = checkpoint("phi3")
    loaded = load_model(path, progress=False)
    loaded.config.sliding_window = None
    prompt = random_prompts(LONG_PROMPTS)[2]
    diff = logit_diffs(hf, [prompt], Driver(loaded.model, paged_cache(loaded.model)).run([prompt], all_at_once))[0]
    assert diff[:PHI_WINDOW].max() < 1e-4 and diff[PHI_WINDOW + 1 :].max() > 1e-2


def _edited(checkpoint, family: str, tmp_path: Path, **changes) -> Path:
    target = tmp_path / family
    shutil.copytree(checkpoint(family)[0], target)
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, **changes}))
    return target


def _rope(family: str, **changes) -> dict:
    from dense_family_checkpoints import hf_config

    return {**hf_config(family).rope_parameters, **changes}


@pytest.mark.parametrize(
    ("family", "changes", "named"),
    [
        ("phi3", {"hidden_act": "gelu"}, "hidden_act"),
        ("phi3", {"rope_parameters": None, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8}},
         "long_factor"),
        ("phi4-mini", {"rope_parameters": _rope("phi4-mini", partial_rotary_factor=0.1)}, "partial_rotary_factor"),
        ("phi3", {"rope_parameters": _rope("phi3", long_factor=[1.0] * 7)}, "long_factor"),
        ("phi3", {"rope_parameters": {"full_attention": _rope("phi3")}}, "per layer type"),
    ],
)
def test_unsupported_options_refused_by_name(checkpoint, tmp_path: Path, family: str, changes: dict,
                                             named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        load_model(_edited(checkpoint, family, tmp_path, **changes), progress=False)


def test_legacy_su_type_reads_as_longrope(checkpoint, tmp_path: Path) -> None:
    """Early Phi-3-128k configs say "su"; Phi-3's config class reads it as longrope, so do we."""
    path = _edited(checkpoint, "phi3", tmp_path, rope_parameters=None,
                   rope_scaling={**_rope("phi3"), "rope_type": "su"})
    loaded = load_model(path, progress=False)
    assert torch.equal(loaded.model.rope.inv_freq, load_model(checkpoint("phi3")[0], progress=False).model.rope.inv_freq)


def test_gguf_with_one_factor_set_refused(checkpoint, tmp_path: Path) -> None:
    """A file with rope_factors_long but not rope_factors_short cannot say which set short sequences take."""
    import gguf

    _, hf = checkpoint("phi3")
    path = write_gguf(tmp_path / "full.gguf", hf, "phi3")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "one.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith("phi3."):
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        if tensor.name != "rope_factors_short.weight":
            writer.add_tensor(tensor.name, tensor.data.copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="rope_factors_short"):
        load_model(tmp_path / "one.gguf", progress=False, load_tokenizer=False)
