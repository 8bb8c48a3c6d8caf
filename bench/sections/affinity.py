"""Affinity: prefix-cache hit rate behind Envoy with identity hashing against round robin.

Three ``protoserve serve`` replicas (each its own data dir, its share of the cores) sit behind
Envoy as the launcher renders it (gateway/envoy). Each of N identities (``x-user-id``) has its
own 512-token system prompt, which every one of its requests repeats, followed by a few tokens of
its own; the requests go out in rounds (every identity's first request in a shuffled order, then
every second one...), a few at a time, as gRPC Generate calls through Envoy, generating one token.

The same load runs twice on the same replicas: with Envoy's ring hash on ``authorization`` and
``x-user-id`` (the deployment's config), and with round robin. Each run uses system prompts of
its own (fresh nonces), so neither finds the other's blocks cached. The hit rate is prompt tokens
found in the prefix cache over prompt tokens looked up, summed over the replicas' /metrics
(``protoserve_prefix_cache_hits_total`` / ``protoserve_prefix_cache_queries_total``) before and
after the run. Under affinity an identity's system prompt is prefilled once, on its replica; under
round robin once on each replica its requests visit. The figure is the ratio (target > 1).
"""

from __future__ import annotations

import contextlib
import re
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.resources import EngineModel, Variant
from bench.runner import Step
from bench.server_process import REPO, ServerProcess
from bench.stats import significant

SECTION = "affinity"
WORKLOAD = 13
SYSTEM_PROMPT_TOKENS = 512
SUFFIX_TOKENS = 16
REPLICAS = 3
CALL_TIMEOUT_S = 300.0
RATIO = "affinity.prefix_hit_rate_ratio"
POLICIES = (("ring_hash", "RING_HASH"), ("round_robin", "ROUND_ROBIN"))


@dataclass(frozen=True)
class Sizes:
    identities: int
    requests_per_identity: int
    concurrency: int


SIZES = {
    "default": Sizes(identities=12, requests_per_identity=6, concurrency=3),
    "full": Sizes(identities=24, requests_per_identity=8, concurrency=4),
    "smoke": Sizes(identities=6, requests_per_identity=3, concurrency=2),
}


@dataclass(frozen=True)
class Call:
    user: str
    token_ids: tuple[int, ...]


def workload(ctx: BenchContext, sizes: Sizes, run: int) -> list[Call]:
    """Calls in rounds; each identity's prompts share its system prompt (``run`` picks fresh ones)."""
    factory = ctx.factory(WORKLOAD * 100 + run)
    systems = {f"user-{i}": factory.prompt(SYSTEM_PROMPT_TOKENS) for i in range(sizes.identities)}
    calls = []
    for _ in range(sizes.requests_per_identity):
        # Each round in its own order: a fixed order would make round robin hand identity k to
        # replica k mod 3 every time, which is affinity by accident.
        users = list(systems)
        factory.rng.shuffle(users)
        for user in users:
            suffix = tuple(factory.rng.randrange(100, 40_000) for _ in range(SUFFIX_TOKENS))
            calls.append(Call(user, systems[user] + suffix))
    return calls


_SAMPLE = re.compile(r"^(protoserve_prefix_cache_(?:hits|queries)_total)\{[^}]*\} (\S+)$", re.MULTILINE)


def cache_counters(http_base_urls: Sequence[str]) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the replicas' Prometheus /metrics."""
    totals = {"protoserve_prefix_cache_hits_total": 0.0, "protoserve_prefix_cache_queries_total": 0.0}
    for url in http_base_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
            text = reply.read().decode()
        for name, value in _SAMPLE.findall(text):
            totals[name] += float(value)
    return totals["protoserve_prefix_cache_hits_total"], totals["protoserve_prefix_cache_queries_total"]


