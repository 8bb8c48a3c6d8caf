"""Build backend of protoserve-client: setuptools plus two generation steps for wheels.

The gRPC stubs are generated from the repo's ``proto/`` tree whenever a wheel
is built, never committed. ``setup.py``'s ``build_py`` calls
:func:`generate_stubs`, which runs ``grpc_tools.protoc`` into
``protoserve_client/_pb/`` inside the build directory and rewrites the
generated absolute imports (``from protoserve.v1 ...``) to that private
package, so an installed wheel cannot clash with any other ``protoserve``
top-level package.

Only wheel builds need the generator: :func:`get_requires_for_build_wheel`
adds ``grpcio-tools`` (pinned, so the same protos always give the same code and
the runtime floors in ``pyproject.toml`` stay true). Editable installs in the
repo skip generation and use ``gen/python`` from ``make proto``, so they need
nothing beyond setuptools. An sdist carries a copy of the protos under
``protos/`` so a wheel can be built from it away from the repo.

The blocking client ``protoserve_client/client.py`` (with ``_sync_streams.py``)
is generated too, from the asyncio one in ``aio.py`` (with ``_aio_streams.py``),
by :func:`generate_sync_client` (unasync, also a
pinned wheel build requirement). Inside the repo ``make install`` runs the same
step through this file's ``__main__``; the generated files are never committed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - re-export every PEP 517/660 hook

# grpcio-tools 1.81.1 bundles protoc for protobuf 6.33.5 gencode; the generated
# modules refuse older runtimes, hence grpcio>=1.81.1 and protobuf>=6.33.5 in
# pyproject.toml. Change all three together.
GRPC_TOOLS_REQUIREMENT = "grpcio-tools==1.81.1"
# Pinned like protoc: the same aio.py always gives the same client.py.
UNASYNC_REQUIREMENT = "unasync==0.6.0"

# Directory of the sdist's proto copy, relative to the project root.
SDIST_PROTO_DIR = "protos"

PACKAGE = "protoserve_client._pb"

_IMPORT = re.compile(r"^(\s*)(from|import) protoserve\.", re.MULTILINE)
_BUILDER_MODULE = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')protoserve\.")


def get_requires_for_build_wheel(config_settings: dict[str, str | list[str]] | None = None) -> list[str]:
    """Setuptools' requirements plus the pinned generators of the stubs and the blocking client."""
    return [
        *_setuptools.get_requires_for_build_wheel(config_settings),
        GRPC_TOOLS_REQUIREMENT,
        UNASYNC_REQUIREMENT,
    ]


def find_proto_roots(project_dir: Path) -> tuple[Path, Path]:
    """The protoserve proto root and the vendored googleapis root to compile against.

    Looks in ``$PROTOSERVE_PROTO_ROOT`` (a repo checkout), then the sdist's
    copy, then the repo around ``clients/python``.
    """
    candidates = []
    if env := os.environ.get("PROTOSERVE_PROTO_ROOT"):
        candidates.append(Path(env))
    candidates += [project_dir / SDIST_PROTO_DIR, project_dir.parent.parent]
    for root in candidates:
        protos, googleapis = root / "proto", root / "third_party" / "googleapis"
        if (protos / "protoserve" / "v1" / "inference.proto").is_file() and googleapis.is_dir():
            return protos, googleapis
    raise FileNotFoundError(
        "protoserve protos not found; build from the repo (clients/python) or an sdist, "
        "or set PROTOSERVE_PROTO_ROOT to a protoserve checkout"
    )


def copy_protos(project_dir: Path, dest_root: Path) -> None:
    """Copy the protos an sdist needs to ``dest_root/protos`` in the repo's layout."""
    protos, googleapis = find_proto_roots(project_dir)
    base = dest_root / SDIST_PROTO_DIR
    shutil.copytree(protos, base / "proto", dirs_exist_ok=True)
    shutil.copytree(googleapis, base / "third_party" / "googleapis", dirs_exist_ok=True)


