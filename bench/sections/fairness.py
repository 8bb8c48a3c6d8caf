"""Fairness: one API key's long streams beside another's short requests, and two keys weighted 2:1 (issue 42).

One server with auth on and four keys (weights 2 and 1 for the last two, from a rate-limits file).
Each load runs for the profile's window, through gRPC with each tenant's own key:

In rounds (the loads in turn, so the machine's drift hits both sides of a ratio alike), pooled:

- tenant A alone: a closed loop of ``fairness_streams`` streams of ``fairness_long_tokens`` tokens each
  (greedy, EOS ignored), a new one as soon as one ends; its tokens/s after the ramp;
- tenant B alone: a 4-token request every second, from a client process of its own
  (bench/short_requests.py); its time to first token (TTFT) p99;
- both at once: A's tokens/s and B's TTFT p99 again, both after A's ramp (while A's 64 prompts arrive at
  once, B's request shares a step with their prefill chunks: that burst is B's ``ttft_max_in_ramp``). The
  figures are B's TTFT p99 beside A over B's alone (target <= 3) and A's tokens/s beside B over A's alone
  (target >= 0.9);
- two keys weighted 2 and 1, each a closed loop of as many streams as A (together more than the engine
  runs at once, so both stay backlogged): their tokens over the window, as a ratio (2 is fair; the error
  figure is |ratio / 2 - 1|, target <= 0.1).

First come first served kept B's requests waiting behind A's for as long as one of A's streams ran.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client_process import start_client_process
from bench.context import BenchContext
from bench.figures import Figure
from bench.load_generator import run_clients
from bench.resources import Server
from bench.runner import Step
from bench.stats import significant

SECTION = "fairness"
KEYS = {"a": "bench-tenant-a", "b": "bench-tenant-b", "w2": "bench-weight-2", "w1": "bench-weight-1"}
WEIGHTS = {"w2": 2, "w1": 1}
LONG_PROMPT_LEN = 100
RAMP = 0.2  # of the window: streams that all start at once are still in their prefill
SETTLE_S = 2.0  # between loads: cancelled streams leave the engine


@dataclass
class LoopResult:
    """What a closed loop of streams got in the window after its ramp."""

    tokens: int = 0
    seconds: float = 0.0
    errors: int = 0

    def add(self, other: LoopResult) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.errors += other.errors

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Tenant:
    """One key's stub on a shared channel."""

    def __init__(self, stub: Any, key: str) -> None:
        self.stub = stub
        self.metadata = (("authorization", f"Bearer {key}"),)

    def stream(self, prompt: Sequence[int], max_tokens: int) -> Any:
        from protoserve.v1 import inference_pb2 as pb

        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        return self.stub.GenerateStream(pb.GenerateStreamRequest(request=request), metadata=self.metadata)


async def closed_loop(tenant: Tenant, prompts: Any, streams: int, max_tokens: int, window: float) -> LoopResult:
    """``streams`` workers, each sending a new request as soon as its last one ends, for ``window`` seconds."""
    result = LoopResult()
    start = time.perf_counter()
    counted_from, end = start + RAMP * window, start + window
    calls: set[Any] = set()

    async def worker() -> None:
        while time.perf_counter() < end:
            call = tenant.stream(prompts(), max_tokens)
            calls.add(call)
            try:
                async for message in call:
                    if message.HasField("delta") and counted_from <= time.perf_counter() <= end:
                        result.tokens += len(message.delta.token_ids)
            except asyncio.CancelledError:
                if not call.cancelled():  # this task itself, not the call cancelled at the window's end
                    raise
            except Exception:  # noqa: BLE001 - a failed request is counted, not raised
                if time.perf_counter() < end:
                    result.errors += 1
            finally:
                calls.discard(call)

    workers = [asyncio.create_task(worker()) for _ in range(streams)]
    await asyncio.sleep(window)
    for call in list(calls):
        call.cancel()
    await asyncio.gather(*workers)
    result.seconds = end - counted_from
    return result


class ShortRequests:
    """Tenant B's client: ``bench.short_requests`` in a process of its own, connected before its load."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, target: str, key: str, seconds: float) -> ShortRequests:
        return cls(await start_client_process("bench.short_requests", target, key, str(seconds),
                                              what="the short-request client"))

    async def run(self) -> list[tuple[float, float]]:
        """Send now; each request's send time (seconds after the first) and TTFT, a failed one (or one with
        no token) counted as never answered."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"go\n")
        await self.process.stdin.drain()
        line = await self.process.stdout.readline()
        await self.process.wait()
        return [(sent, math.inf if ttft is None else ttft) for sent, ttft in json.loads(line)]


async def short_requests(target: str, key: str, seconds: float) -> list[float]:
    client = await ShortRequests.start(target, key, seconds)
    return [ttft for _, ttft in await client.run()]


