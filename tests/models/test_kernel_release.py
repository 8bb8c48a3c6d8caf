"""Packed layers keep their weights once: the PyTorch path's copy is dropped after packing and
rebuilt bit for bit from the pack when a layer goes back to that path."""

from __future__ import annotations

import copy

import pytest
import torch

from protoserve.engine.loader.load import load_model
from protoserve.engine.models.linear import Int4Linear, Int8Linear, KernelPackable, Linear
from protoserve.kernels.cpu import packed_linear

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="the CPU kernels do not run here")

TORCH_TENSORS = {Linear: ("weight",), Int8Linear: ("weight_int8",), Int4Linear: ("weight_int4", "scales_and_zeros")}


def _layer(kind: type, dtype: torch.dtype = torch.float32) -> KernelPackable:
    g = torch.Generator().manual_seed(3)
    n = 48 if kind is Int4Linear else 40  # 40 channels: the packs pad them (int4 takes multiples of 16)
    lin = Linear(96, n, bias=True, dtype=dtype)
    lin.weight.data = (torch.randn(n, 96, generator=g) * 0.05).to(dtype)
    lin.bias.data = torch.randn(n, generator=g).to(dtype)
    if kind is Int8Linear:
        return Int8Linear.from_linear(lin)
    if kind is Int4Linear:
        return Int4Linear.from_linear(lin, 32)
    return lin


@pytest.mark.parametrize(
    "kind,dtype",
    [(Linear, torch.float32), (Linear, torch.bfloat16), (Int8Linear, torch.float32), (Int4Linear, torch.float32)],
)
def test_release_then_unpack_gives_back_the_same_tensors(kind: type, dtype: torch.dtype) -> None:
    layer = _layer(kind, dtype)
    never_packed = copy.deepcopy(layer)
    originals = {name: getattr(layer, name).detach().clone() for name in TORCH_TENSORS[kind]}
    assert layer.pack_for_kernel(release=True)
    assert layer.released and all(getattr(layer, name) is None for name in originals)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(4)).to(dtype)
    on_kernel = layer(x)
    pack = layer.packed

    layer.unpack_from_kernel()
    assert layer.packed is None and not layer.released
    for name, tensor in originals.items():
        restored = getattr(layer, name)
        assert restored.dtype == tensor.dtype and torch.equal(restored, tensor), name
    assert torch.equal(layer(x), never_packed(x))  # the PyTorch path, as if never packed
    # ... and it packs again into the very same pack.
    assert layer.pack_for_kernel(release=True)
    assert torch.equal(layer.packed.data, pack.data)
    assert torch.equal(layer(x), on_kernel)


def test_without_release_the_layer_keeps_both() -> None:
    layer = _layer(Int8Linear)
    assert layer.pack_for_kernel()
    assert not layer.released and layer.weight_int8 is not None
    layer.unpack_from_kernel()
    assert layer.packed is None and layer.weight_int8 is not None


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_loaded_model_holds_each_weight_once(tiny_checkpoint, mode: str) -> None:
    """load_model: every packed layer released, except a head tied to the embedding, which the
    lookup still reads; weight_bytes counts the state dict and the packs."""
    path, _ = tiny_checkpoint("llama")
    model = load_model(path, quantization=mode, progress=False).model
    packable = [m for m in model.modules() if isinstance(m, KernelPackable)]
    assert packable and all(m.packed is not None for m in packable)
    tied = getattr(model.lm_head, "weight", None) is model.embed_tokens.weight
    for m in packable:
        if m is model.lm_head and tied:
            assert not m.released and m.weight is model.embed_tokens.weight
        else:
            assert m.released and all(getattr(m, n) is None for n in TORCH_TENSORS[type(m)])
    state = {t.data_ptr(): t for t in model.state_dict().values()}
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    assert model.weight_bytes() == state_bytes + sum(m.packed.nbytes for m in packable)


def test_failed_quantization_leaves_a_packed_model_packed(tiny_checkpoint) -> None:
    """A group size int4 cannot take is refused before any layer leaves its pack."""
    from protoserve.engine.models.linear import quantize_linears

    model = load_model(tiny_checkpoint("llama")[0], progress=False).model
    packs = {name: m.packed for name, m in model.named_modules() if isinstance(m, KernelPackable)}
    with pytest.raises(ValueError, match="group size"):
        quantize_linears(model, "int4", group_size=48)
    after = {name: m for name, m in model.named_modules() if isinstance(m, KernelPackable)}
    assert all(after[name].packed is pack for name, pack in packs.items())
    assert model.fused_step is not None
