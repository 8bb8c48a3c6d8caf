"""The llama.cpp peer's build cache: keys, lookup, the build's steps and its failure path (no real build:
pip, cmake and ninja are stood in for by scripts)."""

from __future__ import annotations

import io
import json
import os
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from bench.peers import llama_bench, llamacpp
from bench.peers.llamacpp import PeerBuildError

CPUINFO = "processor\t: 0\nflags\t\t: sse avx2 avx512f\nprocessor\t: 1\nflags\t\t: sse avx2 avx512f\n"
OTHER_CPU = "flags\t\t: sse avx2\n"


def test_cpu_flags_and_cache_key() -> None:
    assert llamacpp.cpu_flags(CPUINFO) == ("avx2", "avx512f", "sse")
    assert llamacpp.cpu_flags("no flags here") == ()
    key = llamacpp.cache_key("0.3.36", ("sse", "avx2"))
    assert key.startswith("0.3.36-") and len(key) == len("0.3.36-") + 12
    # Order and repeats do not matter; another flag set or version is another folder.
    assert key == llamacpp.cache_key("0.3.36", ("avx2", "sse", "sse"))
    assert key != llamacpp.cache_key("0.3.36", ("avx2",))
    assert key != llamacpp.cache_key("0.3.37", ("sse", "avx2"))


def test_cache_root_follows_the_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PROTOSERVE_PEER_CACHE", str(tmp_path))
    assert llamacpp.cache_root() == tmp_path
    monkeypatch.delenv("PROTOSERVE_PEER_CACHE")
    assert llamacpp.cache_root() == Path.home() / ".cache" / "protoserve" / "llama.cpp"


def _install(folder: Path, names=llamacpp.TARGETS, info: dict | None = None) -> None:
    (folder / "bin").mkdir(parents=True)
    for name in names:
        path = folder / "bin" / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    if info is not None:
        (folder / llamacpp.BUILD_INFO).write_text(json.dumps(info))


def test_find_says_why_when_nothing_is_built(tmp_path: Path) -> None:
    found = llamacpp.find(tmp_path, CPUINFO)
    assert found.binaries is None
    assert "make bench-peers" in found.reason and "llama-server" in found.reason and "llama-bench" in found.reason


def test_find_names_the_missing_binary_and_ignores_other_cpus(tmp_path: Path) -> None:
    _install(llamacpp.build_dir(tmp_path, cpuinfo=CPUINFO), names=("llama-server",))
    found = llamacpp.find(tmp_path, CPUINFO)
    assert found.binaries is None and "llama-bench missing" in found.reason
    _install(llamacpp.build_dir(tmp_path, cpuinfo=OTHER_CPU), info={"commit": "abc1234"})
    assert llamacpp.find(tmp_path, CPUINFO).binaries is None  # built for another CPU


def test_find_returns_the_build_and_its_provenance(tmp_path: Path) -> None:
    folder = llamacpp.build_dir(tmp_path, cpuinfo=CPUINFO)
    _install(folder, info={"version": "0.3.36", "commit": "0c1e570"})
    found = llamacpp.find(tmp_path, CPUINFO)
    assert found.binaries is not None and found.reason == ""
    assert found.binaries.server == folder / "bin" / "llama-server"
    assert found.binaries.bench == folder / "bin" / "llama-bench"
    assert found.binaries.describe() == "llama.cpp 0c1e570 (llama-cpp-python 0.3.36 sdist)"


