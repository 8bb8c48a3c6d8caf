"""Sharding a Decoder for one rank, in one process: refusals, exact quantized slices, the step codec."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from forward_batches import forward_batch, scheduled

from protoserve.engine.config import EngineConfig
from protoserve.engine.loader.load import load_model
from protoserve.engine.parallel.row_parallel import RowParallel
from protoserve.engine.parallel.runner import make_runner
from protoserve.engine.parallel.sharding import check_shardable, shard_decoder
from protoserve.engine.parallel.step_channel import decode, encode


def _load(path, quantization="none", rank=None):
    shard = None if rank is None else functools.partial(shard_decoder, rank=rank, world_size=2)
    return load_model(str(path), quantization=quantization, progress=False, load_tokenizer=False, shard=shard)


@pytest.mark.parametrize(("size", "field"), [(3, "num_heads"), (4, "num_kv_heads")])
def test_refuses_a_size_that_does_not_divide_the_heads(checkpoint, size, field):
    loaded = _load(checkpoint("qwen2"))  # 4 heads, 2 KV heads
    model = loaded.model
    qkv = model.layers[0].self_attn.qkv_proj
    with pytest.raises(ValueError, match=f"does not divide the model's {field}"):
        shard_decoder(model, 0, size)
    assert model.config is loaded.config and model.layers[0].self_attn.qkv_proj is qkv  # untouched


def test_refuses_an_intermediate_size_that_does_not_divide(checkpoint):
    config = _load(checkpoint("qwen2")).config
    check_shardable(config, 2)
    with pytest.raises(ValueError, match=r"does not divide the model's intermediate_size \(129\)"):
        check_shardable(dataclasses.replace(config, intermediate_size=129), 2)


def test_refuses_moe(checkpoint):
    config = dataclasses.replace(_load(checkpoint("qwen2")).config, num_experts=4, experts_per_token=2,
                                 moe_intermediate_size=64)
    with pytest.raises(ValueError, match="MoE layers is not built"):
        check_shardable(config, 2)


def _codes(layer: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """A quantized layer's stored codes and scales (its kernel pack unpacked back)."""
    layer = layer.layer if isinstance(layer, RowParallel) else layer
    layer.unpack_from_kernel()
    if hasattr(layer, "weight_int8"):
        return layer.weight_int8, layer.scales.float()
    q, scales, mins = layer._kernel_form
    return q, scales.float(), mins.float()


@pytest.mark.parametrize(("family", "quantization"), [("qwen2", "int8"), ("qwen3", "int4")])
def test_quantized_shards_are_exact_slices_of_the_unsharded_codes(checkpoint, family, quantization):
    path = checkpoint(family)
    full = _load(path, quantization).model
    ranks = [_load(path, quantization, rank).model for rank in (0, 1)]
    c = full.config
    assert [m.config.num_kv_heads for m in ranks] == [c.num_kv_heads // 2] * 2
    assert all(m.fused_step is None and m.tensor_parallel.world_size == 2 for m in ranks)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i in range(c.num_layers):
        def parts(name, i=i):
            module = full.get_submodule(f"layers.{i}.{name}")
            return _codes(module), [_codes(m.get_submodule(f"layers.{i}.{name}")) for m in ranks]

        (whole, shards) = parts("self_attn.qkv_proj")
        for t, pieces in zip(whole, zip(*shards, strict=True), strict=True):
            # Rows [q | k | v]: each rank's q heads, then its KV heads.
            halves = [p.split([q // 2, kv // 2, kv // 2]) for p in pieces]
            assert torch.equal(t, torch.cat([h[j] for j in range(3) for h in halves]))
        whole, shards = parts("mlp.gate_up_proj")
        for t, pieces in zip(whole, zip(*shards, strict=True), strict=True):
            halves = [p.chunk(2) for p in pieces]  # [gate_local | up_local]
            assert torch.equal(t, torch.cat([h[j] for j in range(2) for h in halves]))
        for name in ("self_attn.o_proj", "mlp.down_proj"):  # input columns (int4: whole groups)
            whole, shards = parts(name)
            assert torch.equal(whole[0], torch.cat([s[0] for s in shards], dim=1))
            for t, pieces in zip(whole[1:], list(zip(*shards, strict=True))[1:], strict=True):
                if quantization == "int8":  # one scale per output channel: every rank keeps them all
                    assert all(torch.equal(t, p) for p in pieces)
                else:
                    assert torch.equal(t, torch.cat(pieces, dim=1))


def test_step_codec_rebuilds_the_batch_exactly():
    seqs = [scheduled(list(range(3, 12)), 4, [2, 5, 7]), scheduled([9, 8, 7], 2, [1])]
    batch = forward_batch(seqs, block_size=4)
    for b in (batch, dataclasses.replace(batch, lora_slots=torch.tensor([0] * 5 + [-1], dtype=torch.int64))):
        back = decode(*encode(b))
        for f in dataclasses.fields(b):
            a, z = getattr(b, f.name), getattr(back, f.name)
            if isinstance(a, torch.Tensor):
                assert a.dtype == z.dtype and torch.equal(a, z), f.name
            else:
                assert a == z, f.name
    with pytest.raises(TypeError, match=r"ForwardBatch\.positions: cannot broadcast a torch.float32"):
        encode(dataclasses.replace(batch, positions=batch.positions.float()))


def test_runner_refuses_an_unsharded_model(checkpoint):
    loaded = _load(checkpoint("qwen2"))
    with pytest.raises(ValueError, match="needs its ranks joined"):
        make_runner(loaded.model, loaded.config, EngineConfig(tensor_parallel_size=2), loaded.dtype)
