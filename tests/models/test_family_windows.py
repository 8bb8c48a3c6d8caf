"""Gemma 3 and Qwen2/Qwen3 with per-layer sliding windows against transformers, on tiny random checkpoints.

Gemma 3 here has local and global layers alternating, each with its own rope
(linear scaling on the global one), a query_pre_attn_scalar other than
head_dim and final logit soft-capping; Qwen2/3 slide from max_window_layers on.
The window (8) is shorter than the prompts, so local and global layers differ.
Checked: every position's logits within 1e-4 in deterministic and fast mode,
batch invariance across schedules, 32 greedy tokens equal transformers' alone
and inside a mixed continuous batch (LLMEngine), the fused C++ step bit-identical
to the module path (float32, int8, int4), and the fallback of a family it cannot run.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, greedy_generate, paged_cache, random_mix
from family_checkpoints import FAMILIES, VOCAB, WINDOW, hf_greedy, make_checkpoint
from tiny_families import checkpoint_cache, mixed_batch, worst_diff

from bench.tiny_checkpoints import hf_logits, random_prompts
from protoserve.engine.loader.load import load_model
from protoserve.engine.models import families
from protoserve.engine.models.decoder import DecoderLayer
from protoserve.kernels.cpu import extension

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = (5, 23, 41)  # 41 > 5 * WINDOW
GREEDY = 32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_cache(tmp_path_factory, make_checkpoint)


def _prompts(seed: int = 1) -> list[list[int]]:
    return random_prompts(PROMPT_LENS, seed)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoint, family: str, deterministic: bool) -> None:
    path, hf = checkpoint(family)
    loaded = load_model(path, progress=False, deterministic=deterministic)
    assert len(set(loaded.config.layer_windows())) == 2  # both kinds of layer present
    prompts = _prompts()
    worst = worst_diff(hf, prompts, Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once))
    print(f"{family} deterministic={deterministic}: max |logit diff| vs transformers = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_schedules_bit_identical(checkpoint, family: str) -> None:
    """Per-layer windows keep batch invariance: a random mix of chunks equals one batch, bit for bit."""
    loaded = load_model(checkpoint(family)[0], progress=False)
    prompts = _prompts(2)
    one = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once)
    mixed = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, random_mix(3))
    for a, b in zip(one, mixed, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(checkpoint, family: str) -> None:
    path, hf = checkpoint(family)
    loaded = load_model(path, progress=False)
    prompts = _prompts(4)
    ours = greedy_generate(loaded.model, prompts, GREEDY)  # all three batched in every step
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert tokens == hf_greedy(hf, prompt, GREEDY)


def test_windows_and_local_rope_matter(checkpoint) -> None:
    """Guards for the comparisons above: without the windows, or with one rope table, logits differ."""
    path, hf = checkpoint("gemma3")
    prompt = _prompts()[2]
    ref = hf_logits(hf, prompt)
    no_window = load_model(path, progress=False)
    no_window.config.sliding_window = None
    got = Driver(no_window.model, paged_cache(no_window.model)).run([prompt], all_at_once)[0]
    assert torch.allclose(got[:WINDOW], ref[:WINDOW], atol=1e-4)
    assert (got[WINDOW + 1 :] - ref[WINDOW + 1 :]).abs().max() > 1e-2
    one_rope = load_model(path, progress=False)
    one_rope.model.local_rope = one_rope.model.rope
    got = Driver(one_rope.model, paged_cache(one_rope.model)).run([prompt], all_at_once)[0]
    assert (got - ref).abs().max() > 1e-2


def test_config_mapping(checkpoint) -> None:
    gemma = load_model(checkpoint("gemma3")[0], progress=False)
    c = gemma.config
    assert (c.mlp, c.norm_placement, c.scale_embeddings, c.qk_norm) == ("geglu", "sandwich", True, True)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling) == (
        1_000_000.0, 10_000.0, {"rope_type": "linear", "factor": 2.0})
    assert c.query_pre_attn_scalar == 24 and c.final_logit_softcapping == 30.0 and c.tie_word_embeddings
    summary = gemma.summary()
    assert summary.family == "gemma3" and summary.sliding_window == WINDOW
    assert summary.layer_pattern == ["sliding", "global", "sliding", "global"]
    assert summary.parameters == summary.active_parameters == gemma.num_parameters
    hf_count = sum(p.numel() for p in checkpoint("gemma3")[1].parameters())
    assert summary.parameters == hf_count  # tied embedding once, as transformers counts it
    qwen2 = load_model(checkpoint("qwen2-swa")[0], progress=False).summary()
    assert qwen2.layer_pattern == ["global", "sliding", "sliding"]
    qwen3 = load_model(checkpoint("qwen3-swa")[0], progress=False).summary()
    assert qwen3.layer_pattern == ["global", "global", "sliding"]


@pytest.mark.skipif(not extension.cpu_supported(), reason="the CPU kernels need AVX-512 or AVX2")
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_step_bit_identical_to_module_path(checkpoint, family: str, quantization: str) -> None:
    """Per-layer windows and rope tables, sandwich norms and GeGLU in the C++ step: the same logits and
    K/V, bit for bit, as the module path, on a random mix of prefill chunks and decodes."""
    loaded = load_model(checkpoint(family)[0], progress=False, quantization=quantization)
    model = loaded.model
    assert model.fused_step is not None and model.fused_step_unsupported() is None
    prompts = _prompts(7)
    fused_cache = paged_cache(model)
    with pytest.MonkeyPatch.context() as mp:  # the module path's layers may not run
        mp.setattr(DecoderLayer, "forward", lambda *a, **k: pytest.fail("the module path ran"))
        fused = Driver(model, fused_cache).run(prompts, random_mix(8))
    model.fused_step, step = None, model.fused_step
    module_cache = paged_cache(model)
    module = Driver(model, module_cache).run(prompts, random_mix(8))
    model.fused_step = step
    for a, b in zip(fused, module, strict=True):
        assert torch.equal(a, b)
    for pools in ("k", "v"):
        for a, b in zip(getattr(fused_cache, pools), getattr(module_cache, pools), strict=True):
            assert torch.equal(a, b)


def test_family_the_fused_step_cannot_run_falls_back_with_a_reason(checkpoint, caplog) -> None:
    gemma = families.FAMILIES["gemma3"]
    refusing = dataclasses.replace(gemma, fused_step_unsupported=lambda config: "a block it lacks")
    with pytest.MonkeyPatch.context() as mp, caplog.at_level(logging.INFO, logger="protoserve.engine.models.decoder"):
        mp.setitem(families.FAMILIES, "gemma3", refusing)
        loaded = load_model(checkpoint("gemma3")[0], progress=False)
    assert loaded.model.fused_step is None
    assert any("gemma3: the fused C++ step does not run a block it lacks; serving on the module path"
               in r.getMessage() for r in caplog.records)


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
