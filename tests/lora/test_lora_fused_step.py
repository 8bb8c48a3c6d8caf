"""LoRA inside the fused decoder step (kernels/cpu/lora.cpp): the kernel against its PyTorch
reference, the fused path against the module path (engine/lora/batch.py), and a batch with
adapter rows served by the fused step, row for row as each prompt alone, with a team of threads."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import prompts, run_base, run_prompts

from protoserve.engine.loader.load import load_model
from protoserve.engine.lora.stack import NO_ADAPTER, AdapterStack
from protoserve.engine.models.decoder import DecoderLayer
from protoserve.engine.models.fused_step import lora_linear
from protoserve.kernels.cpu.extension import load

ext = load("decoder_step")
pytestmark = pytest.mark.skipif(ext is None, reason="the C++ kernels did not build here")

TARGET_SETS = (None, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "o_proj"])


def _lora_linear(g: torch.Generator, in_f: int, out_f: int, rank: int, slices: list[tuple[int, int]],
                 dtype: torch.dtype = torch.float32):
    a = torch.randn(rank * len(slices), in_f, generator=g).to(dtype).float()
    b = torch.zeros(out_f, rank * len(slices))
    for j, (begin, end) in enumerate(slices):
        b[begin:end, j * rank : (j + 1) * rank] = torch.randn(end - begin, rank, generator=g)
    b = b.to(dtype).float()
    return lora_linear(ext, a, b, slices, rank, dtype), a, b


@pytest.mark.parametrize(("in_f", "out_f", "rank", "slices"), [
    (64, 96, 8, [(0, 64), (64, 80), (80, 96)]),  # q/k/v-like, every width a multiple of 16
    (37, 53, 3, [(5, 29)]),  # tails everywhere, a slice not at 0
    (19, 40, 16, [(0, 20), (20, 40)]),  # gate/up-like
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(in_f: int, out_f: int, rank: int, slices: list[tuple[int, int]],
                                  dtype: torch.dtype) -> None:
    """float32 weights against the float64 reference; bfloat16 weights (multiplied in bf16 pairs,
    each row's x and A x rounded to bf16 once) against the float64 reference of those roundings."""
    if dtype == torch.bfloat16 and not ext.lora_multiplies_in_bf16():
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 LoRA weights are not used here")
    g = torch.Generator().manual_seed(0)
    w, a, b = _lora_linear(g, in_f, out_f, rank, slices, dtype)
    x = torch.randn(11, in_f, generator=g)
    base = torch.randn(11, out_f, generator=g)
    rows = torch.tensor([9, 0, 3, 4, 7, 1, 10, 2, 5, 6], dtype=torch.int64)  # a block of 8 rows, then 2
    out = base.clone()
    ext.lora_add_(out, x, w, rows)
    want = base.clone()
    if dtype == torch.float32:
        want[rows] += (x[rows].double() @ a.double().t() @ b.double().t()).float()
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        xb = x[rows].bfloat16().double()
        t = (xb @ a.double().t()).float().bfloat16().double()
        want[rows] += (t @ b.double().t()).float()
        torch.testing.assert_close(out, want, rtol=1e-3, atol=2e-2)  # A x's bf16 rounding, summed over the rank
    untouched = torch.ones(11, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(out[untouched], base[untouched])  # rows outside the group keep their bits
    # Each row alone gives the bits it got among the others: the update is per row.
    for r in rows.tolist():
        alone = base.clone()
        ext.lora_add_(alone, x, w, torch.tensor([r]))
        assert torch.equal(alone[r], out[r])


def test_kernel_refuses_bad_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    w, _, _ = _lora_linear(g, 16, 32, 4, [(0, 32)])
    with pytest.raises(RuntimeError, match="LoRA A must be"):
        ext.lora_add_(torch.zeros(2, 32), torch.zeros(2, 17), w, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="outside the batch"):
        ext.lora_add_(torch.zeros(2, 32), torch.zeros(2, 16), w, torch.tensor([2]))
    bad = ext.LoraLinear(a=torch.zeros(4, 16), bt=torch.zeros(4, 48), slice_begin=[0], slice_end=[33], rank=4)
    with pytest.raises(RuntimeError, match="outside 32 outputs"):
        ext.lora_add_(torch.zeros(2, 32), torch.zeros(2, 16), bad, torch.tensor([0]))
    unpadded = ext.LoraLinear(a=torch.zeros(4, 16), bt=torch.zeros(4, 32), slice_begin=[0], slice_end=[32], rank=4)
    with pytest.raises(RuntimeError, match="zero padding"):
        ext.lora_add_(torch.zeros(2, 32), torch.zeros(2, 16), unpadded, torch.tensor([0]))
    mixed = ext.LoraLinear(a=torch.zeros(4, 16), bt=torch.zeros(4, 48, dtype=torch.bfloat16), slice_begin=[0],
                           slice_end=[32], rank=4)
    with pytest.raises(RuntimeError, match="must both be float32 or both bfloat16"):
        ext.lora_add_(torch.zeros(2, 32), torch.zeros(2, 16), mixed, torch.tensor([0]))


def _stack(loaded, make_adapter, family: str) -> AdapterStack:
    stack = AdapterStack(loaded.config, loaded.dtype, max_loras=3)
    for i, targets in enumerate(TARGET_SETS):
        stack.load(f"a{i}", make_adapter(family, targets, seed=10 + i)[0])
    loaded.model.adapters = stack
    return stack


def _module_path_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a batch with adapter rows left the fused step")

    monkeypatch.setattr(DecoderLayer, "forward", forbidden)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_serves_mixed_adapter_batch(tiny_family, make_adapter, monkeypatch, family: str,
                                               threads: int) -> None:
    """Three adapters and the base in one prefill forward on the fused step: each row's logits equal
    the module path's within float tolerance, each prompt alone gives its bits, base rows are the base's."""
    loaded = load_model(tiny_family(family)[0], progress=False)
    model = loaded.model
    assert model.fused_step is not None
    stack = _stack(loaded, make_adapter, family)
    ps = prompts(lens=(7, 19, 4, 12))
    slots = [stack.slot_of("a0"), NO_ADAPTER, stack.slot_of("a2"), stack.slot_of("a1")]
    fused_step, model.fused_step = model.fused_step, None
    reference = run_prompts(model, ps, slots)
    model.fused_step = fused_step
    torch.set_num_threads(threads)
    with monkeypatch.context() as mp:
        _module_path_forbidden(mp)
        together = run_prompts(model, ps, slots)
        alone = [run_prompts(model, [p], [s])[0] for p, s in zip(ps, slots, strict=True)]
        base = run_base(model, ps)
    for i, slot in enumerate(slots):
        torch.testing.assert_close(together[i], reference[i], rtol=1e-4, atol=1e-4)
        assert torch.equal(together[i], alone[i]), f"row {i}: mixed batch differs from alone"
        assert (slot == NO_ADAPTER) == torch.equal(together[i], base[i])
        if slot != NO_ADAPTER:
            assert (together[i] - base[i]).abs().max() > 1e-2  # the adapter really applies


def test_bfloat16_model_fused_close_to_module_path(tiny_family, make_adapter) -> None:
    """bf16 weights and adapters: the fused step widens them to float32, so it sits near the module
    path's per-operation bf16 rounding, not on it."""
    loaded = load_model(tiny_family("llama")[0], dtype="bfloat16", progress=False)
    model = loaded.model
    assert model.fused_step is not None
    stack = _stack(loaded, make_adapter, "llama")
    ps = prompts()
    slots = [stack.slot_of("a0"), stack.slot_of("a2"), NO_ADAPTER]
    fused = run_prompts(model, ps, slots)
    model.fused_step = None
    module = run_prompts(model, ps, slots)
    for f, m in zip(fused, module, strict=True):
        assert (f - m).abs().mean() < 0.05 * m.abs().mean()
