"""CpuUsage: where the machine's CPU time went during one load run.

Why: on the 2-core machine the load generator, the server's event loop and the
engine's two-thread compute team share the cores. The gRPC and SSE figures
trail the engine-direct ones by what the loop and the client take, and by the
time a core sits idle while one team member waits for its partner, which the
loop or the client has descheduled. Printed beside every load figure, these
numbers show that split in each run instead of in a one-off profile.

Linux only (``/proc``); elsewhere every figure is left out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PROC = Path("/proc")


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU counters at one moment."""

    machine_busy: int  # jiffies over all CPUs
    machine_idle: int
    server_loop_s: float  # the server's main thread: its asyncio loop
    server_other_s: float  # its other threads: the engine's compute team, gRPC's own threads
    bench_s: float  # this process: the load generator (and the engine-direct path's engine)


def _machine_jiffies() -> tuple[int, int]:
    """(busy, idle) jiffies of all CPUs since boot."""
    fields = (_PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    # user nice system idle iowait irq softirq steal (guest time is already inside user)
    values = [int(v) for v in fields[:8]]
    idle = values[3] + values[4]
    return sum(values) - idle, idle


def _stat_seconds(path: Path) -> float:
    """utime + stime of a /proc stat file, in seconds."""
    text = path.read_text()
    # The command name may hold spaces and parentheses: the fields start after its last ')'.
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # fields 14 and 15 of stat


def _process_seconds(pid: int) -> tuple[float, float]:
    """(main thread, every other thread) CPU seconds of ``pid``.

    The process's own counters include threads that have ended; its other threads' share is
    what the main thread's counters do not hold.
    """
    total = _stat_seconds(_PROC / str(pid) / "stat")
    main = _stat_seconds(_PROC / str(pid) / "task" / str(pid) / "stat")
    return main, max(0.0, total - main)


def snapshot(server_pid: int | None) -> CpuSnapshot | None:
    """The counters now, or None where /proc cannot give them (another OS, the server gone)."""
    try:
        busy, idle = _machine_jiffies()
        loop, other = _process_seconds(server_pid) if server_pid is not None else (0.0, 0.0)
    except (OSError, ValueError, IndexError):
        return None
    times = os.times()
    return CpuSnapshot(busy, idle, loop, other, times.user + times.system)


def usage_details(start: CpuSnapshot | None, end: CpuSnapshot | None, tokens: int) -> dict[str, float]:
    """CPU milliseconds per output token by whom, and the machine's idle share, between two snapshots."""
    return usage_over([(start, end)], tokens)


def usage_over(spans: Sequence[tuple[CpuSnapshot | None, CpuSnapshot | None]], tokens: int) -> dict[str, float]:
    """The same over several (start, end) spans together: ``tokens`` are all of theirs."""
    if tokens <= 0 or not spans or any(start is None or end is None for start, end in spans):
        return {}

    def spent(field: str) -> float:
        return sum(getattr(end, field) - getattr(start, field) for start, end in spans)

    per_token = 1000.0 / tokens
    busy, idle = spent("machine_busy"), spent("machine_idle")
    return {
        "server_loop_cpu_ms_per_tok": round(spent("server_loop_s") * per_token, 3),
        "server_other_cpu_ms_per_tok": round(spent("server_other_s") * per_token, 3),
        "bench_cpu_ms_per_tok": round(spent("bench_s") * per_token, 3),
        "idle_pct": round(100.0 * idle / (busy + idle), 1) if busy + idle > 0 else 0.0,
    }
