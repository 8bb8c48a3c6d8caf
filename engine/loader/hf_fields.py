"""Reading a Hugging Face config.json: the fields every family maps the same way.

``HFFields`` wraps the raw dict with the file's path, so every problem is a
ModelLoadError naming config.json and the key; ``common()`` returns the
ModelConfig keyword arguments that all families read alike (sizes, norms eps,
rope through engine/models/rope_config.py, ids), and each family adds its own switches on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protoserve.engine.loader.errors import ModelLoadError
from protoserve.engine.models.config import FULL, LAYER_TYPES, SLIDING
from protoserve.engine.models.rope import RopeConfigError
from protoserve.engine.models.rope_config import (
    RopeSettings,
    rope_settings_by_layer_type_from_hf,
    rope_settings_from_hf,
)

DEFAULT_MAX_POSITION_EMBEDDINGS = 4096


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class HFFields:
    """config.json (+ generation_config.json) of one directory."""

    raw: Mapping[str, Any]
    generation: Mapping[str, Any] | None
    path: Path

    def error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(self.path, problem)

    def need(self, key: str) -> Any:
        if self.raw.get(key) is None:
            raise self.error(f"missing required key {key!r}")
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def require_activation(self, *accepted: str, key: str = "hidden_act", default: str = "silu") -> str:
        act = self.get(key, default)
        if act not in accepted:
            raise self.error(f"unsupported {key} {act!r} (supported: {', '.join(accepted)})")
        return act

    def rope(self, head_dim: int, aliases: Mapping[str, str] | None = None) -> RopeSettings:
        """The rope base and scaling of a model whose layers share one rope, for heads of ``head_dim``
        (engine/models/rope_config.py; ``aliases``: the family's legacy rope type names)."""
        try:
            return rope_settings_from_hf(self.raw, head_dim, self.max_position_embeddings(), aliases)
        except RopeConfigError as e:
            raise self.error(f"rope: {e}") from None

    def rope_by_layer_type(self, head_dim: int) -> dict[str, RopeSettings | None]:
        """Per layer type, the rope of a config.json that gives ``rope_parameters`` per layer type."""
        try:
            return rope_settings_by_layer_type_from_hf(self.raw, head_dim, self.max_position_embeddings())
        except RopeConfigError as e:
            raise self.error(f"rope: {e}") from None

    def max_position_embeddings(self) -> int:
        return int(self.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))

    def layer_types(self, num_layers: int) -> list[str] | None:
        """The file's ``layer_types`` list, checked; None when it has none."""
        types = self.raw.get("layer_types")
        if types is None:
            return None
        if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise self.error(
                f"layer_types must list {num_layers} entries of {', '.join(LAYER_TYPES)}, got {types!r}"
            )
        return list(types)

    def qwen_windows(self, num_layers: int) -> tuple[int | None, list[str] | None]:
        """Qwen2/Qwen3 (sliding_window, layer_types): with ``use_sliding_window`` the layers from
        ``max_window_layers`` on slide (transformers' rule), unless ``layer_types`` says otherwise."""
        if not self.raw.get("use_sliding_window"):
            return None, None
        window = int(self.need("sliding_window"))
        types = self.layer_types(num_layers)
        if types is None:
            first = int(self.get("max_window_layers", num_layers))
            types = [SLIDING if i >= first else FULL for i in range(num_layers)]
        return window, types

    def common(self, rope: RopeSettings | None = None) -> dict[str, Any]:
        """ModelConfig keyword arguments every family reads the same way; ``rope`` is the family's
        own reading (another head_dim, legacy type names, rope per layer type), else ``rope()``'s."""
        hidden = int(self.need("hidden_size"))
        heads = int(self.need("num_attention_heads"))
        if self.raw.get("mlp_bias"):
            raise self.error("unsupported mlp_bias=true")
        head_dim = int(self.raw.get("head_dim") or hidden // heads)
        if rope is None:
            rope = self.rope(head_dim)
        eos = _as_id_list((self.generation or {}).get("eos_token_id")) or _as_id_list(self.raw.get("eos_token_id"))
        bos = self.raw.get("bos_token_id")
        return dict(
            vocab_size=int(self.need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(self.need("intermediate_size")),
            num_layers=int(self.need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(self.raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(self.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope_scaling=rope.scaling,
            max_position_embeddings=self.max_position_embeddings(),
            tie_word_embeddings=bool(self.get("tie_word_embeddings", False)),
            bos_token_id=bos if isinstance(bos, int) else None,
            eos_token_ids=eos,
        )
