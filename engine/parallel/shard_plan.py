"""The sharding plan: which heads and MLP channels rank ``rank`` of ``world_size`` keeps.

Query heads and MLP intermediate channels are always split: each rank takes an equal,
contiguous share. KV heads are split the same way when the world size divides them. When
there are fewer KV heads than ranks they are replicated instead, as vLLM does: each rank keeps
a copy of the one KV head its query heads read (``world_size / num_kv_heads`` ranks hold each),
with that head's K and V projection rows copied rather than split. A rank then holds
``max(1, num_kv_heads // world_size)`` KV heads, and its KV cache is sized for those.

This module is the one place that decides; engine/parallel/sharding.py applies the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from protoserve.engine.models.config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    """What one rank keeps of every attention and dense MLP (each layer alike)."""

    rank: int
    world_size: int
    q_heads: range  # query heads (split)
    kv_heads: range  # KV heads: a split share, or the one head this rank's query heads read
    kv_replicas: int  # ranks holding each KV head: 1 when they are split
    intermediate: range  # MLP intermediate channels (split)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's layers and KV cache have."""
        return dataclasses.replace(config, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                                   intermediate_size=len(self.intermediate))


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """ValueError naming the field (and the sizes that work) when ``config`` cannot be split over
    ``world_size`` ranks."""
    problem = _problem(config, world_size)
    if problem is not None:
        raise ValueError(f"{problem}; tensor_parallel_size this model takes: "
                         f"{', '.join(map(str, supported_sizes(config)))}")


def supported_sizes(config: ModelConfig) -> list[int]:
    """Every world size the model can be split over (each divides the query heads)."""
    return [n for n in range(1, config.num_heads + 1) if _problem(config, n) is None]


def _problem(config: ModelConfig, world_size: int) -> str | None:
    """Why ``config`` cannot be split over ``world_size`` ranks, or None."""
    prefix = f"tensor_parallel_size {world_size}"
    if world_size < 1:
        return f"{prefix}: it must be at least 1"
    if config.num_experts > 0:
        return (f"{prefix}: {config.architecture} has MoE layers (num_experts={config.num_experts}), "
                "and tensor parallelism of MoE layers is not built")
    if config.num_heads % world_size:
        return f"{prefix} does not divide the model's num_heads ({config.num_heads})"
    kv = config.num_kv_heads
    if kv % world_size and world_size % kv:
        return (f"{prefix} does not divide the model's num_kv_heads ({kv}), nor is it a multiple of them "
                "(KV heads are split over the ranks, or replicated when there are fewer than ranks)")
    if config.intermediate_size % world_size:
        return f"{prefix} does not divide the model's intermediate_size ({config.intermediate_size})"
    return None


def plan_shard(config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    """Rank's share of ``config``'s layers; ValueError when the model cannot be split so."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    check_shardable(config, world_size)
    kv_replicas = max(1, world_size // config.num_kv_heads)
    return ShardPlan(
        rank=rank,
        world_size=world_size,
        q_heads=_share(config.num_heads, rank, world_size),
        # Replicated: ranks [h * replicas, (h + 1) * replicas) hold KV head h, the one their query heads
        # read (a query group of num_heads / num_kv_heads heads spans exactly those ranks' shares).
        kv_heads=_share(config.num_kv_heads, rank // kv_replicas, world_size // kv_replicas),
        kv_replicas=kv_replicas,
        intermediate=_share(config.intermediate_size, rank, world_size),
    )


def _share(total: int, index: int, parts: int) -> range:
    """Part ``index`` of ``range(total)`` cut into ``parts`` equal parts."""
    size = total // parts
    return range(index * size, (index + 1) * size)
