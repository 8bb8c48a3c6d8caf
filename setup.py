"""setuptools hooks: the repository's top-level folders become ``protoserve.*``, and wheels carry gen/.

The repository keeps ``server/``, ``engine/``, ``kernels/`` and ``gateway/`` at
its top (the layout the design fixes); installed, they are ``protoserve.server``,
``protoserve.engine``, ``protoserve.kernels`` and ``protoserve.gateway``, beside
the generated ``protoserve.v1``, ``protoserve.openai.v1``, ``protoserve.options.v1``
and ``protoserve.generated`` (no module of ours is a top-level name another project
could share). A wheel build generates that code with ``gateway/codegen.py``, the
same protoc run as ``make proto``; editable installs use the repo's ``gen/python``
(found through the ``.pth`` file ``make install`` writes), so they never hold a
copy that goes stale on the next proto change.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
LAYERS = ("server", "engine", "kernels", "gateway")


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for layer in LAYERS:
        package_dir[f"protoserve.{layer}"] = layer
        packages.append(f"protoserve.{layer}")
        packages += [f"protoserve.{layer}.{sub}" for sub in find_packages(layer)]
    return packages, package_dir


class BuildPyWithGeneratedCode(build_py):
    """build_py that also runs protoc into the wheel (not for editable installs)."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        spec = importlib.util.spec_from_file_location("protoserve_codegen", HERE / "gateway" / "codegen.py")
        codegen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(codegen)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "gen"
            # The plugin imports protoserve.gateway: the copy build_py just laid in build_lib.
            codegen.generate(HERE, out, plugin_path=Path(self.build_lib))
            shutil.copytree(out / "python", self.build_lib, dirs_exist_ok=True)


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    cmdclass={"build_py": BuildPyWithGeneratedCode},
)
