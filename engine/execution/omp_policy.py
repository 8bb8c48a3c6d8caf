"""OpenMP wait policy for processes that run the engine beside other busy threads.

libgomp's default lets idle OpenMP workers spin for a while after every
parallel region. The engine opens ~150 regions per decode step; in a server
the asyncio loop, the gateway and the clients need the same two cores, and a
spinning worker steals their time slice, or is descheduled mid-region while
the engine thread waits for it, which on a 2-core machine with another busy
process slowed decode several times over (docs/notes/performance-log.md). Passive waiting
costs a futex wake per region instead.

Must run before torch (and so libgomp) is first imported; an explicit
``OMP_WAIT_POLICY`` in the environment wins.
"""

from __future__ import annotations

import os


def prefer_passive_omp_wait() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
