"""The kernels' build cache: one folder per CPU and sources' content, and no hang on a dead builder's lock."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from protoserve.kernels.cpu import extension


def test_the_same_sources_anywhere_share_one_build_and_a_change_gets_its_own(monkeypatch, tmp_path):
    here = extension.build_dir()
    other = tmp_path / "another-checkout" / "kernels" / "cpu"
    other.mkdir(parents=True)
    for path in extension.source_files():
        shutil.copy2(path, other / path.name)
    monkeypatch.setattr(extension, "SOURCE_DIR", other)
    assert extension.build_dir() == here  # another checkout of the same sources: no second compile
    header = other / "simd.h"
    header.write_text(header.read_text() + "\n// changed\n")  # a header counts as a source
    assert extension.build_dir() != here
    assert extension.build_dir().parent == here.parent  # same cache, same CPU: only the key differs


def test_a_venv_with_its_own_torch_builds_apart(monkeypatch, tmp_path):
    """The build links torch by path: a venv with its own torch sharing the folder would rebuild it
    for itself, and every checkout on the other torch would rebuild it back."""
    here = extension.build_dir()
    monkeypatch.setattr(extension.torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))
    assert extension.build_dir() != here


@pytest.mark.skipif(extension.load("linear") is None, reason="no CPU kernels on this machine")
def test_a_lock_left_by_a_killed_build_does_not_block_loading():
    """PyTorch's build lock is a plain file: a builder killed mid-compile leaves it, and without
    our flock every later load would wait on it forever. Left in the real build folder (whose build
    is finished, so nothing compiles), as a server killed while it compiled would leave it."""
    directory = extension.build_dir()
    (directory / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from protoserve.kernels.cpu.extension import _module; print(_module() is not None)"],
        capture_output=True, text=True, timeout=120,
    )
    assert loaded.stdout.strip() == "True", loaded.stderr
    assert not (directory / "lock").exists()
    assert "stale kernel build lock" in loaded.stderr


def test_a_venv_linking_this_torch_shares_its_build(monkeypatch, tmp_path):
    """A venv that reaches this torch's files through links (tests/packaging/test_wheel.py's) links the
    same libraries: it loads the build already made instead of compiling its own."""
    here = extension.build_dir()
    linked = tmp_path / "shared-torch" / "torch"
    linked.parent.mkdir()
    linked.symlink_to(extension.Path(extension.torch.__file__).resolve().parent)
    monkeypatch.setattr(extension.torch, "__file__", str(linked / "__init__.py"))
    assert extension.build_dir() == here


@pytest.mark.skipif(extension.load("linear") is None, reason="no CPU kernels on this machine")
def test_a_finished_build_loads_without_the_toolchain():
    """Without ninja or a compiler on PATH, the finished build still loads: a process only asks ninja
    when the folder holds no module, so a venv writing other include paths into build.ninja cannot
    make every later load rebuild."""
    loaded = subprocess.run(
        [sys.executable, "-c", "from protoserve.kernels.cpu.extension import _module; print(_module() is not None)"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/nonexistent", "HOME": str(extension.Path.home())},
    )
    assert loaded.stdout.strip() == "True", loaded.stderr


@pytest.mark.skipif(extension.load("linear") is None, reason="no CPU kernels on this machine")
@pytest.mark.parametrize("keep", [14, 1000, -1], ids=["header", "first-kib", "all-but-a-byte"])
def test_a_module_cut_short_is_removed_not_loaded(tmp_path, keep):
    """A module file cut short (a process killed while it linked) is not loaded: dlopen dies of SIGBUS
    on one that still has its headers (so this runs in a process of its own). It is removed, and
    ninja then links it again from the objects instead of keeping a file newer than they are."""
    module = tmp_path / f"{extension.MODULE_NAME}.so"
    module.write_bytes(extension.build_dir().joinpath(module.name).read_bytes()[:keep])
    probe = "import sys; from pathlib import Path; from protoserve.kernels.cpu.extension import _built_module; "
    probe += "print(_built_module(Path(sys.argv[1])))"
    loaded = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0 and loaded.stdout.strip() == "None", loaded.stderr
    assert "does not load" in loaded.stderr
    assert not module.exists()


def test_nothing_built_yet_is_nothing_to_load(tmp_path):
    assert extension._built_module(tmp_path) is None


def test_only_an_elf_file_is_judged_cut_short(tmp_path):
    path = tmp_path / "module.so"
    for content, cut in ((b"", True), (b"\x7fELF\x02\x01", True), (b"\xcf\xfa\xed\xfe" + bytes(60), False)):
        path.write_bytes(content)  # empty, an ELF header's first bytes, a Mach-O header (not ours to judge)
        assert extension._cut_short(path) is cut, content
