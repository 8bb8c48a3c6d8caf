"""The default model end to end: SmolLM2-135M-Instruct GGUF through load_model vs transformers.

transformers reads the same GGUF with its own code (config mapping,
dequantization, Q/K un-permutation), so agreement checks the GGUF loader and
the decoder together: logits of a chat-templated prompt within tolerance, and
the same 32 greedy tokens. Also: bfloat16 against float32, and bit-identical
logits for sequences batched together vs alone on the real model.
"""

from __future__ import annotations

import pytest
import torch
from decoder_test_helpers import (
    Driver,
    all_at_once,
    each_alone,
    paged_cache,
    prefill_then_decode_batched,
)

from protoserve.engine.loader.load import load_model


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_config_and_tokenizer(smollm2) -> None:
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert c.tie_word_embeddings and c.vocab_size == 49152
    assert smollm2.format == "gguf" and smollm2.tokenizer is not None and smollm2.tokenizer.has_chat_template
    assert smollm2.model.lm_head.weight is smollm2.model.embed_tokens.weight
    print(
        f"SmolLM2 float32 weights: {smollm2.weight_bytes_after / 2**20:.1f} MiB, loaded in {smollm2.load_seconds:.1f}s"
    )


@pytest.mark.usefixtures("one_thread")
def test_logits_match_transformers(smollm2, smollm2_hf, smollm2_chat) -> None:
    prompt, _ = smollm2_chat
    ours = Driver(smollm2.model, paged_cache(smollm2.model, num_blocks=8, block_size=16)).run(
        [prompt], all_at_once
    )[0]
    with torch.no_grad():
        ref = smollm2_hf(torch.tensor([prompt])).logits[0]
    err = (ours - ref).abs().max().item()
    print(
        f"SmolLM2 max |logit diff| vs transformers over {len(prompt)} positions: {err:.2e} (max |logit| {ref.abs().max():.1f})"
    )
    assert err < 5e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.usefixtures("one_thread")
def test_greedy_tokens_match_transformers(smollm2, smollm2_hf, smollm2_chat) -> None:
    prompt, ours = smollm2_chat
    theirs = _hf_greedy(smollm2_hf, prompt, len(ours))
    print("SmolLM2 greedy:", repr(smollm2.tokenizer.decode(ours)))
    assert ours == theirs


@pytest.mark.usefixtures("one_thread")
def test_bfloat16_agrees_with_float32(smollm2_path, smollm2, smollm2_chat) -> None:
    prompt, continuation = smollm2_chat
    bf16 = load_model(smollm2_path, dtype="bfloat16", progress=False)
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    assert bf16.weight_bytes_after * 2 == smollm2.weight_bytes_after
    seq = prompt + continuation
    positions = slice(len(prompt) - 1, len(seq) - 1)
    ref = Driver(smollm2.model, paged_cache(smollm2.model, 16, 16)).run([seq], all_at_once)[0][positions]
    out = Driver(bf16.model, paged_cache(bf16.model, 16, 16)).run([seq], all_at_once)[0][positions]
    agree = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    err = (out - ref).abs().mean().item()
    print(f"SmolLM2 bfloat16 vs float32: greedy top-1 agreement {agree:.3f}, mean |logit error| {err:.3f}")
    assert agree >= 0.85 and err <= 0.5


def test_batched_equals_alone_on_real_model(smollm2, smollm2_chat) -> None:
    """Bit-identical logits for a few sequences prefilled and decoded together vs each alone
    (default intra-op threads, as the engine runs)."""
    prompt, continuation = smollm2_chat
    seqs = [prompt + continuation[:2], prompt[-20:] + continuation[:3]]
    lens = [len(prompt), 20]
    model = smollm2.model
    together = Driver(model, paged_cache(model, 24, 16)).run(seqs, prefill_then_decode_batched(lens))
    alone = Driver(model, paged_cache(model, 24, 16)).run(seqs, each_alone)
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
