"""The machine's int8 multiply-add peak, measured in the run (``machine.int8_dot_peak``).

bench/int8_dot_peak.c issues the vector instruction of the CPU kernels' int4/int8
layers (AVX-512 VNNI ``vpdpbusd`` or AVX2 ``vpmaddubsw``) and nothing else, on as
many threads as the engine computes with. Compiled here with the machine's C
compiler for this CPU (``-march=native``), run before anything is loaded, and
reported as a figure: the ceiling that bench/roofline.py holds the throughput
figures and their targets to. A machine with no compiler, or a CPU with neither
instruction set, gets a skipped figure with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.figures import Figure, skipped

SOURCE = Path(__file__).resolve().parent / "int8_dot_peak.c"
FIGURE = "machine.int8_dot_peak"
SECTION = "machine"
UNIT = "GMAC/s"
INSTRUCTIONS_PER_THREAD = 200_000_000  # ~55 ms a repeat at one zmm vpdpbusd per cycle
REPEATS = 5


@dataclass(frozen=True)
class Int8DotPeak:
    """What the probe printed: the instruction set, threads and int8 multiply-adds per second."""

    isa: str
    threads: int
    gmacs: float


def compiler() -> str | None:
    """The C compiler to build the probe with ($CC, else cc or gcc on PATH)."""
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def run_probe(source: Path, args: list[str], threads: int, optimization: str = "-O2") -> dict:
    """Build the C probe ``source`` for this CPU, run it on ``threads`` threads with ``args`` and return
    the JSON object of its last line; RuntimeError with the reason if it cannot be built or run."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"no C compiler ($CC, cc or gcc) to build bench/{source.name}")
    with tempfile.TemporaryDirectory(prefix=f"protoserve-{source.stem}-") as tmp:
        binary = Path(tmp) / source.stem
        build = subprocess.run(
            [cc, optimization, "-march=native", "-fopenmp", str(source), "-o", str(binary)],
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            raise RuntimeError(f"{cc} could not build the probe: {_first_error(build.stderr)}")
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}
        done = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"the probe failed (exit {done.returncode}): {done.stderr.strip()[:200]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(threads: int, instructions: int = INSTRUCTIONS_PER_THREAD, repeats: int = REPEATS) -> Int8DotPeak:
    """Build and run the probe on ``threads`` threads; raises RuntimeError with the reason if it cannot."""
    line = run_probe(SOURCE, [str(instructions), str(repeats)], threads)
    return Int8DotPeak(isa=line["isa"], threads=int(line["threads"]), gmacs=float(line["gmacs"]))


def peak_figure(threads: int) -> Figure:
    """``machine.int8_dot_peak``, or a skipped figure saying why it could not be measured."""
    try:
        peak = measure(threads)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        return skipped(FIGURE, UNIT, SECTION, str(exc))
    return Figure(
        name=FIGURE,
        value=peak.gmacs,
        unit=UNIT,
        section=SECTION,
        details={"isa": peak.isa, "threads": peak.threads},
    )


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line]
    return (lines[0] if lines else stderr.strip())[:200]
