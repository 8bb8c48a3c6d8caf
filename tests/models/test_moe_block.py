"""engine/models/moe.py: MoE blocks against transformers, the token-routed family against its
definition, integer routing, batch invariance, and int8/int4 expert packs.

Mixtral, Qwen3-MoE and Qwen2-MoE (shared expert) blocks get transformers' own sparse MoE
blocks' random weights (in the Hub's per-expert form and in transformers 5's fused one) and
must give their outputs within 1e-5, on the module path and on the CPU kernel. The token-routed
block is checked against a float64 loop written here from its definition. A token's output
must be bit-identical alone and in a batch of 64 whose other tokens share its experts.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from protoserve.engine.models import moe as moe_module
from protoserve.engine.models.linear import (
    Int4Linear,
    Int8Linear,
    KernelPackable,
    Linear,
    dequantize_int4,
    dequantize_int8,
    quantize_linears,
)
from protoserve.engine.models.moe import (
    MIXTRAL_EXPERT_NAMES,
    QWEN_EXPERT_NAMES,
    ExpertNames,
    FloatProjection,
    GroupedExperts,
    MoEBlock,
    MoEConfig,
    Routing,
    per_token_forward,
    softmax_top_k,
    token_route,
)
from protoserve.kernels.cpu import moe_experts, packed_linear

HIDDEN, INTER, EXPERTS = 64, 96, 8
needs_kernel = pytest.mark.skipif(not moe_experts.available(), reason="no CPU kernels on this machine")


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval()


def _hub_form(state: dict[str, torch.Tensor], prefix: str, names: ExpertNames) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts split back into the per-expert tensors checkpoints store."""
    out = {f"{prefix}{k}": v.clone() for k, v in state.items() if not k.startswith("experts.")}
    gate_up, down = state["experts.gate_up_proj"], state["experts.down_proj"]
    for e in range(gate_up.shape[0]):
        gate, up = gate_up[e].chunk(2)
        out[f"{prefix}experts.{e}.{names.gate}.weight"] = gate.clone()
        out[f"{prefix}experts.{e}.{names.up}.weight"] = up.clone()
        out[f"{prefix}experts.{e}.{names.down}.weight"] = down[e].clone()
    return out


def _pack(block: torch.nn.Module) -> None:
    for m in block.modules():
        if isinstance(m, KernelPackable):
            assert m.pack_for_kernel()


def _hf_mixtral():
    cfg = MixtralConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        experts_implementation="eager",
    )
    return _randomize(MixtralSparseMoeBlock(cfg), 1), MoEConfig(HIDDEN, INTER, EXPERTS, 2)


def _hf_qwen3(norm: bool):
    cfg = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        num_experts=EXPERTS,
        num_experts_per_tok=3,
        norm_topk_prob=norm,
        experts_implementation="eager",
    )
    return _randomize(Qwen3MoeSparseMoeBlock(cfg), 2), MoEConfig(
        HIDDEN, INTER, EXPERTS, 3, normalize_top_k=norm
    )


def _hf_qwen2():
    cfg = Qwen2MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=128,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        experts_implementation="eager",
    )
    ours = MoEConfig(
        HIDDEN,
        INTER,
        EXPERTS,
        2,
        normalize_top_k=False,
        shared_intermediate_size=128,
        shared_expert_gate=True,
    )
    return _randomize(Qwen2MoeSparseMoeBlock(cfg), 3), ours


CASES = {
    "mixtral": (_hf_mixtral, MIXTRAL_EXPERT_NAMES, "model.layers.0.block_sparse_moe.", True),
    "qwen3_moe": (lambda: _hf_qwen3(True), QWEN_EXPERT_NAMES, "model.layers.0.mlp.", False),
    "qwen3_moe_unnormalized": (lambda: _hf_qwen3(False), QWEN_EXPERT_NAMES, "model.layers.0.mlp.", True),
    "qwen2_moe_shared": (_hf_qwen2, QWEN_EXPERT_NAMES, "model.layers.0.mlp.", True),
}


