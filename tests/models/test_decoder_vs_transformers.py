"""Our decoder, loaded through load_model from safetensors, against transformers' own model.

One tiny random checkpoint per family (Llama with llama3 rope scaling, Mistral
with a sliding window shorter than the prompts, Qwen2 with q/k/v biases, tied
embeddings and sharded files, Qwen3 with q/k norms and linear rope scaling); a
flattened batch of prompts of different lengths; every position's logits must
match transformers within 1e-4 (float32), in deterministic and fast mode.
"""

from __future__ import annotations

import pytest
import torch
from decoder_test_helpers import MISTRAL_WINDOW, Driver, all_at_once, paged_cache

from protoserve.engine.loader.load import load_model

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
PROMPT_LENS = (5, 23, 41)  # 41 > 2 * MISTRAL_WINDOW: positions well past the window


def _prompts(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_checkpoint, family: str, deterministic: bool) -> None:
    path, hf = tiny_checkpoint(family)
    loaded = load_model(path, progress=False, deterministic=deterministic)
    assert loaded.tokenizer is None and loaded.format == "hf"
    assert loaded.config.architecture == family
    prompts = _prompts()
    ours = Driver(loaded.model, paged_cache(loaded.model)).run(prompts, all_at_once)
    worst = 0.0
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        assert ref.abs().max() > 1.0  # weights scaled so the comparison is not between near-zeros
        worst = max(worst, (logits - ref).abs().max().item())
    print(f"{family} deterministic={deterministic}: max |logit diff| vs transformers = {worst:.2e}")
    assert worst < 1e-4


def test_family_switches_parsed(tiny_checkpoint) -> None:
    cfgs = {f: load_model(tiny_checkpoint(f)[0], progress=False).config for f in FAMILIES}
    assert cfgs["llama"].rope_scaling["rope_type"] == "llama3" and cfgs["llama"].rope_theta == 50000.0
    assert cfgs["mistral"].sliding_window == MISTRAL_WINDOW
    assert cfgs["qwen2"].attention_bias and cfgs["qwen2"].tie_word_embeddings
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_dim == 32
    assert cfgs["qwen3"].rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_sharded_checkpoint_really_sharded(tiny_checkpoint) -> None:
    path, _ = tiny_checkpoint("qwen2")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1


def test_sliding_window_matters(tiny_checkpoint) -> None:
    """Guard for the Mistral comparison: without the window, logits past it would differ."""
    path, hf = tiny_checkpoint("mistral")
    loaded = load_model(path, progress=False)
    loaded.config.sliding_window = None
    prompt = _prompts()[2]
    ours = Driver(loaded.model, paged_cache(loaded.model)).run([prompt], all_at_once)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert torch.allclose(ours[:MISTRAL_WINDOW], ref[:MISTRAL_WINDOW], atol=1e-4)
    assert (ours[MISTRAL_WINDOW + 1 :] - ref[MISTRAL_WINDOW + 1 :]).abs().max() > 1e-2
