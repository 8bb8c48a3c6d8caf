"""FairQueue: whose embedding work runs next, the least-served tenant's, by virtual counters.

Each tenant (the server passes a caller identity) has a FIFO of jobs and a counter of the work it
has been served, in the cost units its jobs report (one padded token through one encoder layer).
The next unit of work is the head job of the active tenant with the lowest counter, so a tenant
with one small search waiting goes ahead of one that has been indexing for a minute, and tenants
that keep the queue busy split it evenly whatever the sizes of their requests. A tenant's own
jobs run in the order it sent them.

A tenant that becomes active is lifted to the lowest counter among the active ones (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024, the virtual token counter): idle time
banks no credit, and a tenant cannot come back after a pause to starve the others. Between equal
counters the one served longest ago goes first, so a newcomer goes before the tenant just served.
Counters of inactive tenants are kept only while they are above every active one (a debt still
owed) and are all dropped when the queue empties.

Pure data, no threads: the worker holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

J = TypeVar("J")


@dataclass
class _Tenant(Generic[J]):
    jobs: deque[J] = field(default_factory=deque)
    served: int = 0  # cost units served
    last_turn: int = 0  # the turn it was last served in (0: never since it was lifted)


class FairQueue(Generic[J]):
    """Jobs by tenant; :meth:`next` names the job whose unit runs next."""

    def __init__(self) -> None:
        self._active: dict[str, _Tenant[J]] = {}
        self._idle_served: dict[str, int] = {}  # counters of inactive tenants that are still owed
        self._turn = 0

    def __len__(self) -> int:
        return sum(len(t.jobs) for t in self._active.values())

    def __bool__(self) -> bool:
        return bool(self._active)

    def push(self, tenant: str, job: J) -> None:
        """Queue ``job`` after ``tenant``'s others."""
        state = self._active.get(tenant)
        if state is None:
            floor = min((t.served for t in self._active.values()), default=0)
            state = self._active[tenant] = _Tenant(served=max(self._idle_served.pop(tenant, 0), floor))
        state.jobs.append(job)

    def next(self) -> tuple[str, J] | None:
        """(tenant, job) whose unit should run next, or None when nothing is queued; the job stays queued."""
        if not self._active:
            return None
        tenant = min(self._active, key=lambda name: (self._active[name].served, self._active[name].last_turn))
        return tenant, self._active[tenant].jobs[0]

    def charge(self, tenant: str, cost: int) -> None:
        """Count a unit of ``cost`` served to ``tenant`` (active or not)."""
        self._turn += 1
        state = self._active.get(tenant)
        if state is not None:
            state.served += cost
            state.last_turn = self._turn
        elif tenant in self._idle_served:
            self._idle_served[tenant] += cost

    def remove(self, tenant: str, job: J) -> None:
        """Take ``job`` out of ``tenant``'s queue (done, failed or cancelled); no-op if it is not there."""
        state = self._active.get(tenant)
        if state is None or job not in state.jobs:
            return
        state.jobs.remove(job)
        if state.jobs:
            return
        del self._active[tenant]
        if not self._active:
            self._idle_served.clear()  # the queue is empty: nobody is owed anything
            return
        floor = min(t.served for t in self._active.values())
        if state.served > floor:
            self._idle_served[tenant] = state.served
        for name in [name for name, served in self._idle_served.items() if served <= floor]:
            del self._idle_served[name]

    def served(self, tenant: str) -> int | None:
        """``tenant``'s counter, None when it has none (inactive and owed nothing)."""
        state = self._active.get(tenant)
        return state.served if state is not None else self._idle_served.get(tenant)