def _ours_from_hf(case: str) -> tuple[torch.nn.Module, MoEBlock]:
    make, names, prefix, hub = CASES[case]
    hf, config = make()
    state = hf.state_dict()
    weights = (
        _hub_form(state, prefix, names) if hub else {f"{prefix}{k}": v.clone() for k, v in state.items()}
    )
    block = MoEBlock(config)
    shapes = block.hf_weight_shapes(prefix, names)
    if hub:
        assert shapes == {k: tuple(v.shape) for k, v in weights.items()}
    block.load_hf_weights(weights, prefix, names)
    assert not weights, f"weights left unconsumed: {list(weights)}"
    return hf, block


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_kernel)], ids=["module", "kernel"])
def test_block_matches_transformers(case: str, packed: bool) -> None:
    hf, block = _ours_from_hf(case)
    if packed:
        _pack(block)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = hf(x[None])[0]
    out = block(x)
    assert out.shape == expected.shape
    assert (out - expected).abs().max() <= 1e-5


def test_routers_match_transformers() -> None:
    """The same expert ids, in the same order, and weights as transformers' routers."""
    hf, block = _ours_from_hf("qwen3_moe_unnormalized")
    x = torch.randn(30, HIDDEN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf.gate(x)
    routing = block.route(x, None)
    assert routing.experts.dtype == torch.int64 and routing.weights.dtype == torch.float32
    assert torch.equal(routing.experts, hf_ids)
    assert torch.allclose(routing.weights, hf_weights, atol=1e-7)
    assert not torch.allclose(routing.weights.sum(-1), torch.ones(30))  # unnormalised: top 3 of 8 sum below 1
    assert torch.allclose(softmax_top_k(block.gate(x), 3, True).weights.sum(-1), torch.ones(30))


# -- the token-routed family -------------------------------------------------------------------


def _token_block(shift: int = 0, experts: int = EXPERTS, seed: int = 4) -> MoEBlock:
    block = MoEBlock(MoEConfig(HIDDEN, INTER, experts, 1, routing="token", token_shift=shift))
    g = torch.Generator().manual_seed(seed)
    block.set_experts(
        torch.randn(experts, 2 * INTER, HIDDEN, generator=g) * 0.1,
        torch.randn(experts, HIDDEN, INTER, generator=g) * 0.1,
    )
    return block


def _token_routed_reference(block: MoEBlock, x: torch.Tensor, ids: list[int], shift: int) -> torch.Tensor:
    """The definition: token t through expert (id >> shift) mod num_experts alone, in float64."""
    n = block.config.num_experts
    rows = []
    for t, token_id in enumerate(ids):
        e = (token_id >> shift) % n
        w_gate_up = block.experts.gate_up[e].weight.double()
        w_down = block.experts.down[e].weight.double()
        gate, up = (w_gate_up @ x[t].double()).chunk(2)
        rows.append(w_down @ (F.silu(gate) * up))
    return torch.stack(rows).float()


@pytest.mark.parametrize("shift", [0, 3])
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_kernel)], ids=["module", "kernel"])
def test_token_routed_block_matches_its_definition(shift: int, packed: bool) -> None:
    block = _token_block(shift)
    if packed:
        _pack(block)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 50_000, (33,), generator=g)
    x = torch.randn(33, HIDDEN, generator=g)
    out = block(x, ids)
    assert (out - _token_routed_reference(block, x, ids.tolist(), shift)).abs().max() <= 1e-5


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**40), min_size=1, max_size=70),
    log_experts=st.integers(0, 6),
    shift=st.integers(0, 20),
    seed=st.integers(0, 2**16),
)
def test_token_routing_is_integer_arithmetic_on_the_ids_alone(ids, log_experts, shift, seed) -> None:
    n = 2**log_experts
    block = MoEBlock(MoEConfig(16, 16, n, 1, routing="token", token_shift=shift))
    token_ids = torch.tensor(ids, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    a = block.route(torch.randn(len(ids), 16, generator=g), token_ids)
    b = block.route(torch.randn(len(ids), 16, generator=g) * 1e6, token_ids)  # other hidden states entirely
    assert a.experts.dtype == torch.int64 and a.experts.shape == (len(ids), 1)
    assert a.experts[:, 0].tolist() == [(i >> shift) & (n - 1) for i in ids]
    assert torch.equal(a.experts, b.experts) and torch.equal(a.weights, b.weights)
    assert torch.equal(a.weights, torch.ones(len(ids), 1))
    assert block.gate is None and not any(isinstance(m, FloatProjection) for m in block.modules())


def test_token_routing_rejects_bad_input() -> None:
    block = _token_block()
    x = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match="token_ids are required"):
        block(x)
    with pytest.raises(ValueError, match="token_ids must be"):
        block(x, torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(ValueError, match="int64"):
        token_route(torch.tensor([1, 2, 3], dtype=torch.int32), EXPERTS)
    with pytest.raises(ValueError, match="non-negative"):
        token_route(torch.tensor([1, -2, 3]), EXPERTS)
    with pytest.raises(ValueError, match="power of two"):
        MoEConfig(HIDDEN, INTER, 6, 1, routing="token")
    with pytest.raises(ValueError, match="top_k must be 1"):
        MoEConfig(HIDDEN, INTER, 8, 2, routing="token")
    with pytest.raises(ValueError, match="token_shift applies"):
        MoEConfig(HIDDEN, INTER, 8, 2, token_shift=2)
    with pytest.raises(ValueError, match="MoEConfig.routing"):
        MoEConfig(HIDDEN, INTER, 8, 2, routing="hash")
    with pytest.raises(ValueError, match="MoEConfig.hidden_act"):
        MoEConfig(HIDDEN, INTER, 8, 2, hidden_act="gelu")


def test_out_of_range_experts_are_refused_by_one_check(monkeypatch) -> None:
    experts = GroupedExperts(2, HIDDEN, INTER, torch.float32)
    x = torch.randn(3, HIDDEN)
    bad = Routing(torch.tensor([[0], [2], [1]]), torch.ones(3, 1))
    with pytest.raises(ValueError, match=r"routing.experts must lie in 0\.\.1"):
        experts(x, bad)
    # Stacked for a device's fused kernel, the ids' range is the kernel's to check (align_pairs): on a
    # GPU each check reads the ids back, a device sync, so the layer leaves it to the kernel.
    assert experts.stack_for_fused_kernel()
    calls = []

    def fused_moe(x, w_gate_up, w_down, ids, weights):
        calls.append(ids)
        raise ValueError("expert_ids must lie in 0..1, got 0..2")

    monkeypatch.setattr(moe_module, "ops_for", lambda device: SimpleNamespace(fused_moe=fused_moe))
    with pytest.raises(ValueError, match="expert_ids must lie in"):
        experts(x, bad)
    assert len(calls) == 1 and torch.equal(calls[0], bad.experts)


# -- batch invariance and quantized experts ---------------------------------------------------

VARIANTS = [
    "module",
    pytest.param("kernel", marks=needs_kernel),
    "int8",
    "int4",
    pytest.param("int8-kernel", marks=needs_kernel),
    pytest.param("int4-kernel", marks=needs_kernel),
]


def _variant(block: MoEBlock, variant: str) -> MoEBlock:
    if variant.startswith(("int8", "int4")):
        quantize_linears(block, variant[:4], group_size=32)
    if variant.endswith("kernel"):
        _pack(block)
    return block


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["mixtral", "token"])
def test_a_token_alone_equals_the_token_in_a_batch_of_64(family: str, variant: str) -> None:
    g = torch.Generator().manual_seed(11)
    if family == "token":
        block = _variant(_token_block(), variant)
        ids = torch.randint(0, 4096, (64,), generator=g)
        ids[::2] = ids[0] + EXPERTS * torch.arange(32)  # half the batch shares token 0's expert
    else:
        block = _variant(_ours_from_hf("mixtral")[1], variant)
        ids = torch.randint(0, 4096, (64,), generator=g)
    x = torch.randn(64, HIDDEN, generator=g)
    if family == "mixtral":
        x[1::2] = x[0] + 1e-3 * torch.randn(32, HIDDEN, generator=g)  # half the batch routes as token 0 does
        routed = block.route(x, None).experts
        assert (routed == routed[0]).all(dim=1).sum() >= 16
    batch = block(x, ids)
    for t in (0, 1, 37, 63):
        assert torch.equal(block(x[t : t + 1], ids[t : t + 1])[0], batch[t])
    routing = block.route(x, ids)
    assert torch.equal(per_token_forward(block.experts, x, routing), block.experts(x, routing))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_kernel)], ids=["module", "kernel"])
