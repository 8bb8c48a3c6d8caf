"""Rotary position embeddings: inverse frequencies and attention factor per rope type.

``rope_spec`` turns (head_dim, rope_theta, the Hugging Face ``rope_scaling`` /
``rope_parameters`` dict, max_position_embeddings, optionally the engine's
max_model_len) into a RopeSpec: the inverse frequencies and the factor that
multiplies cos and sin. Supported types: default, linear, llama3, yarn (as
transformers computes them), dynamic NTK and longrope (decided once per
engine, see below).

Every spec is fixed when the model is built, so a position's rotation is a
pure function of that position: it never depends on the other requests of the
batch nor on how long a sequence grows later, and keys already in the KV cache
stay valid. transformers and vLLM instead pick dynamic NTK's base and
longrope's factor set from the longest sequence of each batch; here:

* dynamic: one static base for the context the engine serves, L =
  max_model_len (or max_position_embeddings * factor when not given), with
  L0 = max_position_embeddings:
  ``base * (factor * max(L, L0) / L0 - (factor - 1)) ** (d / (d - 2))``, vLLM's
  DynamicNTKScalingRotaryEmbedding formula (served length over trained
  length). It equals transformers' frequencies exactly for a forward pass
  whose longest sequence is L tokens long, and for every pass when L <= L0
  (then both use the unscaled base). For any other batch transformers uses
  another base.
* longrope: the long factors when the served context (max_model_len, or
  max_position_embeddings when not given) exceeds
  original_max_position_embeddings, else the short ones; the attention factor
  as transformers computes it. transformers (and vLLM) switch per batch: they
  agree with this choice whenever the batch's longest sequence falls on the
  same side of original_max_position_embeddings as the served context.

Bad parameters raise RopeConfigError naming the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")

# Keys every type accepts besides its own: the type itself (``type`` is the legacy
# spelling), the base (transformers >= 5 keeps it inside the dict) and partial rotary.
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_REQUIRED_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings"}),
    "longrope": frozenset({"short_factor", "long_factor", "original_max_position_embeddings"}),
    "llama3": frozenset(
        {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}
    ),
}
_OPTIONAL_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset(),
    "dynamic": frozenset(),
    "yarn": frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"factor", "attention_factor"}),
    "llama3": frozenset(),
}


class RopeConfigError(ValueError):
    """Rope scaling parameters that cannot be served; the message names the key."""


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """What rotates q and k: ``inv_freq`` [rotary_dim / 2] float32 on the CPU, and the
    factor that multiplies cos and sin (yarn's mscale, longrope's scaling; 1.0 otherwise)."""

    rope_type: str
    rotary_dim: int  # the leading dims of each head that rotate; head_dim unless partial
    inv_freq: torch.Tensor
    attention_factor: float


# ---------------------------------------------------------------------------
# Validation


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    """The dict's rope type (``rope_type``, else the legacy ``type``, else default)."""
    if not scaling:
        return "default"
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    legacy = scaling.get("type")
    if legacy is not None and "rope_type" in scaling and legacy != scaling["rope_type"]:
        raise RopeConfigError(
            f"rope scaling key 'type' ({legacy!r}) contradicts 'rope_type' ({scaling['rope_type']!r})"
        )
    if rope_type not in ROPE_TYPES:
        raise RopeConfigError(
            f"rope scaling key 'rope_type': unsupported rope type {rope_type!r} "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    return rope_type


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _need_number(
    key: str, value: Any, rope_type: str, minimum: float | None = None, strict: bool = False
) -> None:
    ok = _is_number(value) and (minimum is None or (value > minimum if strict else value >= minimum))
    if not ok:
        bound = "" if minimum is None else f" {'>' if strict else '>='} {minimum:g}"
        raise RopeConfigError(
            f"rope scaling key {key!r} ({rope_type}) must be a number{bound}, got {value!r}"
        )


def _need_positive_int(key: str, value: Any, rope_type: str) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise RopeConfigError(
            f"rope scaling key {key!r} ({rope_type}) must be a positive integer, got {value!r}"
        )


def rotary_dim_of(head_dim: int, scaling: Mapping[str, Any] | None) -> int:
    """The rotated dims per head: head_dim times ``partial_rotary_factor`` (transformers' int())."""
    fraction = (scaling or {}).get("partial_rotary_factor", 1.0)
    if not _is_number(fraction) or not 0.0 < fraction <= 1.0:
        raise RopeConfigError(f"rope scaling key 'partial_rotary_factor' must be in (0, 1], got {fraction!r}")
    rotary_dim = int(head_dim * fraction)
    if rotary_dim < 2 or rotary_dim % 2:
        raise RopeConfigError(
            f"rope scaling key 'partial_rotary_factor' ({fraction!r}) gives {rotary_dim} rotary dims of "
            f"head_dim {head_dim}; rotary dims must be even and at least 2"
        )
    return rotary_dim


def validate_rope_scaling(
    scaling: Mapping[str, Any] | None,
    head_dim: int,
    theta: float,
    max_position_embeddings: int,
) -> str:
    """Check the dict against its rope type; returns the type, raises RopeConfigError naming the key."""
    rope_type = rope_type_of(scaling)
    if not _is_number(theta) or theta <= 0:
        raise RopeConfigError(f"rope_theta must be a positive number, got {theta!r}")
    _need_positive_int("max_position_embeddings", max_position_embeddings, rope_type)
    if not scaling:
        rotary_dim_of(head_dim, None)
        return rope_type
    if "rope_theta" in scaling and scaling["rope_theta"] != theta:
        raise RopeConfigError(
            f"rope scaling key 'rope_theta' ({scaling['rope_theta']!r}) differs from the rope_theta given ({theta!r})"
        )
    required, optional = _REQUIRED_KEYS[rope_type], _OPTIONAL_KEYS[rope_type]
    missing = sorted(required - scaling.keys())
    if missing:
        raise RopeConfigError(f"rope scaling ({rope_type}) is missing key(s) {', '.join(map(repr, missing))}")
    unknown = sorted(scaling.keys() - required - optional - _COMMON_KEYS)
    if unknown:
        accepted = sorted(required | optional | _COMMON_KEYS)
        raise RopeConfigError(
            f"rope scaling ({rope_type}) has unknown key(s) {', '.join(map(repr, unknown))} "
            f"(accepted: {', '.join(accepted)})"
        )
    rotary_dim = rotary_dim_of(head_dim, scaling)

    factor = scaling.get("factor")
    # yarn and longrope take factor=None as "derive it from the context lengths", like transformers.
    if "factor" in scaling and not (factor is None and rope_type in ("yarn", "longrope")):
        _need_number("factor", factor, rope_type, minimum=1.0)
    if "original_max_position_embeddings" in required:
        _need_positive_int(
            "original_max_position_embeddings", scaling["original_max_position_embeddings"], rope_type
        )

    if rope_type == "dynamic" and rotary_dim <= 2:
        raise RopeConfigError(f"dynamic rope needs more than 2 rotary dims (d / (d - 2)), got {rotary_dim}")
    if rope_type == "llama3":
        _need_number("low_freq_factor", scaling["low_freq_factor"], rope_type)
        _need_number("high_freq_factor", scaling["high_freq_factor"], rope_type)
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise RopeConfigError(
                f"rope scaling key 'high_freq_factor' ({scaling['high_freq_factor']!r}) must exceed "
                f"'low_freq_factor' ({scaling['low_freq_factor']!r})"
            )
    if rope_type == "yarn":
        for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                _need_number(key, scaling[key], rope_type)
        if "truncate" in scaling and not isinstance(scaling["truncate"], bool):
            raise RopeConfigError(
                f"rope scaling key 'truncate' (yarn) must be true or false, got {scaling['truncate']!r}"
            )
    if rope_type in ("yarn", "longrope") and scaling.get("attention_factor") is not None:
        _need_number("attention_factor", scaling["attention_factor"], rope_type, minimum=0.0, strict=True)
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            values = scaling[key]
            if not isinstance(values, (list, tuple)) or not all(_is_number(v) and v > 0 for v in values):
                raise RopeConfigError(
                    f"rope scaling key {key!r} (longrope) must be a list of positive numbers"
                )
            if len(values) != rotary_dim // 2:
                raise RopeConfigError(
                    f"rope scaling key {key!r} (longrope) has {len(values)} entries, expected {rotary_dim // 2} "
                    f"(rotary dims {rotary_dim} / 2)"
                )
    return rope_type


# ---------------------------------------------------------------------------
# Inverse frequencies, one function per type (transformers' arithmetic, op for op)


def _exponents(rotary_dim: int) -> torch.Tensor:
    # Explicit CPU device: the decoder is built under torch.device("meta") before its weights arrive.
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(rotary_dim))