def send_all(envoy_target: str, calls: Sequence[Call], concurrency: int) -> int:
    """Send ``calls`` in order, ``concurrency`` at a time, through Envoy; returns how many failed."""
    import grpc

    from protoserve.v1 import inference_pb2 as pb
    from protoserve.v1 import inference_pb2_grpc

    queue = list(reversed(calls))
    lock = threading.Lock()
    failed = [0]

    def work() -> None:
        with grpc.insecure_channel(envoy_target) as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            while True:
                with lock:
                    if not queue:
                        return
                    call = queue.pop()
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=call.token_ids),
                    sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                )
                try:
                    stub.Generate(request, metadata=(("x-user-id", call.user),), timeout=CALL_TIMEOUT_S)
                except grpc.RpcError:
                    with lock:
                        failed[0] += 1

    threads = [threading.Thread(target=work, name=f"affinity-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failed[0]


@contextlib.contextmanager
def replicas(variant: Variant, threads: int) -> Iterator[list[ServerProcess]]:
    """Three servers, each with a data dir of its own (a RAG store is open in one process at a time)."""
    started: list[ServerProcess] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-affinity-") as root:
            for i in range(REPLICAS):
                log_path = REPO / "bench" / "results" / f"server-affinity-{i}.log"
                started.append(ServerProcess.start(log_path, variant, threads, data_dir=Path(root) / f"replica-{i}"))
            yield started
    finally:
        for server in started:
            server.stop()


def measure(ctx: BenchContext, sizes: Sizes, variant: Variant, threads: int) -> list[Figure]:
    from protoserve.gateway.envoy.config import Balancing, Replica
    from protoserve.gateway.envoy.launcher import running_envoy

    rates: dict[str, float] = {}
    details: dict[str, dict] = {}
    with replicas(variant, threads) as servers:
        urls = [s.http_base_url for s in servers]
        if None in urls:
            raise RuntimeError("the replicas run without their REST gateway: no /metrics to read")
        topology = [Replica(s.grpc_target, s.http_base_url.removeprefix("http://")) for s in servers]
        for run, (label, policy) in enumerate(POLICIES):
            calls = workload(ctx, sizes, run)
            with running_envoy(topology, balancing=Balancing(lb_policy=policy)) as envoy:
                envoy.wait_healthy(REPLICAS)
                hits_before, queries_before = cache_counters(urls)
                started = time.perf_counter()
                failed = send_all(f"127.0.0.1:{envoy.http_port}", calls, sizes.concurrency)
                seconds = time.perf_counter() - started
                hits, queries = cache_counters(urls)
            if failed:
                raise RuntimeError(f"{failed} of {len(calls)} calls failed under {label}")
            rates[label] = (hits - hits_before) / (queries - queries_before)
            details[label] = {
                "calls": len(calls),
                "prompt_tokens": int(queries - queries_before),
                "seconds": significant(seconds),
            }
    figures = [
        Figure(f"affinity.prefix_hit_rate.{label}", significant(rates[label]), "ratio", SECTION,
               details=details[label])
        for label, _ in POLICIES
    ]  # fmt: skip
    ratio = rates["ring_hash"] / rates["round_robin"] if rates["round_robin"] else float("inf")
    figures.append(
        Figure(
            RATIO,
            significant(ratio),
            "x",
            SECTION,
            # Affinity must be clearly higher, not level: one cold prefill per identity, not one per
            # replica it visits.
            target=Target(1.1, "higher"),
            details={
                "identities": sizes.identities,
                "requests_per_identity": sizes.requests_per_identity,
                "system_prompt_tokens": SYSTEM_PROMPT_TOKENS,
                "replicas": REPLICAS,
            },
        )  # fmt: skip
    )
    return figures


def steps(ctx: BenchContext) -> list[Step]:
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])
    variant = ctx.profile.serving_variant

    def run(_model: object) -> list[Figure]:
        import torch

        # The replicas share this machine's cores: each gets its part (at least one thread).
        return measure(ctx, sizes, variant, max(1, torch.get_num_threads() // REPLICAS))

    expects = tuple((f"affinity.prefix_hit_rate.{label}", "ratio") for label, _ in POLICIES) + ((RATIO, "x"),)
    description = (
        f"affinity: prefix-cache hit rate, {sizes.identities} identities x {sizes.requests_per_identity} "
        f"calls with a {SYSTEM_PROMPT_TOKENS}-token system prompt each, ring hash vs round robin"
    )
    return [Step(SECTION, EngineModel(variant), description, run, expects)]
