"""A checkpoint's own recommended sampling values: what its authors ship for requests that set none.

A Hugging Face directory's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, as vLLM's ``--generation-config auto`` reads them) and a GGUF's
``general.sampling.*`` metadata (``temp``, ``top_p``, ``top_k``, ``min_p``, ``penalty_repeat``, which
llama.cpp's converter copies from that same file). The values come back under the engine's
SamplingParams field names; whether they are valid is the engine's to say (SamplingParams.validate),
and the server, which applies them, checks them there. ``do_sample`` is not read: vLLM ignores it
too, and a model's recommended temperature is what a client that sets none should get.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import Keys

if TYPE_CHECKING:
    from gguf import GGUFReader

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field.
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# GGUF metadata key -> SamplingParams field.
GGUF_KEYS = {
    Keys.General.SAMPLING_TEMP: "temperature",
    Keys.General.SAMPLING_TOP_P: "top_p",
    Keys.General.SAMPLING_TOP_K: "top_k",
    Keys.General.SAMPLING_MIN_P: "min_p",
    Keys.General.SAMPLING_PENALTY_REPEAT: "repetition_penalty",
}
INTEGER_FIELDS = frozenset({"top_k"})


def _number(field: str, value: Any, origin: str) -> float | int | None:
    """``value`` as the field's type, or None (with a warning) when it is not a number of that kind."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        log.warning("%s: %r is not a number; not used as the default %s", origin, value, field)
        return None
    if field in INTEGER_FIELDS:
        if float(value) != int(value):
            log.warning("%s: %r is not an integer; not used as the default %s", origin, value, field)
            return None
        return int(value)
    return float(value)


def _collect(found: Mapping[str, Any], keys: Mapping[str, str], origin: str) -> dict[str, float | int]:
    defaults: dict[str, float | int] = {}
    for key, field in keys.items():
        if found.get(key) is None:
            continue
        value = _number(field, found[key], f"{origin} {key}")
        if value is not None:
            defaults[field] = value
    return defaults


def hf_sampling_defaults(generation_config: Mapping[str, Any] | None, path: Path) -> dict[str, float | int]:
    """The recommended values in a parsed ``generation_config.json`` (None: the directory has none)."""
    return _collect(generation_config or {}, HF_KEYS, str(path))


def gguf_sampling_defaults(reader: GGUFReader, path: Path) -> dict[str, float | int]:
    """The recommended values in a GGUF's ``general.sampling.*`` metadata."""
    found = {key: reader.fields[key].contents() for key in GGUF_KEYS if key in reader.fields}
    return _collect(found, GGUF_KEYS, str(path))
