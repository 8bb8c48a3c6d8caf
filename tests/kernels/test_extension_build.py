"""The kernels' build cache: one folder per CPU and sources' content, and no hang on a dead builder's lock."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from protoserve.kernels.cpu import extension


def test_the_same_sources_anywhere_share_one_build_and_a_change_gets_its_own(monkeypatch, tmp_path):
    here = extension.build_dir()
    other = tmp_path / "another-checkout" / "kernels" / "cpu"
    other.mkdir(parents=True)
    for path in extension.source_files():
        shutil.copy2(path, other / path.name)
    monkeypatch.setattr(extension, "SOURCE_DIR", other)
    assert extension.build_dir() == here  # a fresh venv's copy of the same sources: no second compile
    header = other / "simd.h"
    header.write_text(header.read_text() + "\n// changed\n")  # a header counts as a source
    assert extension.build_dir() != here
    assert extension.build_dir().parent == here.parent  # same cache, same CPU: only the key differs


@pytest.mark.skipif(extension.load("linear") is None, reason="no CPU kernels on this machine")
def test_a_lock_left_by_a_killed_build_does_not_block_loading(tmp_path):
    """PyTorch's build lock is a plain file: a builder killed mid-compile leaves it, and without
    our flock every later load would wait on it forever."""
    env = {**os.environ, "PROTOSERVE_KERNEL_CACHE": str(tmp_path)}
    where = subprocess.run(
        [sys.executable, "-c", "from protoserve.kernels.cpu.extension import build_dir; print(build_dir())"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    stale = Path(where)
    # The finished build from the real cache (so nothing compiles here), plus a dead builder's lock.
    shutil.copytree(extension.build_dir(), stale, ignore=shutil.ignore_patterns("lock", "build.flock"))
    (stale / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from protoserve.kernels.cpu.extension import _module; print(_module() is not None)"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert loaded.stdout.strip() == "True", loaded.stderr
    assert not (stale / "lock").exists()
    assert "stale kernel build lock" in loaded.stderr
