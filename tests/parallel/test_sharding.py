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
from protoserve.engine.parallel.shard_plan import check_shardable, plan_shard, supported_sizes
from protoserve.engine.parallel.sharding import shard_decoder
from protoserve.engine.parallel.step_channel import decode, encode


def _load(path, quantization="none", rank=None, world_size=2):
    shard = None if rank is None else functools.partial(shard_decoder, rank=rank, world_size=world_size)
    return load_model(str(path), quantization=quantization, progress=False, load_tokenizer=False, shard=shard)


def test_refuses_a_size_that_does_not_divide_the_query_heads(checkpoint):
    loaded = _load(checkpoint("qwen2"))  # 4 heads, 2 KV heads
    model = loaded.model
    qkv = model.layers[0].self_attn.qkv_proj
    with pytest.raises(ValueError, match=r"does not divide the model's num_heads \(4\); "
                                         r"tensor_parallel_size this model takes: 1, 2, 4$"):
        shard_decoder(model, 0, 3)
    assert model.config is loaded.config and model.layers[0].self_attn.qkv_proj is qkv  # untouched


def test_refuses_smollm2_over_two_ranks(checkpoint):
    """SmolLM2-135M's shape: 9 query heads cannot be split over 2 ranks, whatever happens to its 3 KV heads."""
    config = dataclasses.replace(_load(checkpoint("qwen2")).config, num_heads=9, num_kv_heads=3,
                                 intermediate_size=1536)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 2 does not divide the model's num_heads \(9\); "
                                         r"tensor_parallel_size this model takes: 1, 3$"):
        check_shardable(config, 2)


def test_refuses_kv_heads_neither_split_nor_replicated(checkpoint):
    config = dataclasses.replace(_load(checkpoint("qwen2")).config, num_heads=12, num_kv_heads=4,
                                 intermediate_size=144)
    assert supported_sizes(config) == [1, 2, 4, 12]  # 6 divides the 12 query heads, not the 4 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size 6 does not divide the model's num_kv_heads \(4\), "
                                         "nor is it a multiple of them"):
        check_shardable(config, 6)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 1), (4, 2), (8, 2), (12, 4), (16, 16)])
def test_plan_keeps_the_kv_heads_a_ranks_query_heads_read(checkpoint, heads, kv_heads):
    config = dataclasses.replace(_load(checkpoint("qwen2")).config, num_heads=heads, num_kv_heads=kv_heads,
                                 intermediate_size=heads * 16)
    group = heads // kv_heads  # query heads per KV head
    for size in supported_sizes(config):
        plans = [plan_shard(config, rank, size) for rank in range(size)]
        assert [h for p in plans for h in p.q_heads] == list(range(heads))  # query heads split, in order
        assert [p.kv_replicas for p in plans] == [max(1, size // kv_heads)] * size
        for p in plans:
            assert len(p.kv_heads) == max(1, kv_heads // size)
            assert {h // group for h in p.q_heads} <= set(p.kv_heads)
        holders = [sum(h in p.kv_heads for p in plans) for h in range(kv_heads)]
        assert holders == [max(1, size // kv_heads)] * kv_heads  # each KV head on `replicas` ranks


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


def _weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    layer = model.get_submodule(name)
    layer.unpack_from_kernel()  # the float weight the kernel pack released
    return layer.weight


@pytest.mark.parametrize(("family", "size"), [("gemma3-kv1", 2), ("gemma3-kv1", 4), ("gemma3-kv2", 4)])
def test_replicated_kv_rows_are_copies_of_the_unsharded_head(checkpoint, family, size):
    path = checkpoint(family)
    full = _load(path).model
    c = full.config
    ranks = [_load(path, rank=rank, world_size=size).model for rank in range(size)]
    d, q_local = c.head_dim, c.num_heads // size
    group = c.num_heads // c.num_kv_heads
    for i in range(c.num_layers):
        name = f"layers.{i}.self_attn.qkv_proj"
        q, k, v = _weight(full, name).split([c.num_heads * d, c.num_kv_heads * d, c.num_kv_heads * d])
        for rank, m in enumerate(ranks):
            assert (m.config.num_heads, m.config.num_kv_heads) == (q_local, 1)
            head = rank * q_local // group  # the KV head this rank's query heads read
            rq, rk, rv = _weight(m, name).split([q_local * d, d, d])
            assert torch.equal(rq, q[rank * q_local * d : (rank + 1) * q_local * d])
            assert torch.equal(rk, k[head * d : (head + 1) * d]) and torch.equal(rv, v[head * d : (head + 1) * d])


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
