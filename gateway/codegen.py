"""Everything generated from ``proto/``, in two protoc runs: used by ``make proto`` and by wheel builds.

Writes under ``<out>/python``: the message modules, ``.pyi`` stubs and gRPC
stubs (``protoserve/v1``, ``protoserve/openai/v1``, ``protoserve/options/v1``),
and in ``protoserve/generated/`` the gateway's route table (``routes.py``,
from our protoc plugin), its OpenAPI document (``openapi.json``) and the
descriptor set with imports and source info that the plugin and Envoy read
(``protoserve.binpb``).

It needs only ``grpcio-tools`` and the repository's ``proto/`` and
``third_party/googleapis/``, so setup.py can load it by file path inside an
isolated build before protoserve itself is importable. The plugin runs as
``python -m protoserve.gateway.protoc_gen_gateway``, with ``plugin_path`` (a
directory holding the ``protoserve`` package, for a build that has not installed
it) first on its path.
"""

from __future__ import annotations

import stat
import sys
import tempfile
from pathlib import Path

GENERATED_PACKAGE = Path("protoserve") / "generated"


def proto_files(proto_root: Path) -> list[str]:
    return sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))


def generate(repo: Path, out: Path, *, plugin_path: Path | None = None, python: str = sys.executable) -> None:
    """Run protoc over ``repo/proto`` into ``out`` (which must not exist yet, or be empty)."""
    import grpc_tools
    from grpc_tools import protoc

    proto_root = repo / "proto"
    generated = out / "python" / GENERATED_PACKAGE
    generated.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{proto_root}", f"-I{repo / 'third_party' / 'googleapis'}",
                f"-I{Path(grpc_tools.__file__).parent / '_proto'}"]
    # First the messages: the plugin reads our own options (protoserve.options.v1) through them, and a
    # clean build has no other copy.
    _protoc(protoc, [
        *includes,
        f"--python_out={out / 'python'}",
        f"--pyi_out={out / 'python'}",
        f"--grpc_python_out={out / 'python'}",
        "--include_imports",
        "--include_source_info",
        f"--descriptor_set_out={generated / 'protoserve.binpb'}",
        *proto_files(proto_root),
    ])
    with tempfile.TemporaryDirectory() as tmp:
        # protoc runs plugins as programs: a launcher with this interpreter and path.
        launcher = Path(tmp) / "protoc-gen-gateway"
        path = ":".join(str(p) for p in (plugin_path, out / "python") if p is not None)
        launcher.write_text(
            f"#!/bin/sh\nPYTHONPATH='{path}'${{PYTHONPATH:+:$PYTHONPATH}} "
            f"exec '{python}' -m protoserve.gateway.protoc_gen_gateway\n"
        )
        launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
        _protoc(protoc, [*includes, f"--plugin=protoc-gen-gateway={launcher}", f"--gateway_out={out / 'python'}",
                         *proto_files(proto_root)])


def _protoc(protoc, args: list[str]) -> None:
    code = protoc.main(["grpc_tools.protoc", *args])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    # python gateway/codegen.py OUT: what `make proto` runs, in the venv where protoserve is installed.
    generate(Path(__file__).resolve().parents[1], Path(sys.argv[1]))
