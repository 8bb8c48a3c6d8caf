"""ModelSpec: one model ``protoserve serve`` loads, the names it answers to, and its share of KV memory.

``--model`` is repeatable; the i-th ``--served-model-name NAME[,ALIAS...]`` names the i-th model (vLLM's
flag, one per model here), its first name the one responses report and the rest aliases. The engines
of several models split the KV budget (``EngineConfig.kv_cache_bytes``) evenly unless a model's pool is
set in blocks (``--max-kv-blocks``, once for every model or once per model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from protoserve.engine.api import EngineConfig
from protoserve.server.limits import MAX_MODEL_NAME_CHARS


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: where it comes from and what it is called."""

    source: str | None = None  # a catalogue name, file or directory; None: the default model
    names: tuple[str, ...] = ()  # its name then its aliases; (): the checkpoint's name
    max_kv_blocks: int | None = None  # its KV pool in blocks; None: its share of the KV budget

    @property
    def name(self) -> str | None:
        return self.names[0] if self.names else None

    @property
    def aliases(self) -> tuple[str, ...]:
        return self.names[1:]


def parse_names(text: str) -> tuple[str, ...]:
    """``NAME[,ALIAS...]`` → its names; ValueError for an empty, duplicate or overlong one."""
    names = tuple(part.strip() for part in text.split(","))
    for name in names:
        if not name:
            raise ValueError(f"{text!r} has an empty name (NAME[,ALIAS...])")
        if len(name) > MAX_MODEL_NAME_CHARS:
            raise ValueError(f"model names are at most {MAX_MODEL_NAME_CHARS} characters")
    if len(set(names)) != len(names):
        raise ValueError(f"{text!r} names the same name twice")
    return names


def model_specs(
    sources: Sequence[str],
    names: Sequence[tuple[str, ...]],
    kv_blocks: Sequence[int],
) -> tuple[ModelSpec, ...]:
    """The specs of ``--model`` (none: the default model), ``--served-model-name`` and ``--max-kv-blocks``
    as given; ValueError, naming the flag, when they do not pair up."""
    count = max(len(sources), 1)
    if len(names) > count:
        raise ValueError(
            f"--served-model-name given {len(names)} times for {count} --model: the i-th names the i-th model"
        )
    if len(kv_blocks) not in (0, 1, count):
        raise ValueError(
            f"--max-kv-blocks given {len(kv_blocks)} times for {count} --model: give it once (every model's "
            "pool) or once per model"
        )
    claimed = [n for group in names for n in group]
    if len(set(claimed)) != len(claimed):
        raise ValueError("--served-model-name gives the same name to two models")
    specs = []
    for i in range(count):
        blocks = kv_blocks[0] if len(kv_blocks) == 1 else (kv_blocks[i] if kv_blocks else None)
        specs.append(
            ModelSpec(
                source=sources[i] if sources else None,
                names=names[i] if i < len(names) else (),
                max_kv_blocks=blocks,
            )
        )
    return tuple(specs)


def engine_config_for(spec: ModelSpec, base: EngineConfig, models: int) -> EngineConfig:
    """The engine config of one of ``models`` generative models: its pool in blocks when the spec sets
    one, else an even share of the KV budget, so that all the pools fit the budget together."""
    if spec.max_kv_blocks is not None:
        return dataclasses.replace(base, max_kv_blocks=spec.max_kv_blocks)
    if base.max_kv_blocks is not None or models <= 1:
        return base
    return dataclasses.replace(base, kv_cache_bytes=max(1, base.kv_cache_bytes // models))
