"""Which waiting request to refuse when the waiting queue is full: longest queue drop, across tenants.

Refusing whoever arrives at a full queue lets one tenant that fills it shut every other one out. So a
newcomer at a full queue takes the place of the newest request of the tenant holding the most of it:
its API key first (one key's many user ids are one tenant, as in fair_share.py), then, within a key,
its identity. A newcomer is refused itself when its own tenant would then hold as much as the longest;
ties leave the queue as it is, so two equal tenants never take turns shedding each other.

Only requests that never ran are refused this way: one preempted after streaming tokens keeps its
place, as a caller cannot be asked to retry half a stream.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from protoserve.engine.request import Tenant
from protoserve.engine.scheduling.sequence import Sequence


def never_ran(seq: Sequence) -> bool:
    return seq.num_preemptions == 0 and seq.num_generated == 0


def shed_victim(waiting: Iterable[Sequence], newcomer: Tenant) -> Sequence | None:
    """The waiting request to refuse so that one of ``newcomer``'s can wait; None: refuse the newcomer."""
    fresh = [seq for seq in waiting if never_ran(seq)]
    victim = _longest_other(fresh, newcomer, lambda t: t.group)
    if victim is not None:
        return victim
    same_key = [seq for seq in fresh if seq.tenant.group == newcomer.group]
    return _longest_other(same_key, newcomer, lambda t: t.identity)


def _longest_other(fresh: list[Sequence], newcomer: Tenant, key: Callable[[Tenant], str]) -> Sequence | None:
    """The newest of the longest queue by ``key``, when that queue is not the newcomer's and is longer than
    the newcomer's would be with it."""
    counts = Counter(key(seq.tenant) for seq in fresh)
    if not counts:
        return None
    longest, held = max(counts.items(), key=lambda item: (item[1], item[0]))
    if longest == key(newcomer) or held <= counts[key(newcomer)] + 1:
        return None
    return max((seq for seq in fresh if key(seq.tenant) == longest), key=lambda seq: seq.arrival_order)
