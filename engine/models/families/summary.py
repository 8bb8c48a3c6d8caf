"""ModelSummary: what GetModel reports about a loaded model's architecture."""

from __future__ import annotations

from dataclasses import dataclass

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.weights import parameter_count


@dataclass(frozen=True)
class ModelSummary:
    family: str  # ModelConfig.architecture: a family of engine/models/families
    parameters: int  # by logical (Hugging Face) shapes, a tied embedding once
    active_parameters: int  # used per token: equal to ``parameters`` for a dense model
    layer_pattern: list[str]  # per layer, "sliding" or "global"
    sliding_window: int | None  # the window of the sliding layers


def model_summary(config: ModelConfig) -> ModelSummary:
    count = parameter_count(config)
    return ModelSummary(
        family=config.architecture,
        parameters=count,
        active_parameters=count,
        layer_pattern=config.layer_pattern(),
        sliding_window=config.sliding_window if "sliding" in config.layer_pattern() else None,
    )
