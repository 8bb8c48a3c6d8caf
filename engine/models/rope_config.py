"""Rope settings from checkpoint metadata: Hugging Face config.json and GGUF key/values.

Both produce the same thing, a RopeSettings (the base and the normalised
``rope_scaling`` dict that engine/models/rope.py reads), validated in full so
a loader turns any RopeConfigError into its own error naming the file.

config.json comes in two spellings: transformers >= 5 writes
``rope_parameters`` with ``rope_theta`` inside (nested per layer type for
models such as Gemma 3), older files ``rope_theta`` + ``rope_scaling``. As
transformers' ``standardize_rope_params`` does, a top-level
``partial_rotary_factor`` joins the dict and, for llama3/yarn/longrope, the
pretraining context comes from the dict, else from a top-level
``original_max_position_embeddings`` (Phi-3 keeps it there), else from
max_position_embeddings; the dict and the top level disagreeing is an error
(transformers' choice there depends on the config class).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protoserve.engine.models.rope import RopeConfigError, rope_type_of, rotary_dim_of, validate_rope_scaling

DEFAULT_THETA = 10000.0
# Types whose pretraining context transformers fills from max_position_embeddings.
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeSettings:
    """``theta`` is the base; ``scaling`` the normalised dict (``rope_type`` set, no
    ``type`` or ``rope_theta`` keys), None for plain full-width RoPE."""

    theta: float
    scaling: dict[str, Any] | None


def _is_nested(params: Mapping[str, Any]) -> bool:
    """Per-layer-type rope parameters: every value a dict (or None for a layer without rope)."""
    return (
        bool(params)
        and all(v is None or isinstance(v, Mapping) for v in params.values())
        and any(isinstance(v, Mapping) for v in params.values())
    )


def _aliased(params: Mapping[str, Any], aliases: Mapping[str, str]) -> dict[str, Any]:
    """The dict with a family's legacy type names (Phi-3's "su") replaced by the type they mean."""
    scaling = dict(params)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in aliases:
        scaling.pop("type", None)
        scaling["rope_type"] = aliases[kind]
    return scaling


def _standardize(
    params: Mapping[str, Any],
    raw: Mapping[str, Any],
    head_dim: int,
    max_position_embeddings: int,
    aliases: Mapping[str, str],
) -> RopeSettings:
    scaling = _aliased(params, aliases)
    theta = scaling.pop("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
    if theta is None:
        theta = DEFAULT_THETA
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise RopeConfigError(f"rope_theta must be a number, got {theta!r}")
    theta = float(theta)
    rope_type = rope_type_of(scaling)
    scaling.pop("type", None)
    scaling["rope_type"] = rope_type
    if raw.get("partial_rotary_factor") is not None:
        scaling.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    if rope_type in _NEEDS_ORIGINAL:
        top = raw.get("original_max_position_embeddings")
        inside = scaling.get("original_max_position_embeddings")
        if top is not None and inside is not None and top != inside:
            # transformers' answer depends on the config class (Phi-3's takes the top-level one).
            raise RopeConfigError(
                f"original_max_position_embeddings is {top!r} at the top level of config.json "
                f"but {inside!r} in the rope dict"
            )
        if inside is None:
            scaling["original_max_position_embeddings"] = top if top is not None else max_position_embeddings
    validate_rope_scaling(scaling, head_dim, theta, max_position_embeddings)
    if scaling.get("partial_rotary_factor") == 1.0:
        del scaling["partial_rotary_factor"]
    if scaling == {"rope_type": "default"}:
        return RopeSettings(theta, None)
    return RopeSettings(theta, scaling)


def _hf_params(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    new, old = raw.get("rope_parameters"), raw.get("rope_scaling")
    if new and old and new != old:
        raise RopeConfigError("config.json has both 'rope_parameters' and 'rope_scaling', and they differ")
    params = new or old
    if not params:
        return {}
    if not isinstance(params, Mapping):
        raise RopeConfigError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    return params


def is_per_layer_type(raw: Mapping[str, Any]) -> bool:
    """Whether config.json gives its rope parameters per layer type (transformers >= 5's Gemma 3)."""
    return _is_nested(_hf_params(raw))


def rope_settings_from_hf(
    raw: Mapping[str, Any],
    head_dim: int,
    max_position_embeddings: int,
    aliases: Mapping[str, str] | None = None,
) -> RopeSettings:
    """config.json -> RopeSettings for a model whose layers share one rope. ``aliases`` maps a
    family's legacy type names onto ours (Phi-3's config class reads "su" and "yarn" as longrope)."""
    params = _hf_params(raw)
    if _is_nested(params):
        raise RopeConfigError(
            f"rope_parameters is given per layer type ({', '.join(params)}), "
            "which this model family does not read"
        )
    return _standardize(params, raw, head_dim, max_position_embeddings, aliases or {})


def rope_settings_by_layer_type_from_hf(
    raw: Mapping[str, Any], head_dim: int, max_position_embeddings: int
) -> dict[str, RopeSettings | None]:
    """config.json with ``rope_parameters`` nested per layer type -> settings per type
    (None where a layer type has no rope). A flat dict applies to every type in
    ``layer_types``."""
    params = _hf_params(raw)
    if _is_nested(params):
        return {
            layer_type: None if p is None else _standardize(p, raw, head_dim, max_position_embeddings, {})
            for layer_type, p in params.items()
        }
    layer_types = raw.get("layer_types")
    if not layer_types:
        raise RopeConfigError("rope_parameters is not per layer type and config.json has no 'layer_types'")
    settings = _standardize(params, raw, head_dim, max_position_embeddings, {})
    return {layer_type: settings for layer_type in dict.fromkeys(layer_types)}


# ---------------------------------------------------------------------------
# GGUF (llama.cpp's `{arch}.rope.scaling.*` keys, as convert_hf_to_gguf.py writes them)

# GGUF key suffix -> the Hugging Face key it carries, per scaling type.
_GGUF_YARN_KEYS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",  # the converter writes HF's attention_factor here
}
# Keys with no effect on the rotation itself.
_GGUF_INFORMATIONAL = ("finetuned",)
_GGUF_SCALING_KEYS = (
    "type",
    "factor",
    "attn_factor",
    "original_context_length",
    "alpha",
    "yarn_log_multiplier",
    "yarn_ext_factor",
    *_GGUF_YARN_KEYS,
    *_GGUF_INFORMATIONAL,
)
GGUF_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def rope_scaling_from_gguf(
    metadata: Mapping[str, Any],
    arch: str,
    head_dim: int,
    rope_theta: float,
    context_length: int,
    long_factors: list[float] | None = None,
    short_factors: list[float] | None = None,
    rotary_dim: int | None = None,
    softmax_mscale: bool = False,
) -> dict[str, Any] | None:
    """GGUF metadata (full key -> plain value) -> the Hugging Face scaling dict, or None.

    ``context_length`` is ``{arch}.context_length``; ``long_factors`` / ``short_factors``
    the contents of the ``rope_factors_long/short.weight`` tensors (longrope, Phi-3);
    ``rotary_dim`` the file's ``{arch}.rope.dimension_count`` (None: head_dim), fewer dims
    than head_dim being partial rotary (Phi-4-mini). ``softmax_mscale``: the architecture's
    graph scales the softmax by yarn's mscale (llama.cpp's deepseek2, the only reader of
    ``yarn_log_multiplier``, which the converter writes as 0.1 * mscale_all_dim): the key maps
    onto mscale = mscale_all_dim, so the rope itself is not scaled, as in llama.cpp.
    llama 3's ``rope_freqs.weight`` is not read here (its loader matches the factors).
    """
    scaling = _gguf_scaling(metadata, arch, context_length, long_factors, short_factors, softmax_mscale)
    partial = _gguf_partial_rotary(arch, head_dim, rotary_dim)
    if partial is not None:
        scaling = {"rope_type": "default", **(scaling or {}), "partial_rotary_factor": partial}
    if scaling is None:
        return None
    validate_rope_scaling(scaling, head_dim, rope_theta, context_length)
    return scaling


