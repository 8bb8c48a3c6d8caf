"""Isolation: streams decoding through gRPC while another client sends a huge prompt (issue 21, item 1).

A few streams decode concurrently, in rounds: one run on their own, then one
during which another process sends the issue's 20 MB prompt, then one with a
15 MB prompt (a quarter of the way into the run, when the streams are
decoding). At the server's default 16 MiB message limit grpc refuses the
20 MB message unread; the 15 MB one is read, parsed and refused by the
server's own size check. The figures are the streams' inter-token latency p99
in each, pooled over the rounds, and the ratio of each to the run on their own
(target <= 2: such a prompt at most doubles what the others wait). Before,
tokenizing the 20 MB prompt on the event loop stopped every stream for ~10 s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.client_process import start_client_process
from bench.context import BenchContext
from bench.figures import Figure
from bench.load_generator import run_clients
from bench.load_result import LoadResult
from bench.resources import Server
from bench.runner import Step
from bench.stats import significant
from bench.timeline import RequestTimeline
from bench.transports import GrpcTransport
from bench.workload import RequestSpec

SECTION = "isolation"
BASELINE = "isolation.itl_p99.baseline"
WORKLOAD = 5
PROMPT_LEN = 32
SEND_AT = 0.25  # of the round's baseline run: every stream is past its first token by then
# Under the default message limit: read and parsed, then refused by the server's size check.
IN_HANDLER_BYTES = 15_000_000


@dataclass(frozen=True)
class HugeLoad:
    """One huge prompt the streams run beside: its size and the names of its figures."""

    label: str
    size: int

    @property
    def itl_name(self) -> str:
        return f"isolation.itl_p99.{self.label}"

    @property
    def ratio_name(self) -> str:
        return "isolation.itl_p99_ratio" + ("" if self.label == "huge_prompt" else f".{self.label}")


def huge_loads(prompt_bytes: int) -> list[HugeLoad]:
    return [HugeLoad("huge_prompt", prompt_bytes), HugeLoad("in_handler", IN_HANDLER_BYTES)]


@dataclass(frozen=True)
class HugeOutcome:
    """How the huge prompt's call ended, and whether every stream was still running when it did."""

    code: str
    seconds: float
    overlapped: bool


class HugePromptSender:
    """``bench.huge_prompt`` in a subprocess, connected with its request built before the round starts."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, target: str, size: int) -> HugePromptSender:
        return cls(await start_client_process("bench.huge_prompt", target, str(size), what="the huge-prompt sender"))

    async def send(self) -> tuple[str, float, float]:
        """Send now; returns the status code, the call's seconds, and when (perf_counter) the answer came."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(b"go\n")
        await self.process.stdin.drain()
        line = await self.process.stdout.readline()
        answered = time.perf_counter()
        await self.process.wait()
        result = json.loads(line)
        return result["code"], result["seconds"], answered


async def _round(
    transport: GrpcTransport,
    specs: Sequence[RequestSpec],
    sender: HugePromptSender | None = None,
    send_after: float = 0.0,
) -> tuple[list[RequestTimeline], HugeOutcome | None]:
    streams = asyncio.gather(*(transport.stream(s) for s in specs))
    if sender is None:
        return list(await streams), None
    await asyncio.sleep(send_after)
    code, seconds, answered = await sender.send()
    timelines = list(await streams)
    overlapped = all(t.finished is not None and answered < t.finished for t in timelines)
    return timelines, HugeOutcome(code, seconds, overlapped)


def isolation_figures(
    baseline_rounds: Sequence[Sequence[RequestTimeline]],
    loads: Sequence[tuple[HugeLoad, Sequence[Sequence[RequestTimeline]], Sequence[HugeOutcome]]],
) -> list[Figure]:
    """The streams' ITL p99 on their own and beside each huge prompt, and the ratio of each to the first."""
    base = LoadResult.of_rounds(baseline_rounds)
    if base.itl is None:
        raise RuntimeError(f"no inter-token latencies ({base.first_error or 'no tokens'})")
    figures = [
        Figure(
            name=BASELINE,
            value=base.itl.p99,
            unit="s",
            section=SECTION,
            better="lower",
            details=base.details(),
        )
    ]
    for load, rounds, outcomes in loads:
        result = LoadResult.of_rounds(rounds)
        if result.itl is None:
            raise RuntimeError(
                f"no inter-token latencies beside {load.label} ({result.first_error or 'no tokens'})"
            )
        overlapped = sum(o.overlapped for o in outcomes)
        prompt = {
            "prompt_bytes": load.size,
            "prompt_status": "/".join(sorted({o.code for o in outcomes})),
            "prompt_s": significant(max(o.seconds for o in outcomes)),
            "overlapped_rounds": f"{overlapped}/{len(outcomes)}",
        }
        note = (
            ""
            if overlapped == len(outcomes)
            else "the prompt was answered after a stream ended in some rounds"
        )
        figures.append(
            Figure(
                name=load.itl_name, value=result.itl.p99, unit="s", section=SECTION, better="lower",
                details={**result.details(), **prompt}, note=note,
            )
        )  # fmt: skip
        figures.append(
            Figure(
                name=load.ratio_name, value=result.itl.p99 / base.itl.p99, unit="x", section=SECTION,
                better="lower", details=prompt, note=note,
            )
        )  # fmt: skip
    return figures


def _step(ctx: BenchContext) -> Step:
    p = ctx.profile
    loads = huge_loads(p.isolation_prompt_bytes)

    def run(server: Any) -> list[Figure]:
        factory = ctx.factory(WORKLOAD)

        def specs() -> list[RequestSpec]:
            return [
                RequestSpec(factory.prompt(PROMPT_LEN), p.isolation_max_tokens)
                for _ in range(p.isolation_streams)
            ]

        async def main():
            transport = GrpcTransport(server.grpc_target)
            baseline_rounds: list[list[RequestTimeline]] = []
            rounds: dict[HugeLoad, list[list[RequestTimeline]]] = {load: [] for load in loads}
            outcomes: dict[HugeLoad, list[HugeOutcome]] = {load: [] for load in loads}
            try:
                await _round(transport, specs())  # warm-up
                for _ in range(p.isolation_rounds):
                    started = time.perf_counter()
                    timelines, _ = await _round(transport, specs())
                    baseline_rounds.append(timelines)
                    send_after = SEND_AT * (time.perf_counter() - started)
                    for load in loads:
                        sender = await HugePromptSender.start(server.grpc_target, load.size)
                        timelines, outcome = await _round(transport, specs(), sender, send_after)
                        rounds[load].append(timelines)
                        outcomes[load].append(outcome)
            finally:
                await transport.close()
            return baseline_rounds, [(load, rounds[load], outcomes[load]) for load in loads]

        return isolation_figures(*run_clients(main()))

    expects = ((BASELINE, "s"),) + tuple(
        pair for load in loads for pair in ((load.itl_name, "s"), (load.ratio_name, "x"))
    )
    return Step(
        SECTION,
        Server(p.serving_variant),
        f"isolation: {p.isolation_streams} streams beside {p.isolation_prompt_bytes / 1e6:g} and "
        f"{IN_HANDLER_BYTES / 1e6:g} MB prompts",
        run,
        expects,
    )


def steps(ctx: BenchContext) -> list[Step]:
    return [_step(ctx)]
