"""A Hugging Face checkpoint's ``quantization_config``: the packed integer formats we read.

GPTQ (AutoGPTQ / GPTQModel, ``quant_method: gptq``) and AWQ (AutoAWQ's GEMM layout,
``quant_method: awq``) store each quantized linear layer as integer codes packed into int32
words with per-group scales and zero points; engine/loader/packed_formats.py unpacks them. Any
other method, width or layout is refused here, naming the key, before a tensor is read: a
checkpoint whose packing we would misread must never load as a silently wrong model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protoserve.engine.loader.errors import ModelLoadError

GPTQ = "gptq"
AWQ = "awq"
KEY = "quantization_config"
GPTQ_BITS = (4, 8)
AWQ_BITS = (4,)
# GPTQ's checkpoint formats: v1 stores each zero point minus one (AutoGPTQ's historical offset), v2 as is.
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
AWQ_VERSIONS = ("gemm",)
AWQ_BACKENDS = ("autoawq",)


@dataclass(frozen=True)
class PackedQuantization:
    """How a checkpoint's quantized linear layers are packed."""

    method: str  # GPTQ or AWQ
    bits: int
    group_size: int | None  # input columns per group; None: one group per row (the file's -1)
    zero_offset: int  # added to each stored zero point (GPTQ v1: 1)

    @property
    def per_word(self) -> int:
        """Codes per int32 word."""
        return 32 // self.bits


def parse_quantization_config(raw: Mapping[str, Any], path: Path) -> PackedQuantization | None:
    """config.json's ``quantization_config`` -> PackedQuantization, None without one; ModelLoadError(path,
    ...) naming the key for what we cannot read."""
    section = raw.get(KEY)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ModelLoadError(path, f"{KEY} must be an object, got {section!r}")
    fields = _Fields(section, path)
    method = fields.get("quant_method")
    if method == GPTQ:
        return _gptq(fields)
    if method == AWQ:
        return _awq(fields)
    raise fields.error("quant_method", method, f"is not supported (supported: {AWQ}, {GPTQ})")


@dataclass(frozen=True)
class _Fields:
    section: Mapping[str, Any]
    path: Path

    def get(self, key: str, default: Any = None, alias: str | None = None) -> Any:
        value = self.section.get(key)
        if value is None and alias is not None:
            value = self.section.get(alias)
        return default if value is None else value

    def error(self, key: str, value: Any, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, f"{KEY}.{key} {value!r} {problem}")

    def choice(self, key: str, accepted: tuple[Any, ...], default: Any = None, alias: str | None = None) -> Any:
        value = self.get(key, default, alias)
        if value not in accepted:
            raise self.error(key, value, f"is not supported (supported: {', '.join(map(str, accepted))})")
        return value

    def group_size(self, alias: str | None = None) -> int | None:
        value = self.get("group_size", -1, alias)
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise self.error("group_size", value, "must be a positive number of input columns or -1")
        return None if value == -1 else value

    def refuse_true(self, key: str, problem: str) -> None:
        if self.get(key, False):
            raise self.error(key, self.get(key), problem)


def _gptq(fields: _Fields) -> PackedQuantization:
    bits = fields.choice("bits", GPTQ_BITS)
    fmt_key = "checkpoint_format" if "checkpoint_format" in fields.section else "format"
    fmt = fields.choice(fmt_key, tuple(GPTQ_ZERO_OFFSETS), default=GPTQ)
    fields.refuse_true("is_marlin_format", "is not supported: Marlin's repacked layout (supported: gptq, gptq_v2)")
    # desc_act (act-order) and sym change only the values g_idx and qzeros hold, which are read as stored.
    return PackedQuantization(GPTQ, bits, fields.group_size(), GPTQ_ZERO_OFFSETS[fmt])


def _awq(fields: _Fields) -> PackedQuantization:
    bits = fields.choice("bits", AWQ_BITS, alias="w_bit")
    version = fields.get("version", "gemm")
    if str(version).lower() not in AWQ_VERSIONS:  # transformers writes GEMM, AutoAWQ gemm
        raise fields.error("version", version, f"is not supported (supported: {', '.join(AWQ_VERSIONS)})")
    fields.choice("backend", AWQ_BACKENDS, default="autoawq")
    if fields.get("zero_point", True) is not True:
        raise fields.error("zero_point", fields.get("zero_point"), "is not supported: AWQ GEMM packs zero points")
    return PackedQuantization(AWQ, bits, fields.group_size(alias="q_group_size"), 0)
