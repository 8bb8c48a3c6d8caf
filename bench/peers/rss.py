"""Resident memory of a server process and its children, read from /proc (no psutil needed).

A server's footprint is its whole process tree: a child it spawned (a compile
worker, a tokenizer pool) holds memory on the user's machine as much as the
main process does.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
_VMRSS = re.compile(r"^VmRSS:\s+(\d+)\s+kB$", re.MULTILINE)


def vmrss_bytes(status_text: str) -> int:
    """VmRSS of one /proc/<pid>/status text, in bytes; 0 for a process with none (a zombie, a kernel thread)."""
    match = _VMRSS.search(status_text)
    return int(match.group(1)) * 1024 if match else 0


def children(pid: int, proc: Path = PROC) -> list[int]:
    """Direct children of ``pid`` (every thread's children list: a child belongs to the thread that forked it)."""
    out: list[int] = []
    for task in (proc / str(pid) / "task").glob("*"):
        try:
            out.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return out


def tree_rss_bytes(pid: int, proc: Path = PROC) -> int:
    """VmRSS of ``pid`` and all its descendants; raises ProcessLookupError when ``pid`` is gone."""
    try:
        total = vmrss_bytes((proc / str(pid) / "status").read_text())
    except OSError as exc:
        raise ProcessLookupError(f"no process {pid}") from exc
    for child in children(pid, proc):
        try:
            total += tree_rss_bytes(child, proc)
        except ProcessLookupError:
            continue  # exited between the listing and the read
    return total


class PeakRss:
    """The highest tree RSS of one process seen while the block runs, sampled every ``interval`` s."""

    def __init__(self, pid: int, interval: float = 0.2, read: Callable[[int], int] = tree_rss_bytes) -> None:
        self.pid = pid
        self.interval = interval
        self.read = read
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.read(self.pid))
            await asyncio.sleep(self.interval)

    async def __aenter__(self) -> PeakRss:
        self.peak = self.read(self.pid)
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.peak = max(self.peak, self.read(self.pid))
