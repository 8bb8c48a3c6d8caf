"""Engine-direct and served runs taken in turn, so a ratio between them compares like with like.

Measured minutes apart (each in its own step), the engine and the gRPC server
drifted by up to 25% on this shared 2-core machine, which made their ratio (the
issue's >= 0.95 target) mostly noise. The engine here is loaded in the bench
process beside the running server; each side sleeps while the other is measured.
"""

from __future__ import annotations

from typing import Any

from bench import engine_direct
from bench.timeline import RequestTimeline
from bench.transports import Transport
from bench.workload import RequestSpec


async def alternate(
    transport: Transport,
    engine: Any,
    warm: RequestSpec,
    runs: list[RequestSpec],
    engine_runs: list[RequestSpec],
) -> tuple[list[RequestTimeline], list[RequestTimeline]]:
    """(served, direct) timelines: an engine run, then a run through ``transport``, and so on.

    ``engine_runs`` must be other prompts than ``runs`` of the same lengths, or one side could
    find the other's prompts in a prefix cache. The transport is closed at the end.
    """
    served: list[RequestTimeline] = []
    direct: list[RequestTimeline] = []
    try:
        await transport.stream(warm)
        engine_direct.warm_up(engine, [warm])
        for spec, engine_spec in zip(runs, engine_runs, strict=True):
            direct.append(engine_direct.run_requests(engine, [engine_spec])[0])
            served.append(await transport.stream(spec))
        return served, direct
    finally:
        await transport.close()
