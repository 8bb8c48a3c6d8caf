"""setuptools hooks that generate code (gRPC stubs, the blocking client) into wheels and put protos into sdists.

Metadata lives in pyproject.toml; the generation itself is in
build_backend/protoserve_client_build.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "build_backend"))

import protoserve_client_build  # noqa: E402 - found through the path set just above


class BuildPyWithGenerated(build_py):
    """build_py that also generates ``_pb`` from the protos and ``client.py`` from ``aio.py``.

    Not for editable installs.
    """

    def run(self) -> None:
        super().run()
        # Editable installs live in the repo, whose gen/python (make proto)
        # provides the stubs and `make install` the client; generating here
        # would leave copies that go stale on the next change.
        if self.editable_mode:
            return
        package_dir = Path(self.build_lib) / "protoserve_client"
        protoserve_client_build.generate_stubs(package_dir / "_pb", HERE)
        protoserve_client_build.generate_sync_client(package_dir)


class SdistWithProtos(sdist):
    """sdist that carries the protos, so a wheel can be built from it outside the repo."""

    def make_release_tree(self, base_dir: str, files: list[str]) -> None:
        super().make_release_tree(base_dir, files)
        protoserve_client_build.copy_protos(HERE, Path(base_dir))


setup(cmdclass={"build_py": BuildPyWithGenerated, "sdist": SdistWithProtos})
