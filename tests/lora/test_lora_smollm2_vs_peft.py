"""Logits under a LoRA adapter against PEFT's PeftModel on the real default model, SmolLM2-135M (GGUF Q4_1).

Both sides run the same float32 weights: protoserve dequantizes the GGUF itself (quantization
"none"), transformers reads the same file with its own GGUF code, and the test checks the two
weight sets are bit-identical before comparing anything. The adapter is made here (PEFT
``LoraConfig``, r=8, all seven projections, random non-zero ``lora_B``) on transformers' model and
saved; protoserve loads the saved directory. Every prompt position's logits must match PeftModel
within TOL, the adapter must move them by far more than TOL, and greedy tokens served by LLMEngine
under the adapter must equal PeftModel's.

TOL: the weights are the same, so what is left is float32 rounding in a different order (the
CPU kernels' tiled GEMMs against oneDNN/MKL's, our paged attention against SDPA, and the adapter's
low-rank products as one fused ``A``/block-diagonal ``B`` pair against PEFT's one pair per
projection) over 30 layers. Measured: at most 1e-4 at any position of these prompts, with or without
the adapter (max |logit| about 26, where one float32 ulp is 2e-6); 5e-4 is also the bound
tests/models/test_smollm2_gguf_model.py holds the base model to against transformers. A real fault is
far outside it: scaling one projection of the last layer by 1.05 already puts the logits 0.04 off.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf_reference import fast_gguf_parsing
from lora_helpers import run_base, run_prompts

from protoserve.engine.loader.load import load_model
from protoserve.engine.lora.stack import AdapterStack
from protoserve.engine.models.linear import Linear, kernel

TOL = 5e-4
EFFECT = 1000 * TOL  # the smallest max |logit change| the adapter must make at each prompt's last position
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# lora_B ~ N(0, 0.1) (lora_A keeps PEFT's Kaiming init, scale alpha/r = 2): the adapter moves the last
# logits by 5-8, enough to change what the model says, not so much that the logits blow up.
B_STD = 0.1
GREEDY_TOKENS = 12
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def smollm2() -> Any:
    from protoserve.engine.loader.default_model import default_model_path

    return load_model(default_model_path(), dtype="float32", quantization="none", progress=False)


def _hf_from_gguf(path: Path) -> Any:
    """transformers' own GGUF loading of ``path`` (config mapping, dequantization, Q/K un-permute)."""
    from transformers import AutoModelForCausalLM

    with fast_gguf_parsing():
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="module")
def peft_smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """-> (saved adapter directory, PeftModel over transformers' SmolLM2 with that adapter)."""
    from peft import LoraConfig, get_peft_model

    from protoserve.engine.loader.default_model import default_model_path

    hf = _hf_from_gguf(default_model_path())
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:  # PEFT starts B at zero: a no-op adapter would pass any comparison
                    p.normal_(0.0, B_STD)
        directory = tmp_path_factory.mktemp("lora-smollm2")
        peft.save_pretrained(directory)
    return directory, peft.eval()


def _prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS] + [tokenizer.encode(tokenizer.apply_chat_template(CHAT))]


def _dense(layer: Linear) -> torch.Tensor:
    return kernel.dense_weight(layer.packed) if layer.packed is not None else layer.weight


def test_both_sides_run_the_same_dequantized_weights(smollm2, peft_smollm2) -> None:
    hf = peft_smollm2[1].get_base_model()
    state = hf.state_dict()

    def ref(layer: int, names: list[str]) -> torch.Tensor:
        # Inside PeftModel the targeted projections' base weights sit under ``base_layer``.
        return torch.cat([state[f"model.layers.{layer}.{n}.base_layer.weight"] for n in names])

    assert torch.equal(smollm2.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    for i, layer in enumerate(smollm2.model.layers):
        a, m = layer.self_attn, layer.mlp
        assert torch.equal(
            _dense(a.qkv_proj), ref(i, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])
        )
        assert torch.equal(_dense(a.o_proj), ref(i, ["self_attn.o_proj"]))
        assert torch.equal(_dense(m.gate_up_proj), ref(i, ["mlp.gate_proj", "mlp.up_proj"]))
        assert torch.equal(_dense(m.down_proj), ref(i, ["mlp.down_proj"]))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "fast"])
def test_logits_with_adapter_match_peft(smollm2, peft_smollm2, deterministic: bool) -> None:
    adapter_dir, peft = peft_smollm2
    model = smollm2.model
    model.set_deterministic(deterministic)
    try:
        stack = AdapterStack(smollm2.config, smollm2.dtype, max_loras=1)
        stack.load("sea", adapter_dir)
        model.adapters = stack
        ps = _prompts(smollm2.tokenizer)
        ours = run_prompts(model, ps, [stack.slot_of("sea")] * len(ps))
        base = run_base(model, ps)
    finally:
        model.adapters = None
        model.set_deterministic(True)
    top_changed = 0
    for p, got, without in zip(ps, ours, base, strict=True):
        with torch.no_grad():
            ref = peft(torch.tensor([p])).logits[0]
        err = (got - ref).abs().max().item()
        effect = (ref[-1] - without[-1]).abs().max().item()
        print(
            f"{len(p)} tokens: max |logit diff| vs PEFT {err:.2e} (last position "
            f"{(got[-1] - ref[-1]).abs().max().item():.2e}), adapter effect at the last {effect:.2f}"
        )
        assert err < TOL
        assert effect > EFFECT
        top_changed += int(ref[-1].argmax() != without[-1].argmax())
    assert top_changed >= 1  # the adapter changes what the model says, not only its logits


def _peft_greedy(peft: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = peft(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(n - 1):
            out = peft(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_engine_serves_peft_greedy_tokens_under_the_adapter(smollm2, peft_smollm2) -> None:
    """Through LLMEngine (scheduler, adapter slots, prefill then decode steps): a batch of requests
    under the adapter and one without; each adapter request's greedy tokens are PeftModel's."""
    import copy

    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.request import TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams

    adapter_dir, peft = peft_smollm2
    engine = LLMEngine(copy.copy(smollm2), EngineConfig(max_kv_blocks=64))
    try:
        engine.enable_lora(1).load("sea", adapter_dir)
        sp = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        ps = _prompts(smollm2.tokenizer)
        reqs = [TokenizedRequest(f"r{i}", p, sp, adapter="sea") for i, p in enumerate(ps)]
        reqs.append(TokenizedRequest("base", ps[0], sp))
        for r in reqs:
            engine.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    out[o.request_id].extend(d.token_ids)
    finally:
        smollm2.model.adapters = None
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == _peft_greedy(peft, p, GREEDY_TOKENS), smollm2.tokenizer.decode(p)
    with peft.disable_adapter():
        assert out["base"] == _peft_greedy(peft, ps[0], GREEDY_TOKENS)
    assert out["base"] != out["r0"]