def p99(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def fairness_figures(a_alone: LoopResult, a_beside: LoopResult, b_alone: Sequence[float],
                     b_beside: Sequence[float], b_in_ramp: Sequence[float], w2: LoopResult,
                     w1: LoopResult) -> list[Figure]:
    def fig(name: str, value: float, unit: str, better: str, **details: Any) -> Figure:
        return Figure(name=f"{SECTION}.{name}", value=value, unit=unit, section=SECTION, better=better,
                      details={k: significant(v) if isinstance(v, float) else v for k, v in details.items()})

    share = w2.tokens / w1.tokens if w1.tokens else float("inf")
    return [
        fig("a_alone", a_alone.tokens_per_s, "tok/s", "higher", errors=a_alone.errors),
        fig("a_beside_b", a_beside.tokens_per_s, "tok/s", "higher", errors=a_beside.errors),
        fig("a_throughput_ratio", a_beside.tokens_per_s / a_alone.tokens_per_s, "x", "higher"),
        fig("b_alone.ttft_p99", p99(b_alone), "s", "lower", requests=len(b_alone)),
        fig("b_beside_a.ttft_p99", p99(b_beside), "s", "lower", requests=len(b_beside),
            ttft_max=max(b_beside), ttft_max_in_ramp=max(b_in_ramp, default=0.0)),
        fig("b_ttft_p99_ratio", p99(b_beside) / p99(b_alone), "x", "lower"),
        fig("weighted_share_error", abs(share / WEIGHTS["w2"] - 1.0), "x", "lower", ratio=share,
            tokens_w2=w2.tokens, tokens_w1=w1.tokens, errors=w2.errors + w1.errors),
    ]


def write_limits_file() -> Path:
    path = Path(tempfile.mkdtemp(prefix="bench-fairness-")) / "limits.toml"
    path.write_text("".join(f'[keys."{KEYS[k]}"]\nweight = {w}\n' for k, w in WEIGHTS.items()), encoding="utf-8")
    return path


def _step(ctx: BenchContext) -> Step:
    p = ctx.profile
    window = p.fairness_window_s

    def run(server: Any) -> list[Figure]:
        long_prompts = ctx.factory(42)

        def long_prompt() -> tuple[int, ...]:
            return long_prompts.prompt(LONG_PROMPT_LEN)

        async def main():
            import grpc

            from protoserve.v1 import inference_pb2_grpc

            # A channel per tenant, as separate clients would have; B's client is a process of its own
            # (bench/short_requests.py), so this process's loop, busy with A's streams, delays nothing of B's.
            channels = {name: grpc.aio.insecure_channel(server.grpc_target) for name in KEYS if name != "b"}
            try:
                t = {name: Tenant(inference_pb2_grpc.InferenceServiceStub(channel), KEYS[name])
                     for name, channel in channels.items()}
                await short_requests(server.grpc_target, KEYS["b"], 2.0)  # warm-up
                a_alone, a_beside = LoopResult(), LoopResult()
                b_alone: list[float] = []
                b_beside: list[float] = []
                b_in_ramp: list[float] = []
                for _ in range(p.fairness_rounds):
                    alone = await closed_loop(t["a"], long_prompt, p.fairness_streams, p.fairness_long_tokens,
                                              window)
                    await asyncio.sleep(SETTLE_S)
                    b_alone += await short_requests(server.grpc_target, KEYS["b"], window / 2)
                    b_client = await ShortRequests.start(server.grpc_target, KEYS["b"], window)
                    beside, ttfts = await asyncio.gather(
                        closed_loop(t["a"], long_prompt, p.fairness_streams, p.fairness_long_tokens, window),
                        b_client.run(),
                    )
                    await asyncio.sleep(SETTLE_S)
                    a_alone.add(alone)
                    a_beside.add(beside)
                    b_beside += [ttft for sent, ttft in ttfts if sent >= RAMP * window]
                    b_in_ramp += [ttft for sent, ttft in ttfts if sent < RAMP * window]
                w2, w1 = await asyncio.gather(
                    closed_loop(t["w2"], long_prompt, p.fairness_streams, p.fairness_long_tokens, window),
                    closed_loop(t["w1"], long_prompt, p.fairness_streams, p.fairness_long_tokens, window),
                )
            finally:
                for channel in channels.values():
                    await channel.close()
            return fairness_figures(a_alone, a_beside, b_alone, b_beside, b_in_ramp, w2, w1)

        return run_clients(main())

    server = Server(
        p.serving_variant,
        label=SECTION,
        args=("--rate-limits-file", str(write_limits_file()), "--no-embedding-model"),
        env=(("PROTOSERVE_API_KEYS", ",".join(KEYS.values())),),
    )
    names = ("a_alone", "a_beside_b", "a_throughput_ratio", "b_alone.ttft_p99", "b_beside_a.ttft_p99",
             "b_ttft_p99_ratio", "weighted_share_error")
    units = ("tok/s", "tok/s", "x", "s", "s", "x", "x")
    return Step(
        SECTION,
        server,
        f"fairness: {p.fairness_streams} streams of {p.fairness_long_tokens} tokens from one key beside another's "
        f"4-token requests, and two keys weighted 2:1, {window:g} s each",
        run,
        tuple((f"{SECTION}.{n}", u) for n, u in zip(names, units, strict=True)),
    )


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
