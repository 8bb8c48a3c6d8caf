"""The memory budget LoadModel checks against (server/runtime/memory_budget.py): its default from the
machine (MemAvailable, or a container's cgroup limit less its usage when lower) and its bookkeeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from protoserve.server.runtime import memory_budget as mb

GIB = 2**30


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake /proc/meminfo and cgroup v2 directory; returns a setter for their values."""
    meminfo, cgroup = tmp_path / "meminfo", tmp_path / "cgroup"
    cgroup.mkdir()
    monkeypatch.setattr(mb, "MEMINFO", meminfo)
    monkeypatch.setattr(mb, "CGROUP_V2", cgroup)

    def set_machine(available_kib: int, limit: str | None = None, usage: int | None = None) -> None:
        meminfo.write_text(f"MemTotal: {4 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
        for name, value in (("memory.max", limit), ("memory.current", usage)):
            if value is not None:
                (cgroup / name).write_text(f"{value}\n")

    return set_machine


def test_the_default_is_a_share_of_memavailable_without_a_cgroup_limit(machine):
    machine(available_kib=8 * 2**20)
    assert mb.available_bytes() == 8 * GIB
    assert mb.default_budget_bytes() == int(8 * GIB * mb.DEFAULT_BUDGET_SHARE)


def test_an_unlimited_cgroup_leaves_memavailable(machine):
    machine(available_kib=8 * 2**20, limit="max", usage=GIB)
    assert mb.available_bytes() == 8 * GIB


def test_a_container_limit_below_the_hosts_memory_sets_the_default(machine):
    machine(available_kib=64 * 2**20, limit=str(4 * GIB), usage=GIB)
    assert mb.available_bytes() == 3 * GIB
    assert mb.default_budget_bytes() == int(3 * GIB * mb.DEFAULT_BUDGET_SHARE)


def test_a_reservation_that_does_not_fit_is_refused_and_holds_nothing():
    budget = mb.MemoryBudget(total_bytes=2 * GIB)
    budget.record("smol", GIB)
    with pytest.raises(mb.MemoryBudgetExceeded) as refused:
        budget.reserve("gemma", GIB + 1)
    assert (refused.value.needed, refused.value.free, refused.value.budget) == (GIB + 1, GIB, 2 * GIB)
    assert budget.reserved_bytes == GIB
    budget.reserve("gemma", GIB)
    assert budget.free_bytes == 0
    assert budget.release("gemma") == GIB and budget.release("gemma") == 0
    assert budget.reserved_bytes == GIB


def test_a_model_given_at_start_is_recorded_past_the_budget(caplog):
    budget = mb.MemoryBudget(total_bytes=GIB)
    budget.record("big", 2 * GIB)
    assert budget.reserved_bytes == 2 * GIB and budget.free_bytes == 0
    assert "over the 1024 MiB memory budget" in caplog.text
