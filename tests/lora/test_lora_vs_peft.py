"""Logits under a LoRA adapter against PEFT's PeftModel on the tiny random checkpoints of every family.

The adapters are made in the test (PEFT ``LoraConfig``, random non-zero A and B, ``save_pretrained``),
loaded through AdapterStack, and run through the decoder's multi-LoRA path: every position's logits
must match PeftModel within float32 tolerance, and must differ from the base model's by far more than
that tolerance (so a no-op adapter cannot pass).
"""

from __future__ import annotations

import pytest
import torch
from lora_helpers import prompts, run_base, run_prompts

from protoserve.engine.loader.load import load_model
from protoserve.engine.lora.stack import AdapterStack

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TOL = 1e-4


def _peft_logits(peft, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return peft(torch.tensor([prompt])).logits[0]


def _check(loaded, adapter_dir, peft, deterministic: bool = True) -> float:
    loaded.model.set_deterministic(deterministic)
    stack = AdapterStack(loaded.config, loaded.dtype, max_loras=2)
    stack.load("a", adapter_dir)
    loaded.model.adapters = stack
    slot = stack.slot_of("a")
    ps = prompts()
    ours = run_prompts(loaded.model, ps, [slot] * len(ps))
    base = run_base(loaded.model, ps)
    worst = 0.0
    for p, got, without in zip(ps, ours, base, strict=True):
        ref = _peft_logits(peft, p)
        assert (ref - without).abs().max() > 100 * TOL  # the adapter really changes the logits
        worst = max(worst, (got - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_all_targets_match_peft(tiny_family, make_adapter, family: str, deterministic: bool) -> None:
    path, _ = tiny_family(family)
    adapter_dir, peft = make_adapter(family)
    worst = _check(load_model(path, progress=False), adapter_dir, peft, deterministic)
    print(f"{family}: max |logit diff| vs PEFT = {worst:.2e}")
    assert worst < TOL


@pytest.mark.parametrize(
    ("family", "targets", "config"),
    [
        ("llama", ["q_proj", "v_proj"], {"lora_alpha": 32}),
        ("qwen2", ["k_proj", "o_proj", "down_proj"], {"lora_alpha": 16, "use_rslora": True}),
        ("qwen3", ["up_proj", "gate_proj"], {"lora_alpha": 4}),
    ],
    ids=["llama-qv-alpha32", "qwen2-kod-rslora", "qwen3-gateup-alpha4"],
)
def test_partial_targets_and_scaling_match_peft(tiny_family, make_adapter, family, targets, config) -> None:
    path, _ = tiny_family(family)
    adapter_dir, peft = make_adapter(family, targets, r=16, seed=3, **config)
    assert _check(load_model(path, progress=False), adapter_dir, peft) < TOL


def test_bfloat16_model_matches_peft_loosely(tiny_family, make_adapter) -> None:
    """A bf16 base computes the delta in bf16 beside its bf16 output: close to PEFT in float32."""
    path, _ = tiny_family("llama")
    adapter_dir, peft = make_adapter("llama")
    loaded = load_model(path, dtype="bfloat16", progress=False)
    stack = AdapterStack(loaded.config, loaded.dtype, max_loras=1)
    stack.load("a", adapter_dir)
    loaded.model.adapters = stack
    ps = prompts()
    ours = run_prompts(loaded.model, ps, [stack.slot_of("a")] * len(ps))
    base = run_base(loaded.model, ps)
    for p, got, without in zip(ps, ours, base, strict=True):
        ref = _peft_logits(peft, p)
        err = (got - ref).abs().mean().item()
        effect = (ref - without).abs().mean().item()
        assert err < 0.1 * effect, (err, effect)
