"""The LoRA bench section's pure parts: its figures, the adapters it writes, how it spreads and pools.

No model: the section itself runs in ``make bench`` (``--only lora``).
"""

from __future__ import annotations

import json

import pytest
import torch

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import lora
from bench.timeline import RequestTimeline
from protoserve.engine.lora.adapter import PROJECTIONS, load_adapter
from protoserve.engine.models.config import ModelConfig

TINY = ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16)


def timeline(sent: float, first: float, tokens: int, gap: float) -> RequestTimeline:
    t = RequestTimeline(sent)
    for k in range(tokens):
        t.add_chunk(first + k * gap, 1)
    t.finish(first + (tokens - 1) * gap)
    return t


def test_registered_with_its_figures_and_the_issue_target():
    assert SECTIONS["lora"] is lora.steps
    [step] = lora.steps(BenchContext(PROFILES["default"]))
    assert step.expects == (("lora.engine.base.c16", "tok/s"), ("lora.engine.mixed4.c16", "tok/s"),
                            ("lora.ratio.c16", "ratio"))
    assert step.resource.variant == PROFILES["default"].serving_variant
    assert lora.RATIO_TARGET.met(0.8) and not lora.RATIO_TARGET.met(0.79)


def test_written_adapter_is_a_peft_adapter_the_engine_loads(tmp_path):
    path = lora.write_random_adapter(tmp_path / "a", TINY, rank=16, seed=0)
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["target_modules"]) == ("LORA", 16, list(PROJECTIONS))
    adapter = load_adapter("a", path, TINY, dtype=torch.float32)
    assert (adapter.rank, adapter.target_modules) == (16, PROJECTIONS)
    fused = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert set(adapter.deltas) == {(i, f) for i in range(TINY.num_layers) for f in fused}
    assert all(d.b.abs().sum() > 0 for d in adapter.deltas.values())  # B non-zero: the adapter does work
    again = lora.write_random_adapter(tmp_path / "b", TINY, rank=16, seed=0)
    other = lora.write_random_adapter(tmp_path / "c", TINY, rank=16, seed=1)
    digests = [load_adapter(n, p, TINY, dtype=torch.float32).digest for n, p in (("b", again), ("c", other))]
    assert digests[0] == adapter.digest != digests[1]  # seeded: same seed same adapter, others differ


def test_spread_gives_each_adapter_an_equal_share_in_turn():
    names = ["w", "x", "y", "z"]
    assert lora.spread(16, names) == names * 4
    assert lora.spread(4, names) == names
    assert lora.spread(6, names) == [*names, "w", "x"]


def test_pools_output_tokens_over_wall_time_of_each_round():
    pool = lora.Pooled()
    pool.add([timeline(0.0, 0.5, 8, 0.25), timeline(0.0, 0.5, 8, 0.25)])  # 16 tokens in 2.25 s
    pool.add([timeline(10.0, 10.5, 4, 0.5), timeline(10.0, 10.5, 4, 0.1)])  # 8 tokens in 2.0 s
    assert (pool.tokens, pool.seconds) == (24, pytest.approx(4.25))
    assert pool.rate == pytest.approx(24 / 4.25)
    assert pool.rounds == pytest.approx([16 / 2.25, 4.0])