def linear_inv_freq(rotary_dim: int, theta: float, factor: float) -> torch.Tensor:
    return default_inv_freq(rotary_dim, theta) / factor


def llama3_inv_freq(
    rotary_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    inv_freq = default_inv_freq(rotary_dim, theta)
    old_context = original_max_position_embeddings
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def dynamic_ntk_base(
    theta: float, rotary_dim: int, factor: float, served_len: float, trained_len: int
) -> float:
    """The NTK-scaled base for a context of served_len tokens (never below the trained length)."""
    seq_len = max(served_len, trained_len)
    return theta * ((factor * seq_len / trained_len) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(
    rotary_dim: int, theta: float, scaling: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """transformers' ``_compute_yarn_parameters``: (inv_freq, attention factor)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling["factor"]
    if factor is None:
        # DeepSeek-style configs give only the two context lengths.
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        # As transformers: mscale counts only together with mscale_all_dim (both truthy).
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    # transformers' `or`: a zero or null beta takes the paper's default too.
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = scaling.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, device="cpu").to(dtype=torch.float) / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, attention_factor


def longrope_parameters(
    rotary_dim: int, theta: float, scaling: Mapping[str, Any], max_position_embeddings: int, long: bool
) -> tuple[torch.Tensor, float]:
    """transformers' ``_compute_longrope_parameters`` with the factor set chosen by the caller."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        # Phi-3 configs give the extended context as max_position_embeddings and no factor.
        factor = max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(
        scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu"
    )
    return 1.0 / (ext_factors * theta ** _exponents(rotary_dim)), attention_factor


# ---------------------------------------------------------------------------
# The spec and its use


def longrope_uses_long_factors(
    scaling: Mapping[str, Any], max_position_embeddings: int, max_model_len: int | None
) -> bool:
    """Long factors when the served context exceeds the pretraining context."""
    served = max_model_len if max_model_len is not None else max_position_embeddings
    return served > scaling["original_max_position_embeddings"]


def rope_spec(
    head_dim: int,
    theta: float,
    scaling: Mapping[str, Any] | None,
    max_position_embeddings: int,
    max_model_len: int | None = None,
) -> RopeSpec:
    """The rotation a model applies, fixed for the engine's lifetime (see the module doc).

    ``max_position_embeddings`` is the config's; ``max_model_len`` the context the
    engine serves (None: the config's), read by dynamic and longrope only.
    """
    rope_type = validate_rope_scaling(scaling, head_dim, theta, max_position_embeddings)
    if max_model_len is not None:
        _need_positive_int("max_model_len", max_model_len, rope_type)
    params = scaling or {}
    rotary_dim = rotary_dim_of(head_dim, params)
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = default_inv_freq(rotary_dim, theta)
    elif rope_type == "linear":
        inv_freq = linear_inv_freq(rotary_dim, theta, params["factor"])
    elif rope_type == "llama3":
        inv_freq = llama3_inv_freq(
            rotary_dim,
            theta,
            params["factor"],
            params["low_freq_factor"],
            params["high_freq_factor"],
            params["original_max_position_embeddings"],
        )
    elif rope_type == "dynamic":
        factor = params["factor"]
        served = max_model_len if max_model_len is not None else max_position_embeddings * factor
        base = dynamic_ntk_base(theta, rotary_dim, factor, served, max_position_embeddings)
        inv_freq = default_inv_freq(rotary_dim, base)
    elif rope_type == "yarn":
        inv_freq, attention_factor = yarn_parameters(rotary_dim, theta, params, max_position_embeddings)
    else:  # longrope
        long = longrope_uses_long_factors(params, max_position_embeddings, max_model_len)
        inv_freq, attention_factor = longrope_parameters(
            rotary_dim, theta, params, max_position_embeddings, long
        )
    return RopeSpec(rope_type, rotary_dim, inv_freq, float(attention_factor))


def rope_cos_sin(
    positions: torch.Tensor, spec: RopeSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rotary_dim] for absolute positions (both halves repeated, HF layout),
    already multiplied by the spec's attention factor, computed in float32 then cast."""
    freqs = positions.float()[:, None] * spec.inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if spec.attention_factor != 1.0:
        cos, sin = cos * spec.attention_factor, sin * spec.attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, rotary_dim] (the rotate-half convention);
    with partial rotary the dims past rotary_dim pass through unchanged."""
    rotary_dim = cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        rotated = apply_rope(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = rotary_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim] of ``rope_cos_sin`` with each adjacent
    pair (2i, 2i + 1) turned by frequency i (Command-R, llama.cpp's "norm" rope), not the halves."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    pairs = x.unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
