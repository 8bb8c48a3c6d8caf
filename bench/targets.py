"""The issue's performance targets (SmolLM2-135M, 2 threads, through the gRPC server).

Keyed by figure-name patterns (fnmatch), so each comparison figure of a
family (every concurrency of "gateway SSE vs gRPC") gets the same goal.
Targets are printed next to figures (met / not met); nothing fails on them.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

from bench.figures import Target

TARGETS: dict[str, Target] = {
    "decode.grpc": Target(170.0, "higher"),  # tokens/s, one stream
    "serving.grpc.c16": Target(700.0, "higher"),  # aggregate tokens/s
    "serving.grpc.c64": Target(1500.0, "higher"),
    "prefill.grpc.512": Target(2200.0, "higher"),  # prompt tokens/s
    "serving.grpc.c16.ttft_p50": Target(0.5, "lower"),  # seconds
    "compare.grpc_vs_engine.*": Target(0.95, "higher"),  # gRPC within 5% of engine-direct
    "compare.sse_vs_engine.*": Target(0.95, "higher"),  # gateway SSE within 5% of engine-direct
    "compare.sse_vs_grpc.*": Target(0.90, "higher"),  # gateway SSE within 10% of gRPC
    "isolation.itl_p99_ratio*": Target(2.0, "lower"),  # a huge prompt at most doubles others' ITL p99
    # One key's long streams: another key's TTFT p99 within 3x of alone, the first's throughput within 10%.
    "fairness.b_ttft_p99_ratio": Target(3.0, "lower"),
    "fairness.a_throughput_ratio": Target(0.9, "higher"),
    "fairness.weighted_share_error": Target(0.1, "lower"),  # two keys weighted 2:1 served within 10% of 2:1
}


def targets_for(names: Iterable[str]) -> dict[str, Target]:
    """The target of every name that has one (an exact key wins over a pattern)."""
    out: dict[str, Target] = {}
    for name in names:
        if name in TARGETS:
            out[name] = TARGETS[name]
            continue
        for pattern, target in TARGETS.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = target
                break
    return out
