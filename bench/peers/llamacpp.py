"""llama.cpp as the bench's peer: ``llama-server`` and ``llama-bench``, built once for this CPU.

``make bench-peers`` (``python -m bench.peers.llamacpp build``) downloads the
``llama-cpp-python`` sdist pinned below, builds the llama.cpp it vendors with
``GGML_NATIVE=ON`` (minutes on 2 cores) and keeps the two binaries
under ``~/.cache/protoserve/llama.cpp/<version>-<hash of the CPU's flags>/bin``
(``$PROTOSERVE_PEER_CACHE`` moves the root): a home directory shared by
machines with different CPUs must not run a build made for another's
instructions. ``make bench`` never builds: its peer sections call ``find()``,
and a peer that is not there is a skipped figure with the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The sdist vendors llama.cpp 0c1e570; a new pin is a new cache folder, never a stale binary.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-bench")
# LLAMA_CURL is gone from this llama.cpp (only a deprecation warning remains). The server's web UI
# would be fetched from the network by default and TLS needs OpenSSL headers: neither is wanted for
# a loopback benchmark, and the build must work with no network beyond the package registries.
CMAKE_DEFINES = (
    "CMAKE_BUILD_TYPE=Release",
    "GGML_NATIVE=ON",
    "BUILD_SHARED_LIBS=OFF",
    "LLAMA_BUILD_TESTS=OFF",
    "LLAMA_BUILD_EXAMPLES=OFF",
    "LLAMA_BUILD_TOOLS=ON",
    "LLAMA_BUILD_SERVER=ON",
    "LLAMA_BUILD_UI=OFF",
    "LLAMA_USE_PREBUILT_UI=OFF",
    "LLAMA_OPENSSL=OFF",
    "GGML_CCACHE=OFF",
)
BUILD_INFO = "build.json"
FAILED_SUFFIX = ".failed"  # beside the cache folder: why the last build for this pin and CPU failed


# The bench process sets OpenMP's passive wait policy for its own torch (bench/__init__.py); llama.cpp's CPU
# backend is OpenMP too, and inheriting it puts its threads to sleep between the hundreds of ops of each
# token: llama-bench tg128 fell from 165-169 to 49-52 tokens/s (pp512 unchanged). The peer runs as a user
# starts it from a shell, on its own defaults.
NOT_INHERITED = ("OMP_WAIT_POLICY",)


def peer_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment llama-server and llama-bench run in: this one, less what the bench set for itself."""
    source = dict(os.environ) if environ is None else environ
    return {k: v for k, v in source.items() if k not in NOT_INHERITED}


class PeerBuildError(RuntimeError):
    """The peer could not be built; the message says which step failed and why."""


@dataclass(frozen=True)
class LlamaCppBinaries:
    """A finished build: the two programs and what they were built from."""

    server: Path
    bench: Path
    version: str
    commit: str

    def describe(self) -> str:
        return f"llama.cpp {self.commit} (llama-cpp-python {self.version} sdist)"


@dataclass(frozen=True)
class Lookup:
    """What ``find`` found: the binaries, or None and the reason a peer figure is skipped."""

    binaries: LlamaCppBinaries | None
    reason: str = ""


def cpu_flags(cpuinfo: str) -> tuple[str, ...]:
    """The CPU's feature flags from /proc/cpuinfo's text, sorted (the first ``flags`` line: every core
    lists the same ones)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return tuple(sorted(set(line.split(":", 1)[1].split())))
    return ()


def cache_key(version: str, flags: Sequence[str]) -> str:
    """``<version>-<12 hex digits of the flags' hash>``: one folder per pin and instruction set."""
    digest = hashlib.sha256(" ".join(sorted(set(flags))).encode()).hexdigest()[:12]
    return f"{version}-{digest}"


def cache_root() -> Path:
    default = Path.home() / ".cache" / "protoserve" / "llama.cpp"
    return Path(os.environ.get("PROTOSERVE_PEER_CACHE", default))


def read_cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def build_dir(root: Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION, cpuinfo: str | None = None) -> Path:
    """The cache folder of this pin on this CPU."""
    flags = cpu_flags(read_cpuinfo() if cpuinfo is None else cpuinfo)
    return (cache_root() if root is None else root) / cache_key(version, flags)


def find(root: Path | None = None, cpuinfo: str | None = None) -> Lookup:
    """The cached build for this pin and CPU, or None with the reason (never builds)."""
    folder = build_dir(root, cpuinfo=cpuinfo)
    missing = [name for name in TARGETS if not os.access(folder / "bin" / name, os.X_OK)]
    if missing:
        try:
            failed = folder.with_name(folder.name + FAILED_SUFFIX).read_text().strip().splitlines()[0]
            return Lookup(None, f"the llama.cpp peer's last build failed ({failed}); see `make bench-peers`")
        except (OSError, IndexError):
            pass
        return Lookup(
            None,
            f"llama.cpp peer not built for this CPU ({', '.join(missing)} missing under {folder}/bin): "
            f"run `make bench-peers`",
        )
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
    except (OSError, ValueError):
        info = {}
    return Lookup(
        LlamaCppBinaries(
            server=folder / "bin" / "llama-server",
            bench=folder / "bin" / "llama-bench",
            version=str(info.get("version", LLAMA_CPP_PYTHON_VERSION)),
            commit=str(info.get("commit", "unknown")),
        )
    )


def download_command(version: str, dest: Path) -> list[str]:
    """pip fetches the sdist itself (not a wheel: the wheel has no server, and is built for no CPU)."""
    return [
        sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
        f"llama-cpp-python=={version}", "-d", str(dest),
    ]  # fmt: skip


