"""A checkpoint's ModelConfig without loading its weights.

For checks that must refuse before the weights load: tensor parallelism (engine/parallel/launch.py)
refuses a model its ranks cannot split before starting them, rather than after each has loaded it.
"""

from __future__ import annotations

import os

from protoserve.engine.loader.catalogue import resolve_model
from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.loader.hf_checkpoint import read_hf_config
from protoserve.engine.models.config import ModelConfig


def read_model_config(path: str | os.PathLike[str] | None) -> ModelConfig:
    """The config of what ``path`` names (as load_model resolves it); ModelLoadError when unreadable."""
    source = resolve_model(path).path
    if source.is_dir():
        return read_hf_config(source)  # config.json only
    if source.is_file():
        from protoserve.engine.loader.gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint(source).config  # the metadata and tensor index; no tensor is read
    raise ModelLoadError(source, "no such file or directory")