def _rewrite(source: str) -> str:
    """Point generated imports and module names at the private ``_pb`` package."""
    source = _IMPORT.sub(rf"\1\2 {PACKAGE}.protoserve.", source)
    return _BUILDER_MODULE.sub(rf"\1{PACKAGE}.protoserve.", source)


def generate_stubs(out_dir: Path, project_dir: Path) -> list[Path]:
    """Generate messages, ``.pyi`` stubs and gRPC stubs for every protoserve proto into ``out_dir``.

    ``out_dir`` becomes the ``protoserve_client._pb`` package. The google
    protos are only compile-time includes: their Python modules come from
    googleapis-common-protos and protobuf at run time.

    Raises:
        RuntimeError: when protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc

    protos, googleapis = find_proto_roots(project_dir)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    # The vendored Open Inference protos are the server's, served to tritonclient: not this client's.
    files = sorted(p.relative_to(protos).as_posix() for p in protos.rglob("*.proto") if "vendor" not in p.parts)
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{protos}",
                f"-I{googleapis}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *files,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed with exit code {rc}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        shutil.copytree(tmp, out_dir)
    written: list[Path] = []
    for path in sorted(out_dir.rglob("*")):
        if path.suffix in (".py", ".pyi"):
            path.write_text(_rewrite(path.read_text(encoding="utf-8")), encoding="utf-8")
            written.append(path)
    # protoc writes no __init__.py; the private tree must be regular packages
    # so it imports the same from a wheel, a zip or an unpacked sdist.
    for directory in [out_dir, *(d for d in out_dir.rglob("*") if d.is_dir())]:
        init = directory / "__init__.py"
        init.write_text('"""Generated from protoserve protos at build time; do not edit."""\n')
        written.append(init)
    return written


SYNC_CLIENT_HEADER = (
    "# Generated from aio.py by build_backend/protoserve_client_build.py (unasync); do not edit.\n"
)

# Each asyncio module and the blocking module generated from it.
SYNC_TWINS = {"aio.py": "client.py", "_aio_streams.py": "_sync_streams.py"}
# Module names the blocking code imports instead of the asyncio ones.
SYNC_MODULES = {"_aio_io": "_sync_io", "_aio_streams": "_sync_streams"}


def generate_sync_client(package_dir: Path) -> Path:
    """Write the blocking client's modules in ``package_dir`` from their asyncio twins.

    Returns ``client.py``, the blocking client; ``_sync_streams.py`` is written
    beside it from ``_aio_streams.py``. unasync drops every ``async`` and
    ``await``, turns ``__aenter__``, ``__anext__``, ``StopAsyncIteration`` and
    the like into their blocking twins, and here also every ``AsyncX`` name into
    ``X`` and each asyncio module name into its blocking one (``SYNC_MODULES``).
    """
    import unasync

    sources = [package_dir / name for name in SYNC_TWINS]
    async_names = {
        name for source in sources for name in re.findall(r"\bAsync[A-Z]\w*", source.read_text(encoding="utf-8"))
    }
    replacements = {name: name.removeprefix("Async") for name in async_names} | SYNC_MODULES
    rules = [
        unasync.Rule(f"{os.sep}{src}", f"{os.sep}{dst}", additional_replacements=replacements)
        for src, dst in SYNC_TWINS.items()
    ]
    unasync.unasync_files([str(source.absolute()) for source in sources], rules)
    for src, dst in SYNC_TWINS.items():
        out = package_dir / dst
        header = SYNC_CLIENT_HEADER.replace("aio.py", src)
        out.write_text(header + out.read_text(encoding="utf-8"), encoding="utf-8")
    return package_dir / "client.py"


if __name__ == "__main__":
    # `make install` in the repo: generate the editable package's client.py.
    generate_sync_client(Path(__file__).resolve().parent.parent / "protoserve_client")
