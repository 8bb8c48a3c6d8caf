"""Build and load the C++ CPU kernels (``kernels/cpu/*.cpp``) as one PyTorch extension.

All sources build one module (``module.cpp`` holds the bindings), so the fused
decoder step calls the other kernels in C++ (``protoserve.kernels.h``). It is compiled on
first use with the machine's compiler for the machine's own CPU
(``-march=native``) and cached by PyTorch under ``$PROTOSERVE_KERNEL_CACHE``
(default ``~/.cache/protoserve/kernels``) in a folder per CPU feature set and
sources' content (a changed source builds in a new folder); a process finding a finished build there
imports it without running the build tools. ``make install`` builds them ahead of time so no request
pays the compile.

The kernels are written for AVX-512 and for AVX2 with FMA (``simd.h``); on a CPU
with neither, or where no compiler is present, ``load`` returns None and every
caller keeps its PyTorch path. The OpenMP runtime
they link is the one torch already loaded (same soname), so torch's thread count
and thread pool are theirs too.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import types
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
KERNEL_NAMES = ("linear", "norm_rope", "paged_attention", "decoder_step", "moe_experts", "argmax")
SOURCES = ("module.cpp", "linear.cpp", "int8_dot_linear.cpp", "norm_rope.cpp", "paged_attention.cpp", "decoder_step.cpp",
           "lora.cpp")
SOURCES += ("moe_experts.cpp", "argmax.cpp")
SUPPORTED_CPU_CAPABILITIES = ("AVX512", "AVX2")
MODULE_NAME = "protoserve_cpu"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "protoserve" / "kernels"
    return Path(os.environ.get("PROTOSERVE_KERNEL_CACHE", default))


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), which ``-march=native`` compiles for."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def source_files() -> list[Path]:
    """Every file the build reads: the sources and the headers they include."""
    return [SOURCE_DIR / source for source in SOURCES] + sorted(SOURCE_DIR.glob("*.h"))


def build_dir() -> Path:
    """Where this CPU's build of these sources lives.

    Keyed by the CPU's flags: a home directory shared by machines with different CPUs (an
    AVX-512 VNNI machine, then an AMX one) must not load a binary built for the other's
    instructions, which would die of SIGILL or leave AMX unused. And by the compiler flags, the
    sources' content and the torch they link (version and folder), not the sources' folder: every
    checkout using one venv's torch with the same sources (a git worktree, a copy, a wheel's venv
    that links this torch's files) loads one build instead of compiling its own, and the build
    compiles copies kept in the folder (``src/``).
    """
    # torch's folder (its real one, links resolved): the build links that torch's libraries.
    torch_dir = Path(torch.__file__).resolve().parent
    digest = hashlib.sha256(f"{cpu_flags()}\n{torch.__version__}\n{torch_dir}\n{CFLAGS}\n{LDFLAGS}\n".encode())
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return cache_dir() / "cpu" / digest.hexdigest()[:12]


def _copied_sources(directory: Path) -> list[str]:
    """The sources copied into ``directory/src`` (once: the folder is keyed by their content)."""
    src = directory / "src"
    src.mkdir(exist_ok=True)
    for path in source_files():
        target = src / path.name
        if not target.exists():
            tmp = target.with_suffix(target.suffix + ".tmp")
            tmp.write_bytes(path.read_bytes())
            tmp.replace(target)
    return [str(src / source) for source in SOURCES]


def cpu_supported() -> bool:
    """The kernels are written for AVX-512 (F, BW, VL, DQ) and for AVX2 with FMA, as ATen's own
    CPU capabilities of those names require."""
    return torch.backends.cpu.get_cpu_capability() in SUPPORTED_CPU_CAPABILITIES


def disabled() -> bool:
    """``PROTOSERVE_CPU_KERNELS=0`` forces the PyTorch paths (for comparisons)."""
    return os.environ.get("PROTOSERVE_CPU_KERNELS", "1") == "0"


def load(name: str) -> types.ModuleType | None:
    """The compiled extension holding kernel ``name``, or None when this machine cannot use it."""
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r} (known: {KERNEL_NAMES})")
    return _module()


@functools.cache
def _module() -> types.ModuleType | None:
    if disabled() or not cpu_supported():
        return None
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _exclusive(directory):
            return _built_module(directory) or cpp_extension.load(
                name=MODULE_NAME,
                sources=_copied_sources(directory),
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: fall back, loudly
        log.warning("CPU kernels not available, using the PyTorch paths: %s", exc)
        return None


def _built_module(directory: Path) -> types.ModuleType | None:
    """The module an earlier build left in ``directory``, imported without running ninja again.

    The folder's name already pins everything the build read. A process whose torch is the same files
    reached through links (a wheel's test venv) would write a build.ninja naming other include paths,
    and ninja would then rebuild everything for it, and again for the next process back.
    """
    path = directory / f"{MODULE_NAME}.so"
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path) if path.is_file() else None
    if spec is None or spec.loader is None:
        return None
    try:
        if _cut_short(path):  # dlopen maps a file cut short and dies of SIGBUS touching the rest
            raise ImportError("the file ends before its section headers")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # a link cut short: build it again
        log.warning("rebuilding the CPU kernels: the build in %s does not load: %s", directory, exc)
        path.unlink(missing_ok=True)  # or ninja, finding it newer than its objects, would keep it
        return None
    return module


def _cut_short(path: Path) -> bool:
    """Whether a 64-bit little-endian ELF file ends before its section header table, which the linker
    writes last (or before its 64-byte header). Other formats are not judged here."""
    with open(path, "rb") as file:
        header = file.read(64)
    if not header.startswith(b"\x7fELF\x02\x01"[: len(header)]):
        return False
    if len(header) < 64:
        return True
    table = int.from_bytes(header[0x28:0x30], "little")
    entry, count = int.from_bytes(header[0x3A:0x3C], "little"), int.from_bytes(header[0x3C:0x3E], "little")
    return table + entry * count > path.stat().st_size


class _exclusive:
    """Holds an flock on the build folder while PyTorch builds or loads the extension.

    PyTorch's own build lock is a plain file that a process killed mid-build (a server
    stopped while it compiled) leaves behind, and every later load then waits on it forever.
    The kernel releases an flock when its holder dies, so while we hold ours no other
    process is building here and any PyTorch lock file left in the folder is stale.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def __enter__(self) -> None:
        self._file = open(self.directory / "build.flock", "w")  # noqa: SIM115 - held until __exit__
        fcntl.flock(self._file, fcntl.LOCK_EX)
        stale = self.directory / "lock"
        if stale.exists():
            log.warning("removing a stale kernel build lock left by a process that died: %s", stale)
            stale.unlink(missing_ok=True)

    def __exit__(self, *exc_info: object) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()


def build_all() -> dict[str, bool]:
    """Compile every kernel now (``make install``); returns which ones loaded."""
    return {name: load(name) is not None for name in KERNEL_NAMES}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    for kernel, ok in build_all().items():
        print(f"{kernel}: {'built' if ok else 'not available on this machine'}")
