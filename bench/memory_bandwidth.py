"""The machine's memory read bandwidth, measured in the run (``machine.memory_bandwidth``).

bench/memory_bandwidth.c streams a 1 GiB buffer, far past the last-level cache, on as many
threads as the engine computes with. Single-stream decode reads every weight once per token, so
this is its ceiling: bench/roofline.py's ``decode_roofline`` holds a decode figure to it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench.figures import Figure, skipped
from bench.machine_peak import run_probe

SOURCE = Path(__file__).resolve().parent / "memory_bandwidth.c"
FIGURE = "machine.memory_bandwidth"
SECTION = "machine"
UNIT = "GB/s"
BYTES = 1 << 30
REPEATS = 5


@dataclass(frozen=True)
class MemoryBandwidth:
    """What the probe printed: threads and bytes read per second (GB/s, 1e9)."""

    threads: int
    gbps: float


def measure(threads: int, size: int = BYTES, repeats: int = REPEATS) -> MemoryBandwidth:
    """Build and run the probe on ``threads`` threads; raises RuntimeError with the reason if it cannot."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    line = run_probe(SOURCE, [str(size), str(repeats)], threads, optimization="-O3")
    return MemoryBandwidth(threads=int(line["threads"]), gbps=float(line["gbps"]))


def bandwidth_figure(threads: int) -> Figure:
    """``machine.memory_bandwidth``, or a skipped figure saying why it could not be measured."""
    try:
        bw = measure(threads)
    except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as exc:
        return skipped(FIGURE, UNIT, SECTION, str(exc))
    return Figure(name=FIGURE, value=bw.gbps, unit=UNIT, section=SECTION, details={"threads": bw.threads})