def test_the_peer_does_not_inherit_the_benchs_openmp_wait_policy(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what bench/__init__.py sets for the bench's torch
    env = llamacpp.peer_env()
    assert "OMP_WAIT_POLICY" not in env and env["PATH"] == os.environ["PATH"]
    assert llamacpp.peer_env({"OMP_WAIT_POLICY": "ACTIVE", "X": "1"}) == {"X": "1"}
    # llama-bench really runs without it: a stand-in reports the policy it was given as its rate.
    row = '[{"n_prompt":512,"n_gen":0,"flash_attn":1,"avg_ts":"%s","stddev_ts":0,"n_threads":2}]'
    fake = _script(tmp_path / "llama-bench", f"printf '{row}' \"${{OMP_WAIT_POLICY:-7}}\"")
    [result] = llama_bench.run([fake])
    assert result.tokens_per_s == 7.0


def test_commands() -> None:
    assert llamacpp.download_command("0.3.36", Path("/d"))[1:] == [
        "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "llama-cpp-python==0.3.36", "-d", "/d",
    ]  # fmt: skip
    configure = llamacpp.configure_command("cmake", "/x/ninja", Path("/src"), Path("/b"), "0c1e570")
    assert configure[:7] == ["cmake", "-S", "/src", "-B", "/b", "-G", "Ninja"]
    for define in ("GGML_NATIVE=ON", "BUILD_SHARED_LIBS=OFF", "LLAMA_BUILD_TESTS=OFF", "LLAMA_BUILD_EXAMPLES=OFF",
                   "LLAMA_BUILD_SERVER=ON", "LLAMA_USE_PREBUILT_UI=OFF", "CMAKE_MAKE_PROGRAM=/x/ninja",
                   "LLAMA_BUILD_COMMIT=0c1e570"):
        assert f"-D{define}" in configure
    assert llamacpp.compile_command("ninja", Path("/b"), 2) == ["ninja", "-C", "/b", "-j", "2", "llama-server",
                                                                "llama-bench"]


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _sdist(path: Path, with_llama: bool = True) -> None:
    """A tarball shaped like llama-cpp-python's sdist: vendor/llama.cpp and the submodule's recorded HEAD."""
    with tarfile.open(path, "w:gz") as tar:
        files = {"llama_cpp_python-0.3.36/.git/modules/vendor/llama.cpp/HEAD": b"0c1e57098bba43ac\n"}
        if with_llama:
            files["llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt"] = b"project(llama)\n"
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


NINJA_OK = ('mkdir -p "$2/bin" && for t in llama-server llama-bench; do '
            'printf "#!/bin/sh\\n" > "$2/bin/$t"; chmod +x "$2/bin/$t"; done')


@pytest.fixture
def fake_toolchain(monkeypatch, tmp_path: Path):
    """pip download copies a prepared sdist; cmake does nothing; ninja makes the two binaries (or fails)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    sdist = tools / "llama_cpp_python-0.3.36.tar.gz"
    _sdist(sdist)
    monkeypatch.setattr(llamacpp, "download_command",
                        lambda version, dest: ["sh", "-c", f"mkdir -p {dest} && cp {sdist} {dest}/"])
    cmake = _script(tools / "cmake", "exit 0")
    ninja = _script(tools / "ninja", NINJA_OK)
    monkeypatch.setattr(llamacpp, "tool", lambda name: {"cmake": cmake, "ninja": ninja}[name])
    monkeypatch.setattr(llamacpp, "read_cpuinfo", lambda: CPUINFO)
    return tools


def test_build_caches_the_binaries_once(fake_toolchain: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    binaries = llamacpp.build(cache, jobs=1)
    folder = llamacpp.build_dir(cache, cpuinfo=CPUINFO)
    assert binaries.server == folder / "bin" / "llama-server" and os.access(binaries.bench, os.X_OK)
    assert binaries.commit == "0c1e570"
    info = json.loads((folder / llamacpp.BUILD_INFO).read_text())
    assert info["version"] == llamacpp.LLAMA_CPP_PYTHON_VERSION and "-DGGML_NATIVE=ON" in info["cmake"]
    assert sorted(p.name for p in cache.iterdir()) == [folder.name]  # no staging folder left behind
    assert not list(cache.glob("*.failed"))
    # A second build finds the cache and runs nothing.
    Path(fake_toolchain / "ninja").write_text("#!/bin/sh\nexit 9\n")
    assert llamacpp.build(cache) == binaries


def test_failed_build_leaves_no_cache_and_says_why(fake_toolchain: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    _script(fake_toolchain / "ninja", "echo 'error: no AVX for you' >&2; exit 3")
    cache = tmp_path / "cache"
    monkeypatch.setenv("PROTOSERVE_PEER_CACHE", str(cache))
    with pytest.raises(PeerBuildError, match=r"compile failed \(exit 3\)[\s\S]*no AVX for you"):
        llamacpp.build(cache)
    found = llamacpp.find(cache)
    assert found.binaries is None
    assert "last build failed (compile failed (exit 3)" in found.reason  # what the skipped figures say
    assert llamacpp.main(["build"]) == 1
    assert "the bench skips its figures" in capsys.readouterr().err
    assert llamacpp.main(["find"]) == 1
    _script(fake_toolchain / "ninja", NINJA_OK)  # fixed: the next build succeeds and forgets the failure
    assert llamacpp.main(["build"]) == 0 and llamacpp.find(cache).binaries is not None
    assert not list(cache.glob("*.failed"))


def test_sdist_without_llama_cpp_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "x.tar.gz"
    _sdist(archive, with_llama=False)
    (tmp_path / "src").mkdir()
    with pytest.raises(PeerBuildError, match="no vendor/llama.cpp"):
        llamacpp._unpack(archive, tmp_path / "src")


def test_tool_prefers_path_then_the_venv(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    _script(tmp_path / "cmake", "exit 0")
    assert llamacpp.tool("cmake") == str(tmp_path / "cmake")
    beside = Path(sys.executable).parent / "python"
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    assert llamacpp.tool(beside.name) == str(beside)