def test_quantized_experts_against_the_dequantized_block(mode: str, packed: bool) -> None:
    _, block = _ours_from_hf("qwen2_moe_shared")
    report = quantize_linears(block, mode, group_size=32)
    assert report.num_layers_quantized == 2 * EXPERTS + 2  # every expert and the shared expert; not the gates
    assert isinstance(block.gate, FloatProjection) and block.gate.weight.dtype == torch.float32
    assert isinstance(block.shared_expert_gate, FloatProjection)
    if packed:
        _pack(block)
    dequantized = copy.deepcopy(block)
    for m in list(dequantized.modules()):
        for name, child in list(m.named_children()):
            if isinstance(child, (Int8Linear, Int4Linear)):
                setattr(m, name, _dense(_dequantize(child)))
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(12))
    out, ref = block(x), dequantized(x)
    # On the kernel: float32 products of the stored codes (int*_dot: activations rounded to ~15
    # bits). Without it: PyTorch's weight-only ops, which compute in bfloat16.
    tol = 1e-3 if packed else 3e-2
    assert (out - ref).abs().max() <= tol * ref.abs().max()
    if packed:
        routing = block.route(x, None)
        experts = block.experts
        expected = moe_experts.reference_grouped_experts(
            x,
            routing.experts,
            routing.weights,
            [m.packed for m in experts.gate_up],
            [m.packed for m in experts.down],
        )
        assert (experts(x, routing) - expected).abs().max() <= 2e-4 * expected.abs().max()