def configure_command(cmake: str, ninja: str, source: Path, build: Path, commit: str) -> list[str]:
    defines = [*CMAKE_DEFINES, f"CMAKE_MAKE_PROGRAM={ninja}", f"LLAMA_BUILD_COMMIT={commit}"]
    return [cmake, "-S", str(source), "-B", str(build), "-G", "Ninja", *(f"-D{d}" for d in defines)]


def compile_command(ninja: str, build: Path, jobs: int) -> list[str]:
    return [ninja, "-C", str(build), "-j", str(jobs), *TARGETS]


def tool(name: str) -> str:
    """``name`` on PATH or beside this interpreter; installed with pip into the venv when neither."""
    beside = Path(sys.executable).parent / name
    found = shutil.which(name) or (str(beside) if os.access(beside, os.X_OK) else None)
    if found:
        return found
    _run([sys.executable, "-m", "pip", "install", "--quiet", name], f"pip install {name}")
    if not os.access(beside, os.X_OK):
        raise PeerBuildError(f"pip installed {name} but {beside} is not there")
    return str(beside)


def vendored_commit(sdist_root: Path) -> str:
    """llama.cpp's commit as the sdist's git metadata records it ('unknown' without it)."""
    head = sdist_root / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    try:
        return head.read_text().strip()[:7] or "unknown"
    except OSError:
        return "unknown"


def _run(command: Sequence[str], step: str, log: Path | None = None) -> None:
    print(f"bench-peers: {step}: {' '.join(command)}", file=sys.stderr, flush=True)
    if log is None:
        done = subprocess.run(command, capture_output=True, text=True)
        output = done.stdout + done.stderr
    else:
        with open(log, "a") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True)
        output = log.read_text(errors="replace")
    if done.returncode != 0:
        raise PeerBuildError(f"{step} failed (exit {done.returncode}):\n{output[-3000:]}")


def _unpack(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    roots = [p for p in into.iterdir() if p.is_dir()]
    if len(roots) != 1 or not (roots[0] / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        raise PeerBuildError(f"{archive.name} has no vendor/llama.cpp/CMakeLists.txt")
    return roots[0]


def build(root: Path | None = None, jobs: int | None = None, force: bool = False) -> LlamaCppBinaries:
    """Build the peer into its cache folder (a no-op when it is there, unless ``force``). A failure is
    also written beside the folder, so the bench's skipped figures can say why."""
    failed = build_dir(root).with_name(build_dir(root).name + FAILED_SUFFIX)
    try:
        binaries = _build(root, jobs, force)
    except PeerBuildError as exc:
        failed.parent.mkdir(parents=True, exist_ok=True)
        failed.write_text(f"{exc}\n")
        raise
    failed.unlink(missing_ok=True)
    return binaries


def _build(root: Path | None, jobs: int | None, force: bool) -> LlamaCppBinaries:
    found = find(root)
    if found.binaries is not None and not force:
        print(f"bench-peers: {found.binaries.describe()} already built: {found.binaries.server.parent}", file=sys.stderr)
        return found.binaries
    folder = build_dir(root)
    folder.parent.mkdir(parents=True, exist_ok=True)
    cmake, ninja = tool("cmake"), tool("ninja")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="protoserve-llamacpp-") as tmp:
        work = Path(tmp)
        _run(download_command(LLAMA_CPP_PYTHON_VERSION, work / "sdist"), "download the sdist")
        archives = sorted((work / "sdist").glob("*.tar.gz"))
        if not archives:
            raise PeerBuildError("pip download left no .tar.gz sdist")
        sdist = _unpack(archives[0], work / "src")
        commit = vendored_commit(sdist)
        build_tree = work / "build"
        log = work / "build.log"
        _run(configure_command(cmake, ninja, sdist / "vendor" / "llama.cpp", build_tree, commit), "configure", log)
        _run(compile_command(ninja, build_tree, jobs or os.cpu_count() or 1), "compile", log)
        # Assembled beside the cache folder, then renamed: an interrupted build leaves no half folder.
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the build from other users of a shared cache
        (staging / "bin").mkdir()
        for name in TARGETS:
            shutil.copy2(build_tree / "bin" / name, staging / "bin" / name)
        info = {
            "version": LLAMA_CPP_PYTHON_VERSION,
            "commit": commit,
            "cmake": configure_command(cmake, ninja, Path("<src>"), Path("<build>"), commit)[1:],
            "build_seconds": round(time.monotonic() - started),
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        (staging / BUILD_INFO).write_text(json.dumps(info, indent=1) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    binaries = find(root).binaries
    if binaries is None:
        raise PeerBuildError(f"the build finished but {folder}/bin lacks {', '.join(TARGETS)}")
    print(f"bench-peers: built {binaries.describe()} in {info['build_seconds']} s: {folder}/bin", file=sys.stderr)
    return binaries


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers.llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("build", "find"), help="build the peer (once), or say where it is")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has this build")
    parser.add_argument("--jobs", type=int, help="parallel compile jobs [the CPU count]")
    args = parser.parse_args(argv)
    if args.command == "find":
        found = find()
        print(found.binaries.server.parent if found.binaries else found.reason)
        return 0 if found.binaries else 1
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be at least 1")
    try:
        build(jobs=args.jobs, force=args.force)
    except PeerBuildError as exc:
        print(f"bench-peers: the llama.cpp peer was not built; the bench skips its figures.\n{exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