def _gguf_partial_rotary(arch: str, head_dim: int, rotary_dim: int | None) -> float | None:
    """``partial_rotary_factor`` for ``rotary_dim`` rotated dims of ``head_dim`` (None: all of them)."""
    if rotary_dim is None or rotary_dim == head_dim:
        return None
    key = f"{arch}.rope.dimension_count"
    if not (isinstance(rotary_dim, int) and 2 <= rotary_dim < head_dim and rotary_dim % 2 == 0):
        raise RopeConfigError(f"{key} = {rotary_dim!r}: rotary dims must be even, at least 2 and at most "
                              f"the head dim ({head_dim})")
    partial = rotary_dim / head_dim
    if rotary_dim_of(head_dim, {"partial_rotary_factor": partial}) != rotary_dim:
        raise RopeConfigError(f"{key} = {rotary_dim} is not a fraction of head dim {head_dim} "
                              "that partial_rotary_factor can express")
    return partial


def _gguf_scaling(
    metadata: Mapping[str, Any],
    arch: str,
    context_length: int,
    long_factors: list[float] | None,
    short_factors: list[float] | None,
    softmax_mscale: bool,
) -> dict[str, Any] | None:
    prefix = f"{arch}.rope.scaling."
    values = {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}
    unknown = sorted(set(values) - set(_GGUF_SCALING_KEYS))
    if unknown:
        raise RopeConfigError(f"unsupported GGUF metadata key(s) {', '.join(prefix + k for k in unknown)}")

    def key(suffix: str) -> str:
        return prefix + suffix

    kind = values.get("type")
    if (long_factors is None) != (short_factors is None):
        raise RopeConfigError("GGUF has only one of rope_factors_long.weight / rope_factors_short.weight")
    if long_factors is not None:
        if kind not in (None, "longrope"):
            raise RopeConfigError(f"{key('type')} is {kind!r} but the file has longrope factor tensors")
        kind = "longrope"
    if kind is None or kind == "none":
        return None
    if kind not in GGUF_SCALING_TYPES:
        raise RopeConfigError(
            f"{key('type')}: unsupported scaling type {kind!r} (supported: {', '.join(GGUF_SCALING_TYPES)})"
        )
    if values.get("alpha") is not None:
        raise RopeConfigError(f"{key('alpha')}: NTK alpha scaling is not supported")
    log_multiplier = values.get("yarn_log_multiplier")
    if log_multiplier not in (None, 0, 0.0) and not (softmax_mscale and kind == "yarn"):
        # Only a graph that scales the softmax by it (deepseek2) reads it; elsewhere it would be ignored.
        raise RopeConfigError(
            f"{key('yarn_log_multiplier')} = {values['yarn_log_multiplier']!r} is not supported"
        )
    if values.get("yarn_ext_factor") not in (None, 1, 1.0):
        raise RopeConfigError(
            f"{key('yarn_ext_factor')} = {values['yarn_ext_factor']!r} is not supported (only 1)"
        )

    scaling: dict[str, Any] = {"rope_type": kind}
    if kind in ("linear", "yarn"):
        if values.get("factor") is None:
            raise RopeConfigError(f"missing GGUF metadata key {key('factor')} ({kind} scaling)")
        scaling["factor"] = float(values["factor"])
    if kind == "yarn":
        original = values.get("original_context_length")
        # llama.cpp takes the training context when the original is not given.
        scaling["original_max_position_embeddings"] = int(original) if original else context_length
        for suffix, hf_key in _GGUF_YARN_KEYS.items():
            if values.get(suffix) is not None:
                scaling[hf_key] = float(values[suffix])
        if log_multiplier not in (None, 0, 0.0):
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_multiplier) / 0.1
        if values.get("attn_factor") is not None:
            raise RopeConfigError(
                f"{key('attn_factor')} is only read for longrope; yarn uses {key('yarn_attn_factor')}"
            )
    elif kind == "longrope":
        if long_factors is None or short_factors is None:
            raise RopeConfigError(
                "longrope GGUF needs rope_factors_long.weight and rope_factors_short.weight"
            )
        original = values.get("original_context_length")
        if not original:
            raise RopeConfigError(
                f"missing GGUF metadata key {key('original_context_length')} (longrope scaling)"
            )
        scaling["original_max_position_embeddings"] = int(original)
        scaling["long_factor"] = [float(v) for v in long_factors]
        scaling["short_factor"] = [float(v) for v in short_factors]
        if values.get("attn_factor") is not None:
            scaling["attention_factor"] = float(values["attn_factor"])
        if values.get("factor") is not None:
            scaling["factor"] = float(values["factor"])
    else:  # linear
        for suffix in ("attn_factor", "original_context_length", *_GGUF_YARN_KEYS):
            if values.get(suffix) is not None:
                raise RopeConfigError(f"{key(suffix)} has no meaning for linear scaling")
    return scaling