def _dequantize(layer: Int8Linear | Int4Linear) -> torch.Tensor:
    """The float weight the layer's codes stand for (the pack's own values once packed)."""
    if layer.packed is not None:
        return packed_linear.unpack(layer.packed)
    if isinstance(layer, Int8Linear):
        return dequantize_int8(layer.weight_int8, layer.scales)
    q, scales, mins = layer._kernel_form  # quantize_int4's codes, kept until the layer is packed
    return dequantize_int4(q, scales, mins, layer.group_size)


def _dense(weight: torch.Tensor) -> torch.nn.Module:
    layer = Linear(weight.shape[1], weight.shape[0])
    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    return layer


def test_bad_weights_are_named() -> None:
    make, names, prefix, hub = CASES["mixtral"]
    hf, config = make()
    weights = _hub_form(hf.state_dict(), prefix, names)
    del weights[f"{prefix}experts.3.w2.weight"]
    with pytest.raises(ValueError, match=r"experts\.3\.w2\.weight"):
        MoEBlock(config).load_hf_weights(weights, prefix, names)
    weights = _hub_form(hf.state_dict(), prefix, names)
    weights[f"{prefix}gate.weight"] = weights[f"{prefix}gate.weight"][:4]
    with pytest.raises(ValueError, match=r"gate\.weight has shape"):
        MoEBlock(config).load_hf_weights(weights, prefix, names)


def test_parameter_counts() -> None:
    total, active = MoEConfig(
        HIDDEN, INTER, EXPERTS, 2, shared_intermediate_size=128, shared_expert_gate=True
    ).parameter_counts()
    block = _ours_from_hf("qwen2_moe_shared")[1]
    assert total == sum(p.numel() for p in block.parameters())
    assert active == total - (EXPERTS - 2) * 3 * HIDDEN * INTER


@needs_kernel
def test_the_kernel_follows_the_layers_it_runs() -> None:
    """Quantizing a block whose experts already ran on the kernel rebinds the C++ pass to the new
    packs, and a copy of the block binds its own."""
    _, block = _ours_from_hf("mixtral")
    _pack(block)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(13))
    before = block(x)
    twin = copy.deepcopy(block)
    assert torch.equal(twin(x), before)
    quantize_linears(block, "int8")
    _pack(block)
    routing = block.route(x, None)
    after = block(x)
    assert not torch.equal(after, before)
    assert torch.equal(after, block.experts.grouped(x, routing))
    assert torch.equal(twin(x), before)
