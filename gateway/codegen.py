"""Everything generated from ``proto/``, in three protoc runs: used by ``make proto`` and by wheel builds.

Writes under ``<out>/python``: the message modules, ``.pyi`` stubs and gRPC
stubs (``protoserve/v1``, ``protoserve/openai/v1``, ``protoserve/options/v1``),
and in ``protoserve/generated/`` the gateway's route table (``routes.py``,
from our protoc plugin), its OpenAPI document (``openapi.json``) and the
descriptor set with imports and source info that the plugin and Envoy read
(``protoserve.binpb``).

The vendored Open Inference Protocol protos (``proto/vendor/triton/``) are
compiled under their upstream names, with their own folder as the include
root, so their descriptors are byte for byte those ``tritonclient`` ships and
both load into one process; their modules go to ``protoserve/open_inference/``
(with their imports of each other pointed there, as tritonclient does for its
copy). Their REST routes come from ``http_rules.yaml`` beside them.

It needs only ``grpcio-tools`` and the repository's ``proto/`` and
``third_party/googleapis/``, so setup.py can load it by file path inside an
isolated build before protoserve itself is importable. The plugin runs as
``python -m protoserve.gateway.protoc_gen_gateway``, with ``plugin_path`` (a
directory holding the ``protoserve`` package, for a build that has not installed
it) first on its path.
"""

from __future__ import annotations

import re
import stat
import sys
import tempfile
from pathlib import Path

GENERATED_PACKAGE = Path("protoserve") / "generated"
# Under proto/: upstream protos kept unmodified, each folder its own include root.
VENDOR_DIR = Path("vendor")
OPEN_INFERENCE_ROOT = VENDOR_DIR / "triton"
OPEN_INFERENCE_PACKAGE = "protoserve.open_inference"
OPEN_INFERENCE_HTTP_RULES = "http_rules.yaml"


def proto_files(proto_root: Path) -> list[str]:
    """Our own protos (the vendored ones are compiled from their own root)."""
    return sorted(
        str(p.relative_to(proto_root))
        for p in proto_root.rglob("*.proto")
        if not p.relative_to(proto_root).is_relative_to(VENDOR_DIR)
    )


def vendored_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.proto"))


def generate(repo: Path, out: Path, *, plugin_path: Path | None = None, python: str = sys.executable) -> None:
    """Run protoc over ``repo/proto`` into ``out`` (which must not exist yet, or be empty)."""
    import grpc_tools
    from grpc_tools import protoc

    proto_root = repo / "proto"
    generated = out / "python" / GENERATED_PACKAGE
    generated.mkdir(parents=True, exist_ok=True)
    includes = [f"-I{proto_root}", f"-I{repo / 'third_party' / 'googleapis'}",
                f"-I{Path(grpc_tools.__file__).parent / '_proto'}"]
    oip_root = proto_root / OPEN_INFERENCE_ROOT
    _generate_vendored(protoc, oip_root, out / "python", OPEN_INFERENCE_PACKAGE)
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
        _protoc(protoc, [*includes, f"-I{oip_root}", f"--plugin=protoc-gen-gateway={launcher}",
                         f"--gateway_opt=http_rules={oip_root / OPEN_INFERENCE_HTTP_RULES}",
                         f"--gateway_opt=vendored_package={OPEN_INFERENCE_PACKAGE}",
                         f"--gateway_out={out / 'python'}", *proto_files(proto_root), *vendored_files(oip_root)])


def _generate_vendored(protoc, root: Path, out: Path, package: str) -> None:
    """Compile the protos of ``root`` under their own names into the Python package ``package``."""
    files = vendored_files(root)
    target = out.joinpath(*package.split("."))
    with tempfile.TemporaryDirectory() as tmp:
        _protoc(protoc, [f"-I{root}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", *files])
        target.mkdir(parents=True, exist_ok=True)
        modules = [name.removesuffix(".proto") + "_pb2" for name in files]
        for generated in sorted(Path(tmp).iterdir()):
            text = generated.read_text()
            # protoc imports a root-level proto as a top-level module; ours live in the package.
            text = re.sub(rf"^import ({'|'.join(modules)}) as ", rf"from {package} import \1 as ", text, flags=re.M)
            (target / generated.name).write_text(text)


def _protoc(protoc, args: list[str]) -> None:
    code = protoc.main(["grpc_tools.protoc", *args])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")


if __name__ == "__main__":
    # python gateway/codegen.py OUT: what `make proto` runs, in the venv where protoserve is installed.
    generate(Path(__file__).resolve().parents[1], Path(sys.argv[1]))
