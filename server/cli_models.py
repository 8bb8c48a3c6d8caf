"""``protoserve models``: the installed models by short name, and what a running server has loaded."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from protoserve.engine.api import CatalogueEntry, ModelKind, ModelLoadError, catalogue, installed_bytes


@dataclass(frozen=True)
class ModelRow:
    """One line of the listing."""

    name: str
    family: str
    kind: str
    size: str
    quantization: str
    origin: str


def add_models_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        metavar="HOST:PORT",
        help="also list the models a running server has loaded (gRPC address)",
    )
    parser.add_argument("--api-key", help="API key for --server, when it requires one")
    parser.add_argument("--json", action="store_true", help="one JSON object per model instead of a table")


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _read_file(path: Path) -> tuple[str, ModelKind, str]:
    """(family, kind, quantization) read off a model an entry point registered."""
    if path.is_dir():
        if (path / "modules.json").is_file():
            return "sentence-transformers", ModelKind.EMBEDDING, "none"
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return str(config.get("model_type", "")), ModelKind.CHAT, "none"
    from gguf import GGUFReader, LlamaFileType

    fields = GGUFReader(path).fields
    family = fields["general.architecture"].contents() if "general.architecture" in fields else ""
    file_type = fields["general.file_type"].contents() if "general.file_type" in fields else None
    quantization = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    return str(family), ModelKind.CHAT, quantization


def describe(entry: CatalogueEntry) -> ModelRow:
    """The listing's row for an installed model; a broken install says so instead of failing the listing."""
    family, kind, quantization = entry.family, entry.kind, entry.quantization
    try:
        size = _size(installed_bytes(entry))
        if kind is None:
            family, kind, quantization = _read_file(entry.locate())
    except (ModelLoadError, OSError, ValueError, KeyError, ImportError) as exc:
        size = f"unavailable: {exc}"
    return ModelRow(entry.name, family, kind or "unknown", size, quantization, entry.origin)


def _server_rows(target: str, api_key: str | None) -> list[ModelRow]:
    import grpc

    from protoserve.v1 import inference_pb2 as pb
    from protoserve.v1 import inference_pb2_grpc as pb_grpc

    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.InferenceServiceStub(channel).ListModels(
            pb.ListModelsRequest(), timeout=10, metadata=metadata
        )
    return [
        ModelRow(
            m.name,
            m.architecture,
            m.kind or (ModelKind.CHAT if m.has_chat_template else ModelKind.COMPLETION),  # older servers: no kind
            "loaded",
            m.quantization,
            f"server {target}",
        )
        for m in reply.models
    ]


def _print(rows: list[ModelRow], as_json: bool) -> None:
    if as_json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return
    header = ModelRow("NAME", "FAMILY", "KIND", "SIZE", "QUANTIZATION", "FROM")
    table = [header, *rows]
    widths = [max(len(getattr(r, f)) for r in table) for f in ModelRow.__dataclass_fields__]
    for row in table:
        print(
            "  ".join(
                getattr(row, f).ljust(w) for f, w in zip(ModelRow.__dataclass_fields__, widths, strict=True)
            ).rstrip()
        )


def list_models(args: argparse.Namespace) -> int:
    """Print the installed models (and a server's); the exit code."""
    rows = [describe(entry) for entry in sorted(catalogue().values(), key=lambda e: e.name)]
    if args.server:
        import grpc

        try:
            rows += _server_rows(args.server, args.api_key)
        except grpc.RpcError as exc:
            print(f"protoserve: server {args.server}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            _print(rows, args.json)
            return 1
    _print(rows, args.json)
    return 0
