"""A sentence-transformers model directory -> what the embedding pipeline must do.

``modules.json`` lists the pipeline: a Transformer (the encoder and its
tokenizer), a Pooling module (its ``config.json`` picks the mode) and an
optional Normalize. ``sentence_bert_config.json`` gives the window
(``max_seq_length``). Any module or mode this engine does not implement is
refused by name: a pipeline that silently skipped a Dense layer would return
vectors from a different space than the ones the model was trained to produce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protoserve.engine.loader.errors import ModelLoadError

MODULES_FILE = "modules.json"
SENTENCE_CONFIG_FILE = "sentence_bert_config.json"
POOLING_CONFIG_FILE = "config.json"

# Pooling config flag -> our pooling mode name.
POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}
UNSUPPORTED_POOLING_FLAGS = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")


@dataclass(frozen=True)
class SentenceModelLayout:
    transformer_dir: Path  # holds config.json, model.safetensors, tokenizer.json
    pooling: str  # one of POOLING_FLAGS' values
    pooling_dimension: int | None  # word_embedding_dimension, checked against the encoder
    normalize: bool
    max_seq_length: int | None  # tokens incl. specials; None when the directory does not say


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(path, "missing: a sentence-transformers model directory needs this file") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"not readable JSON: {e}") from e


def _module_kind(entry: Any, path: Path) -> tuple[str, str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise ModelLoadError(path, f"module entry {entry!r} has no 'type'")
    # "sentence_transformers.models.Pooling" in 2.x/3.x, other module paths in later releases.
    return entry["type"].rsplit(".", 1)[-1], str(entry.get("path", ""))


def _pooling_mode(raw: Any, path: Path) -> tuple[str, int | None]:
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "expected a JSON object")
    for flag in UNSUPPORTED_POOLING_FLAGS:
        if raw.get(flag):
            raise ModelLoadError(path, f"{flag} is not supported")
    if isinstance(raw.get("pooling_mode"), str):  # the single-key form newer releases write
        mode = {"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(raw["pooling_mode"], raw["pooling_mode"])
        if mode not in POOLING_FLAGS.values():
            raise ModelLoadError(path, f"pooling_mode {raw['pooling_mode']!r} is not supported")
        modes = [mode]
    else:
        modes = [mode for flag, mode in POOLING_FLAGS.items() if raw.get(flag)]
    if len(modes) != 1:
        raise ModelLoadError(path, f"exactly one pooling mode must be enabled, found {modes or 'none'}")
    dimension = raw.get("word_embedding_dimension")
    return modes[0], int(dimension) if dimension is not None else None


def _max_seq_length(directory: Path) -> int | None:
    path = directory / SENTENCE_CONFIG_FILE
    if not path.is_file():
        return None
    raw = _read_json(path)
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "expected a JSON object")
    if raw.get("do_lower_case"):
        # sentence-transformers lowercases in Python before tokenizing; chunk offsets
        # would no longer index the caller's text.
        raise ModelLoadError(path, "do_lower_case = true is not supported")
    value = raw.get("max_seq_length")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 3:
        raise ModelLoadError(path, f"max_seq_length {value!r} is not an integer >= 3")
    return value


def read_layout(directory: Path) -> SentenceModelLayout:
    """Parse ``directory``'s modules into a SentenceModelLayout; ModelLoadError for anything unsupported."""
    modules_path = directory / MODULES_FILE
    modules = _read_json(modules_path)
    if not isinstance(modules, list):
        raise ModelLoadError(modules_path, "expected a JSON list of modules")
    kinds = [_module_kind(entry, modules_path) for entry in modules]
    names = [kind for kind, _ in kinds]
    if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ModelLoadError(
            modules_path,
            f"pipeline {names} is not supported; supported: Transformer -> Pooling [-> Normalize]",
        )
    transformer_dir = directory / kinds[0][1]
    pooling_path = directory / kinds[1][1] / POOLING_CONFIG_FILE
    pooling, dimension = _pooling_mode(_read_json(pooling_path), pooling_path)
    return SentenceModelLayout(
        transformer_dir=transformer_dir,
        pooling=pooling,
        pooling_dimension=dimension,
        normalize=names[-1] == "Normalize",
        max_seq_length=_max_seq_length(transformer_dir),
    )
