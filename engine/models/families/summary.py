"""ModelSummary: what GetModel reports about a loaded model's architecture."""

from __future__ import annotations

import math
from dataclasses import dataclass

from protoserve.engine.models import families
from protoserve.engine.models.config import ModelConfig


@dataclass(frozen=True)
class ModelSummary:
    family: str  # ModelConfig.architecture: a family of engine/models/families
    parameters: int  # by logical (Hugging Face) shapes, a tied embedding once
    active_parameters: int  # used per token: equal to ``parameters`` for a dense model
    layer_pattern: list[str]  # per layer, "sliding" or "global"
    sliding_window: int | None  # the window of the sliding layers


def parameter_count(config: ModelConfig) -> int:
    """Parameters by their logical (Hugging Face) shapes; a tied embedding counts once."""
    return sum(math.prod(shape) for shape in families.hf_shapes(config).values())


def model_summary(config: ModelConfig) -> ModelSummary:
    count = parameter_count(config)
    active = families.get(config.architecture).active_parameters
    pattern = config.layer_pattern()
    return ModelSummary(
        family=config.architecture,
        parameters=count,
        active_parameters=count if active is None else active(config),
        layer_pattern=pattern,
        sliding_window=config.sliding_window if "sliding" in pattern else None,
    )
