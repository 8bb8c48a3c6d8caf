"""Multi-LoRA batching: rows of three adapters and the base model in one forward, each row as if alone;
and adapters over int8 / int4 base layers against the dequantized base."""

from __future__ import annotations

import copy

import pytest
import torch
from lora_helpers import prompts, run_base, run_prompts

from protoserve.engine.loader.load import load_model
from protoserve.engine.lora.batch import group_rows
from protoserve.engine.lora.stack import NO_ADAPTER, AdapterStack
from protoserve.engine.models.linear import Int4Linear, Int8Linear, Linear, dequantize_int4, dequantize_int8

TARGET_SETS = (None, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "o_proj"])


def _stack(loaded, make_adapter, family: str, max_loras: int = 3) -> AdapterStack:
    stack = AdapterStack(loaded.config, loaded.dtype, max_loras=max_loras)
    for i, targets in enumerate(TARGET_SETS):
        stack.load(f"a{i}", make_adapter(family, targets, seed=10 + i)[0])
    loaded.model.adapters = stack
    return stack


def test_group_rows() -> None:
    assert group_rows(torch.tensor([-1, -1])) == []
    [(slot, rows)] = group_rows(torch.tensor([2, 2, 2]))
    assert slot == 2 and rows is None
    groups = group_rows(torch.tensor([1, -1, 0, 1, 0]))
    assert [(s, r.tolist()) for s, r in groups] == [(0, [2, 4]), (1, [0, 3])]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_batch_rows_equal_each_alone(tiny_family, make_adapter, family: str) -> None:
    """Bit-identical logits at every position: three adapters and the base in one prefill forward
    against each prompt run alone (deterministic mode), and each adapter changes its rows."""
    loaded = load_model(tiny_family(family)[0], progress=False)
    stack = _stack(loaded, make_adapter, family)
    ps = prompts(lens=(7, 19, 4, 12))
    slots = [stack.slot_of("a0"), NO_ADAPTER, stack.slot_of("a2"), stack.slot_of("a1")]
    together = run_prompts(loaded.model, ps, slots)
    for p, slot, got in zip(ps, slots, together, strict=True):
        [alone] = run_prompts(loaded.model, [p], [slot])
        assert torch.equal(got, alone)
        [base] = run_base(loaded.model, [p])
        assert (slot == NO_ADAPTER) == torch.equal(got, base)


def test_mixed_engine_batch_gives_each_request_its_solo_tokens(tiny_family, make_adapter) -> None:
    """Through LLMEngine: greedy tokens of requests under three adapters and none, all batched, equal
    each request run alone."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.request import TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams

    loaded = load_model(tiny_family("llama")[0], progress=False)

    def engine() -> LLMEngine:
        e = LLMEngine(copy.copy(loaded), EngineConfig(max_kv_blocks=256))
        stack = e.enable_lora(3)
        for i, targets in enumerate(TARGET_SETS):
            stack.load(f"a{i}", make_adapter("llama", targets, seed=10 + i)[0])
        return e

    def run(e: LLMEngine, reqs: list[TokenizedRequest]) -> dict[str, list[int]]:
        for r in reqs:
            e.add_request(r)
        out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        while e.has_unfinished():
            for o in e.step():
                for d in o.deltas:
                    out[o.request_id].extend(d.token_ids)
        return out

    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ps = prompts(lens=(9, 14, 6, 11))
    adapters = ["a0", None, "a1", "a2"]
    reqs = [TokenizedRequest(f"r{i}", p, sp, adapter=a) for i, (p, a) in enumerate(zip(ps, adapters, strict=True))]
    e = engine()
    together = run(e, reqs)
    solo = {}
    for r in reqs:
        solo.update(run(engine(), [copy.copy(r)]))
    assert together == solo
    assert len({tuple(v) for v in together.values()}) == 4
    # Same prompt under each adapter and none: different continuations, so the adapters really apply.
    same = [TokenizedRequest(f"s{i}", ps[0], sp, adapter=a) for i, a in enumerate(adapters)]
    outs = run(e, same)
    assert len({tuple(v) for v in outs.values()}) == 4
    assert [a.active_requests for a in e.adapters.list()] == [0, 0, 0]  # every pin released


def _dequantized_twin(quant_model, float_model) -> None:
    """Give ``float_model`` (same checkpoint) the weights ``quant_model``'s quantized layers compute with."""
    q = copy.deepcopy(quant_model)
    float_model.fused_step = None
    for name, m in float_model.named_modules():
        if not isinstance(m, Linear) or name == "lm_head":
            continue
        qm = q.get_submodule(name)
        qm.unpack_from_kernel()
        if isinstance(qm, Int8Linear):
            w = dequantize_int8(qm.weight_int8, qm.scales)
        elif isinstance(qm, Int4Linear):
            codes, scales, mins = qm._kernel_form
            w = dequantize_int4(codes, scales, mins, qm.group_size)
        else:
            raise AssertionError(f"{name} is not quantized: {type(qm).__name__}")
        m.unpack_from_kernel()
        m.weight = torch.nn.Parameter(w.to(m.weight.dtype), requires_grad=False)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_with_adapter_matches_dequantized_reference(tiny_family, make_adapter, quantization) -> None:
    path = tiny_family("llama")[0]
    quant = load_model(path, quantization=quantization, progress=False)
    assert any(isinstance(m, Int8Linear | Int4Linear) for m in quant.model.modules())
    ref = load_model(path, progress=False)
    _dequantized_twin(quant.model, ref.model)
    adapter_dir, _ = make_adapter("llama")
    ps = prompts()
    results = {}
    for key, loaded in (("quant", quant), ("ref", ref)):
        stack = AdapterStack(loaded.config, loaded.dtype, max_loras=1)
        stack.load("a", adapter_dir)
        loaded.model.adapters = stack
        results[key] = (torch.cat(run_prompts(loaded.model, ps, [stack.slot_of("a")] * 3)),
                        torch.cat(run_base(loaded.model, ps)))
    (q_lora, q_base), (r_lora, r_base) = results["quant"], results["ref"]
    effect = (r_lora - r_base).abs().mean().item()
    err = (q_lora - r_lora).abs().mean().item()
    base_err = (q_base - r_base).abs().mean().item()  # what the quantized kernels' rounding costs alone
    print(f"{quantization}: adapter effect {effect:.3f}, |lora - ref| {err:.2e}, |base - ref| {base_err:.2e}")
    assert effect > 0.5
    assert err < max(5 * base_err, 1e-4) and err < 0.02 * effect
