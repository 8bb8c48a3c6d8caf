"""Engine-direct runs: LLMEngine stepped in this process, no server, no threads between.

This is what the engine itself can do; the gRPC and gateway figures are
compared with it to see what the serving layers cost.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.timeline import RequestTimeline
from bench.workload import RequestSpec

if TYPE_CHECKING:
    from bench.resources import Variant
    from protoserve.engine.runtime import LLMEngine, LoadedModel

_ids = itertools.count()


def make_engine(loaded: LoadedModel, variant: Variant, deterministic: bool, stream_interval: int = 1) -> LLMEngine:
    """An engine with the server's default settings and the variant's K/V storage, in deterministic
    (batch-invariant) or fast mode; ``stream_interval`` as ``serve --stream-interval``."""
    from protoserve.engine.api import EngineConfig
    from protoserve.engine.runtime import LLMEngine

    return LLMEngine(loaded, EngineConfig(deterministic=deterministic, kv_cache_dtype=variant.kv_cache_dtype,
                                          stream_interval=stream_interval))


def run_requests(engine: LLMEngine, specs: Sequence[RequestSpec]) -> list[RequestTimeline]:
    """Add every spec at once, step until all finish; one timeline per spec, in spec order.

    All requests are "sent" at the same instant, so the aggregate tokens/s of
    the timelines is the offline throughput (nano-vllm's figure).
    """
    from protoserve.engine.api import SamplingParams, TokenizedRequest

    requests = [
        TokenizedRequest(
            request_id=f"bench-{next(_ids)}",
            prompt_token_ids=list(s.prompt_token_ids),
            sampling=SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True),
        )
        for s in specs
    ]
    return run_tokenized(engine, requests)


def run_tokenized(engine: Any, requests: Sequence[Any], concurrency: int | None = None) -> list[RequestTimeline]:
    """Step ``engine`` until every TokenizedRequest has finished; one timeline per request, in order.

    ``concurrency`` None: all are added at once, "sent" at one instant (the offline figure);
    otherwise at most ``concurrency`` are in the engine, the next added as one finishes.
    """
    queue = list(requests)
    limit = len(queue) if concurrency is None else concurrency
    start = time.perf_counter() if concurrency is None else None
    timelines: dict[str, RequestTimeline] = {}
    pending: set[str] = set()
    while queue or pending:
        while queue and len(pending) < limit:
            r = queue.pop(0)
            sent = start if start is not None else time.perf_counter()
            timelines[r.request_id] = RequestTimeline(sent=sent, prompt_tokens=len(r.prompt_token_ids))
            engine.add_request(r)
            pending.add(r.request_id)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timeline = timelines.get(out.request_id)
            if timeline is None:
                continue
            timeline.add_chunk(now, sum(len(d.token_ids) for d in out.deltas))
            if out.finished:
                timeline.finish(now)
                pending.discard(out.request_id)
    return [timelines[r.request_id] for r in requests]


def warm_up(engine: LLMEngine, specs: Sequence[RequestSpec]) -> None:
    """Run a few requests unmeasured: first calls of each kernel shape allocate and pick code paths."""
    run_requests(engine, specs)
