"""The model registry: one module per family, looked up by checkpoint names.

``FAMILIES`` maps a family name (ModelConfig.architecture) to its ``Family``
(family.py says what each declares). Loaders ask ``for_hf_model_type`` (a
config.json ``model_type``) or ``for_gguf_architecture`` (a GGUF
``general.architecture``); the Decoder asks ``get`` for the family of a config.
An unknown name is an error listing the supported ones.

Adding a family: a new module here building ``FAMILY = Family(...)``, listed in
``_MODULES``, plus its tests.
"""

from __future__ import annotations

from importlib import import_module

from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.families.family import Family

_MODULES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "starcoder2", "command_r", "phi3", "mixtral",
            "qwen3_moe", "token_moe", "deepseek")


def _load() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for module in _MODULES:
        family: Family = import_module(f"{__name__}.{module}").FAMILY
        if family.name in families:
            raise RuntimeError(f"two model families named {family.name!r}")
        families[family.name] = family
    return families


FAMILIES: dict[str, Family] = _load()
HF_MODEL_TYPES: dict[str, Family] = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
GGUF_ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.gguf_architectures}


class UnknownFamilyError(KeyError):
    """A checkpoint name no family claims; the message lists the supported names."""

    def __init__(self, kind: str, name: object, supported: list[str]) -> None:
        self.message = f"unknown {kind} {name!r}; supported {kind}s: {', '.join(sorted(supported))}"
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


def get(name: str) -> Family:
    """The family of ``ModelConfig.architecture``."""
    family = FAMILIES.get(name)
    if family is None:
        raise UnknownFamilyError("architecture", name, list(FAMILIES))
    return family


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor ``config``'s family needs, by Hugging Face name, with its shape."""
    return get(config.architecture).hf_shapes(config)


def for_hf_model_type(model_type: object) -> Family:
    family = HF_MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnknownFamilyError("model_type", model_type, list(HF_MODEL_TYPES))
    return family


def for_gguf_architecture(arch: object) -> Family:
    family = GGUF_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if family is None:
        raise UnknownFamilyError("architecture", arch, list(GGUF_ARCHITECTURES))
    return family
