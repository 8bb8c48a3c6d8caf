"""MemoryBudget: the bytes the server's generative models may hold, weights and KV pools together.

``--memory-budget`` sets it; by default it is a share of the memory available when the server starts
(MemAvailable, or the cgroup's limit less its usage when that is lower: a container's limit, not the
host's RAM), taken before any model loads, so the models given at start count against it too. Models
loaded at start are recorded whatever they take (the operator asked for them); a model loaded at run
time must fit in what is left, else the load is refused before any weight is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

# Of the memory available at start, the share models may take: the rest is the process's own (Python,
# torch, the gateway, the embedding model, request buffers) and the page cache's.
DEFAULT_BUDGET_SHARE = 0.8
MEMINFO = Path("/proc/meminfo")
CGROUP_V2 = Path("/sys/fs/cgroup")


class MemoryBudgetExceeded(Exception):
    """A model would pass the budget: ``needed`` bytes asked for, ``free`` left of ``budget``."""

    def __init__(self, needed: int, free: int, budget: int) -> None:
        self.needed, self.free, self.budget = needed, free, budget
        super().__init__(f"needs {_mib(needed)} and {_mib(free)} of the {_mib(budget)} memory budget "
                         "(--memory-budget) is left")


@dataclass
class MemoryBudget:
    """Bytes held or kept per model name, within ``total_bytes``."""

    total_bytes: int
    _held: dict[str, int] = field(default_factory=dict)

    @property
    def reserved_bytes(self) -> int:
        return sum(self._held.values())

    @property
    def free_bytes(self) -> int:
        return max(0, self.total_bytes - self.reserved_bytes)

    def reserve(self, key: str, nbytes: int) -> None:
        """Hold ``nbytes`` under ``key``; MemoryBudgetExceeded, holding nothing, when they do not fit."""
        if nbytes > self.free_bytes:
            raise MemoryBudgetExceeded(nbytes, self.free_bytes, self.total_bytes)
        self._held[key] = nbytes

    def record(self, key: str, nbytes: int) -> None:
        """Hold ``nbytes`` under ``key`` whether or not they fit (a model loaded at start, or a
        reservation replaced by what the model really took); warns when the budget is passed."""
        self._held[key] = nbytes
        if self.reserved_bytes > self.total_bytes:
            log.warning("models hold %s, over the %s memory budget (--memory-budget): loading more "
                        "at run time is refused", _mib(self.reserved_bytes), _mib(self.total_bytes))

    def rename(self, old: str, new: str) -> None:
        self._held[new] = self._held.pop(old)

    def release(self, key: str) -> int:
        """Stop holding ``key``'s bytes; returns them (0 when none were held)."""
        return self._held.pop(key, 0)


def default_budget_bytes() -> int:
    """DEFAULT_BUDGET_SHARE of the memory available to this process now."""
    return int(available_bytes() * DEFAULT_BUDGET_SHARE)


def available_bytes() -> int:
    """MemAvailable, or the cgroup (v2) limit less its usage when lower."""
    available = _meminfo_available()
    limit = _read_int(CGROUP_V2 / "memory.max")
    usage = _read_int(CGROUP_V2 / "memory.current")
    if limit is not None and usage is not None:
        available = min(available, max(0, limit - usage))
    return available


def _meminfo_available() -> int:
    for line in MEMINFO.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"{MEMINFO} has no MemAvailable")


def _read_int(path: Path) -> int | None:
    """An integer file's value; None when it is missing or says "max" (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB"
