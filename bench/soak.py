"""Soak: a fresh server under mixed, hostile load for a while; fails on any lost or corrupted stream.

``make soak`` (10 minutes), or ``.venv/bin/python -m bench.soak --duration-s 60``. Not part of
``make test``. Everything runs on 127.0.0.1 against a server this script starts.

``--clients`` workers loop until ``--duration-s`` (or ``--max-requests``) is spent, each request
picking at random

* a transport and API: native streams over gRPC (GenerateStream) and over SSE
  (``/v1/generate:stream``), OpenAI completions over SSE, OpenAI chat over gRPC and over SSE;
* a prompt and sampling from a fixed set (greedy, or seeded sampling), so that every stream
  has a unary twin: the same request as one gRPC call, made once before the load;
* a behaviour: read to the end; disconnect after a few events; Cancel the request after its
  first token (native API, by request id); run under a short deadline (gRPC timeout or the
  gateway's ``x-request-timeout``); or send a bad request (wrong values, unknown model, broken
  JSON).

Each request ends in one outcome. Fine: ``completed`` (its text equals its twin's),
``disconnected``, ``cancelled``, ``deadline_exceeded``, ``rejected`` (a bad request refused as
the client's mistake), ``shed`` (RESOURCE_EXHAUSTED / 429). Failures: ``corrupted`` (a completed
stream that differs from its twin), ``lost`` (no terminal answer: the stream ended without
its final event, or nothing came within LOST_AFTER_S), ``server_error`` (5xx, UNKNOWN, INTERNAL,
UNAVAILABLE, DATA_LOSS), ``unexpected`` (any other answer, e.g. a valid request refused).

The server runs with auth on and two API keys, one per tenant (each also its own x-user-id, so
the tenants stay apart on a server with auth off); client i is tenant i mod 2, so the fair
scheduler shares the engine between two callers.

It prints the requests by outcome, each tenant's served tokens and time to first token (from the
server's request log, whose identities the soak can name: it gives the server its identity
secret), the KV pool once the load has drained (it must be 100% free, with nothing running or
waiting), the server's RSS after the warm-up and after the run (growth over 5% fails), and exits
1 on any failure, or when the server logged a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench.server_process import REPO, ServerProcess
from protoserve.openai.v1 import openai_pb2, openai_pb2_grpc
from protoserve.server.security.auth import identity_hash
from protoserve.v1 import inference_pb2, inference_pb2_grpc, metrics_pb2, metrics_pb2_grpc

LOST_AFTER_S = 120.0  # a request with no terminal answer by then is lost
DRAIN_TIMEOUT_S = 60.0  # after the load, the KV pool must be free within this
MAX_RSS_GROWTH = 0.05
SHOWN_FAILURES = 10  # failures printed in full
TENANTS = ("soak-tenant-a", "soak-tenant-b")  # API keys; client i sends as tenant i mod 2

FINE = ("completed", "disconnected", "cancelled", "deadline_exceeded", "rejected", "shed")
FAILED = ("corrupted", "lost", "server_error", "unexpected")
BEHAVIOURS = {"complete": 40, "disconnect": 20, "cancel": 15, "deadline": 15, "bad": 10}
# (transport, API family): streams over gRPC and SSE, for the native and OpenAI APIs.
ROUTES = (("grpc", "native"), ("sse", "native"), ("sse", "completions"), ("grpc", "chat"), ("sse", "chat"))
SSE_PATHS = {"native": "/v1/generate:stream", "completions": "/v1/completions:stream", "chat": "/v1/chat/completions:stream"}
CLIENT_FAULTS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}
SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS}

PROMPTS = (
    "The three primary colours are",
    "Write a haiku about the sea.",
    "List four prime numbers and explain why each is prime.",
    "def fibonacci(n):",
    "Translate to French: the cat sleeps on the warm windowsill.",
    "Once upon a time, in a village at the edge of a great forest, " * 12,  # a longer prefill
)


@dataclass(frozen=True)
class Spec:
    """One request every transport of a family can send, with the same answer each time."""

    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None

    def sampling(self) -> inference_pb2.SamplingParams:
        return inference_pb2.SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed)

    def native(self, request_id: str = "") -> inference_pb2.GenerateRequest:
        return inference_pb2.GenerateRequest(request_id=request_id, prompt=self.prompt, sampling=self.sampling())

    def completion(self) -> openai_pb2.CreateCompletionRequest:
        request = openai_pb2.CreateCompletionRequest(
            max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed
        )
        request.prompt.string_value = self.prompt
        return request

    def chat(self) -> openai_pb2.CreateChatCompletionRequest:
        request = openai_pb2.CreateChatCompletionRequest(
            max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed
        )
        message = request.messages.add(role="user")
        message.content.string_value = self.prompt
        return request

    def json_body(self, family: str, request_id: str) -> dict[str, Any]:
        """The SSE request body of a family (the HTTP rules take the inner request as the body)."""
        common: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.seed is not None:
            common["seed"] = self.seed
        if family == "native":
            return {"request_id": request_id, "prompt": self.prompt, "sampling": common}
        if family == "completions":
            return {"prompt": self.prompt, **common}
        return {"messages": [{"role": "user", "content": self.prompt}], **common}


def make_specs(prompts: int) -> list[Spec]:
    """Each of the first ``prompts`` prompts greedy and with seeded sampling, of different lengths."""
    specs = []
    for i, prompt in enumerate(PROMPTS[:prompts]):
        specs.append(Spec(prompt, max_tokens=16 + 8 * i, temperature=0.0, seed=None))
        specs.append(Spec(prompt, max_tokens=24 + 4 * i, temperature=0.8, seed=1000 + i))
    return specs


def bad_grpc_request(rng: random.Random, spec: Spec) -> inference_pb2.GenerateRequest:
    """A native request the server must refuse as the client's mistake."""
    request = spec.native()
    mistake = rng.choice(["temperature", "model", "top_p", "n", "empty", "max_tokens", "stop"])
    if mistake == "temperature":
        request.sampling.temperature = -1.0
    elif mistake == "model":
        request.model = "no-such-model-" + "x" * rng.randint(1, 4000)
    elif mistake == "top_p":
        request.sampling.top_p = 7.0
    elif mistake == "n":
        request.sampling.n = 1000
    elif mistake == "empty":
        request.prompt = ""
    elif mistake == "max_tokens":
        request.sampling.max_tokens = -5
    else:
        request.sampling.stop.extend(["s"] * 100)
    return request


def bad_http_body(rng: random.Random, family: str, spec: Spec) -> bytes:
    """An SSE request body the gateway must refuse with a 4xx."""
    body = spec.json_body(family, "")
    mistake = rng.choice(["json", "type", "field", "model", "nesting", "temperature"])
    if mistake == "json":
        return json.dumps(body).encode()[: rng.randint(1, 20)]
    if mistake == "type":
        body["max_tokens"] = "many"
    elif mistake == "field":
        body["no_such_field"] = True
    elif mistake == "model":
        body["model"] = "no-such-model"
    elif mistake == "nesting":  # deeper than any JSON parser's recursion
        return json.dumps({**body, "max_tokens": 0}).replace('"max_tokens": 0', '"max_tokens": ' + "[" * 2000 + "]" * 2000).encode()
    else:
        body["temperature"] = -1
    return json.dumps(body).encode()


@dataclass
class Tally:
    """Requests by (route, behaviour) and outcome, and the failures' details."""

    counts: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    by_route: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, route: str, behaviour: str, outcome: str, detail: str = "") -> None:
        self.counts[(outcome, behaviour)] += 1
        self.by_route[(route, behaviour, outcome)] += 1
        if outcome in FAILED:
            self.failures.append(f"{outcome} [{route} {behaviour}] {detail}"[:2000])

    def total(self, outcomes: tuple[str, ...]) -> int:
        return sum(n for (outcome, _), n in self.counts.items() if outcome in outcomes)


@dataclass(frozen=True)
class Target:
    """The server under load: where it listens, its process and its log."""

    grpc_target: str
    http_base_url: str
    pid: int
    log_path: Path
    identity_secret: bytes  # names each tenant's identity in the server's request log

    @classmethod
    def of(cls, server: ServerProcess, identity_secret: bytes) -> Target:
        assert server.http_base_url is not None, "the soak needs the REST gateway"
        return cls(server.grpc_target, server.http_base_url, server.process.pid, server.log_path, identity_secret)


def tenant_headers(tenant: str) -> dict[str, str]:
    """A tenant's key (read with auth on) and user id (the identity with auth off)."""
    return {"authorization": f"Bearer {tenant}", "x-user-id": tenant}


def grpc_auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return tuple(tenant_headers(tenant).items())


class Soak:
    """The load: workers, twins, and how each request ended."""

    def __init__(self, server: Target, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        self.specs = make_specs(args.prompts)
        self.twins: dict[tuple[str, int], str] = {}
        self.tally = Tally()
        self.ids = itertools.count()
        self.channel = grpc.aio.insecure_channel(server.grpc_target)
        self.native = inference_pb2_grpc.InferenceServiceStub(self.channel)
        self.openai = openai_pb2_grpc.OpenAIServiceStub(self.channel)
        self.metrics = metrics_pb2_grpc.MetricsServiceStub(self.channel)
        self.http = httpx.AsyncClient(
            base_url=server.http_base_url, timeout=LOST_AFTER_S, limits=httpx.Limits(max_connections=64)
        )

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()

    # -- twins --------------------------------------------------------------------------------

    async def make_twins(self) -> None:
        """Every spec's answer as one unary gRPC call, per API family."""
        for i, spec in enumerate(self.specs):
            auth = grpc_auth(TENANTS[0])
            native = await self.native.Generate(spec.native(), timeout=LOST_AFTER_S, metadata=auth)
            self.twins[("native", i)] = native.choices[0].text
            completion = await self.openai.CreateCompletion(spec.completion(), timeout=LOST_AFTER_S, metadata=auth)
            self.twins[("completions", i)] = completion.choices[0].text
            chat = await self.openai.CreateChatCompletion(spec.chat(), timeout=LOST_AFTER_S, metadata=auth)
            self.twins[("chat", i)] = chat.choices[0].message.content

    # -- outcomes -----------------------------------------------------------------------------

    def completed(self, family: str, spec: int, text: str, finish: str | None, behaviour: str) -> tuple[str, str]:
        """The outcome of a stream that ended by itself with ``finish`` (None: no final event)."""
        if finish is None:
            return "lost", "the stream ended without its final event"
        if finish in ("cancelled", "FINISH_REASON_CANCELLED"):
            if behaviour in ("cancel", "deadline"):
                return "cancelled", ""
            return "unexpected", "a stream nobody cancelled ended cancelled"
        twin = self.twins[(family, spec)]
        if text != twin:
            return "corrupted", f"spec {spec}: stream {text!r} != unary {twin!r}"
        return "completed", ""

    @staticmethod
    def grpc_outcome(code: grpc.StatusCode, details: str, behaviour: str) -> tuple[str, str]:
        detail = f"{code.name}: {details[:300]}"
        if code in SERVER_FAULTS:
            return "server_error", detail
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "shed", ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and behaviour == "deadline":
            return "deadline_exceeded", ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "lost", f"no answer within {LOST_AFTER_S:.0f} s"
        if code == grpc.StatusCode.CANCELLED and behaviour in ("cancel", "disconnect"):
            return "cancelled", ""
        if code in CLIENT_FAULTS and behaviour == "bad":
            return "rejected", ""
        return "unexpected", detail

    @staticmethod
    def http_outcome(status: int, body: str, behaviour: str) -> tuple[str, str]:
        detail = f"HTTP {status}: {body[:300]}"
        if status == 504 and behaviour == "deadline":
            return "deadline_exceeded", ""
        if status >= 500:
            return "server_error", detail
        if status == 429:
            return "shed", ""
        if 400 <= status < 500 and behaviour == "bad":
            return "rejected", ""
        return "unexpected", detail

    @staticmethod
    def sse_error_outcome(error: dict[str, Any], behaviour: str) -> tuple[str, str]:
        """A ``data: {"error": ...}`` event: the stream failed after it started."""
        text = json.dumps(error)
        if behaviour == "deadline" and ("DEADLINE" in text.upper() or "timeout" in text.lower()):
            return "deadline_exceeded", ""
        if behaviour == "cancel" and "CANCEL" in text.upper():
            return "cancelled", ""
        if any(word in text for word in ("INTERNAL", "UNKNOWN", "UNAVAILABLE", "internal", "server_error")):
            return "server_error", text[:300]
        return "unexpected", text[:300]

    # -- requests -----------------------------------------------------------------------------

    async def grpc_stream(
        self, family: str, spec_i: int, behaviour: str, rng: random.Random, tenant: str
    ) -> tuple[str, str]:
        spec = self.specs[spec_i]
        request_id = f"soak-{next(self.ids)}"
        timeout = rng.uniform(0.05, 1.5) if behaviour == "deadline" else LOST_AFTER_S
        auth = grpc_auth(tenant)
        if family == "native":
            call = self.native.GenerateStream(
                inference_pb2.GenerateStreamRequest(request=spec.native(request_id)), timeout=timeout, metadata=auth
            )
        else:
            call = self.openai.CreateChatCompletionStream(
                openai_pb2.CreateChatCompletionStreamRequest(request=spec.chat()), timeout=timeout, metadata=auth
            )
        text: list[str] = []
        finish: str | None = None
        events, stop_after, cancel_sent = 0, rng.randint(1, 6), False
        try:
            async for reply in call:
                if family == "native":
                    if reply.WhichOneof("event") == "final":
                        finish = inference_pb2.FinishReason.Name(reply.final.choices[0].finish_reason)
                        continue
                    text.append(reply.delta.text)
                else:
                    choice = reply.choices[0] if reply.choices else None
                    if choice is None:
                        continue  # a usage-only chunk
                    text.append(choice.delta.content)
                    if choice.HasField("finish_reason"):
                        finish = choice.finish_reason
                events += 1
                if behaviour == "disconnect" and events >= stop_after:
                    call.cancel()
                    return "disconnected", ""
                if behaviour == "cancel" and family == "native" and not cancel_sent:
                    cancel_sent = True
                    await self.native.Cancel(
                        inference_pb2.CancelRequest(request_id=request_id), timeout=30, metadata=auth
                    )
        except grpc.aio.AioRpcError as exc:
            return self.grpc_outcome(exc.code(), exc.details() or "", behaviour)
        return self.completed(family, spec_i, "".join(text), finish, behaviour)

    async def sse_stream(
        self, family: str, spec_i: int, behaviour: str, rng: random.Random, tenant: str
    ) -> tuple[str, str]:
        spec = self.specs[spec_i]
        request_id = f"soak-{next(self.ids)}"
        auth = tenant_headers(tenant)
        headers = {"content-type": "application/json", **auth}
        if behaviour == "deadline":
            headers["x-request-timeout"] = f"{rng.uniform(0.05, 1.5):.3f}"
        if behaviour == "bad":
            body = bad_http_body(rng, family, spec)
        else:
            body = json.dumps(spec.json_body(family, request_id)).encode()
        text: list[str] = []
        finish: str | None = None
        events, stop_after, cancel_sent = 0, rng.randint(1, 6), False
        async with self.http.stream("POST", SSE_PATHS[family], content=body, headers=headers) as response:
            if response.status_code != 200:
                return self.http_outcome(response.status_code, (await response.aread()).decode(errors="replace"), behaviour)
            if behaviour == "bad":
                return "unexpected", f"a bad request was served: {body[:300]!r}"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    return self.sse_error_outcome(event["error"], behaviour)
                if family == "native":
                    if "final" in event:
                        finish = event["final"]["choices"][0].get("finish_reason", "FINISH_REASON_UNSPECIFIED")
                        continue
                    text.append(event.get("delta", {}).get("text", ""))
                else:
                    choices = event.get("choices") or [{}]
                    piece = choices[0].get("text") if family == "completions" else choices[0].get("delta", {}).get("content")
                    text.append(piece or "")
                    if choices[0].get("finish_reason"):
                        finish = choices[0]["finish_reason"]
                events += 1
                if behaviour == "disconnect" and events >= stop_after:
                    return "disconnected", ""  # leaving the block closes the connection mid-stream
                if behaviour == "cancel" and family == "native" and not cancel_sent:
                    cancel_sent = True
                    cancelled = await self.http.post(f"/v1/cancel/{request_id}", json={}, headers=auth)
                    if cancelled.status_code not in (200, 404):  # 404: it finished meanwhile
                        return "unexpected", f"cancel answered HTTP {cancelled.status_code}: {cancelled.text[:300]}"
        return self.completed(family, spec_i, "".join(text), finish, behaviour)

    async def bad_grpc(self, rng: random.Random, tenant: str) -> tuple[str, str]:
        request = bad_grpc_request(rng, self.specs[rng.randrange(len(self.specs))])
        try:
            await self.native.Generate(request, timeout=LOST_AFTER_S, metadata=grpc_auth(tenant))
        except grpc.aio.AioRpcError as exc:
            return self.grpc_outcome(exc.code(), exc.details() or "", "bad")
        return "unexpected", f"a bad request was served: {request}"

    async def one_request(self, rng: random.Random, tenant: str) -> None:
        transport, family = rng.choice(ROUTES)
        # Cancel names a request by its id, which only the native API lets a client choose.
        behaviours = {b: w for b, w in BEHAVIOURS.items() if family == "native" or b != "cancel"}
        behaviour = rng.choices(list(behaviours), weights=list(behaviours.values()))[0]
        spec = rng.randrange(len(self.specs))
        run: Callable[[], Awaitable[tuple[str, str]]]
        if transport == "grpc" and behaviour == "bad":
            run = lambda: self.bad_grpc(rng, tenant)  # noqa: E731
        elif transport == "grpc":
            run = lambda: self.grpc_stream(family, spec, behaviour, rng, tenant)  # noqa: E731
        else:
            run = lambda: self.sse_stream(family, spec, behaviour, rng, tenant)  # noqa: E731
        try:
            outcome, detail = await asyncio.wait_for(run(), LOST_AFTER_S + 10)
        except TimeoutError:
            outcome, detail = "lost", f"no terminal answer within {LOST_AFTER_S + 10:.0f} s"
        except (httpx.HTTPError, OSError) as exc:
            outcome, detail = "server_error", f"{type(exc).__name__}: {exc}"
        self.tally.add(f"{transport}-{family}", behaviour, outcome, detail)

    async def worker(self, index: int, until: float, budget: list[int]) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        tenant = TENANTS[index % len(TENANTS)]
        while time.monotonic() < until and budget[0] > 0:
            budget[0] -= 1
            await self.one_request(rng, tenant)

    async def load(self, seconds: float, max_requests: int) -> None:
        until = time.monotonic() + seconds
        budget = [max_requests]
        await asyncio.gather(*(self.worker(i, until, budget) for i in range(self.args.clients)))

    # -- the server's state ---------------------------------------------------------------------

    async def drained_snapshot(self) -> metrics_pb2.MetricsSnapshot:
        """The snapshot once nothing runs, waits or holds KV blocks (or the last one at the timeout)."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            snap = (
                await self.metrics.GetMetrics(
                    metrics_pb2.GetMetricsRequest(), timeout=30, metadata=grpc_auth(TENANTS[0])
                )
            ).snapshot
            idle = snap.num_requests_running == 0 and snap.num_requests_waiting == 0 and snap.kv_cache_usage == 0
            if idle or time.monotonic() > deadline:
                return snap
            await asyncio.sleep(0.5)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def report(tally: Tally, duration: float) -> None:
    total = sum(tally.counts.values())
    print(f"\nrequests: {total} in {duration:.0f} s ({total / max(duration, 1e-9):.1f}/s)")
    behaviours = list(BEHAVIOURS)
    print(f"{'outcome':<18}" + "".join(f"{b:>12}" for b in behaviours) + f"{'total':>10}")
    for outcome in FINE + FAILED:
        row = [tally.counts[(outcome, b)] for b in behaviours]
        if sum(row) or outcome in FAILED:
            print(f"{outcome:<18}" + "".join(f"{n:>12}" for n in row) + f"{sum(row):>10}")
    print("\nby route:")
    routes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for (route, _, outcome), n in tally.by_route.items():
        routes[route][outcome] += n
    for route in sorted(routes):
        print(f"  {route:<18}" + ", ".join(f"{o} {n}" for o, n in sorted(routes[route].items())))


def tenant_report(server: Target, since: float) -> None:
    """Each tenant's requests, served tokens and TTFT, from the server's request log (requests started
    after ``since``, Unix seconds: the load, not the twins or the warm-up)."""
    names = {
        identity_hash(server.identity_secret, key, user): user
        for user in TENANTS
        for key in (user, "")  # the identity with auth on, and with it off
    }
    served: dict[str, list[dict[str, Any]]] = {key: [] for key in TENANTS}
    for line in server.log_path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        key = names.get(row.get("identity", ""))
        if row.get("event") == "request_finished" and key is not None and row.get("started_at", 0) >= since:
            served[key].append(row)
    print("\nby tenant (server request log):")
    for key, rows in served.items():
        ttfts = sorted(r["time_to_first_token_s"] for r in rows if r.get("time_to_first_token_s"))
        tokens = sum(r.get("output_tokens", 0) for r in rows)
        shown = (f"TTFT p50 {statistics.median(ttfts):.3f} s, p99 {ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]:.3f} s"
                 if ttfts else "no first tokens")
        print(f"  {key:<16} {len(rows):>6} requests, {tokens:>8} tokens served, {shown}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0, help="seconds of load after the warm-up [600]")
    parser.add_argument("--warmup-s", type=float, help="seconds of load before RSS is first read [10%% of the duration, 5-60]")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients [8]")
    parser.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many requests [no bound]")
    parser.add_argument("--seed", type=int, default=0, help="what each client does, request by request [0]")
    parser.add_argument(
        "--prompts", type=int, choices=range(1, len(PROMPTS) + 1), default=len(PROMPTS), metavar="N",
        help=f"use the first N of the {len(PROMPTS)} prompts (fewer twins to make first) [{len(PROMPTS)}]",
    )
    parser.add_argument(
        "--results-dir", type=Path, default=REPO / "bench" / "results", help="where the server's log goes [bench/results]"
    )
    return parser


async def soak(server: Target, args: argparse.Namespace) -> int:
    """Twins, warm-up, load, drain, then the report; returns the exit code."""
    run = Soak(server, args)
    try:
        started = time.monotonic()
        await run.make_twins()
        warmup = args.warmup_s if args.warmup_s is not None else min(60.0, max(5.0, args.duration_s / 10))
        print(f"twins: {len(run.twins)} unary answers in {time.monotonic() - started:.0f} s; warm-up {warmup:.0f} s")
        await run.load(warmup, args.max_requests)
        await run.drained_snapshot()
        rss_before = rss_bytes(server.pid)
        print(f"load: {args.clients} clients ({len(TENANTS)} tenants) for {args.duration_s:.0f} s", flush=True)
        load_started = time.monotonic()
        load_started_unix = time.time()
        await run.load(args.duration_s, args.max_requests - sum(run.tally.counts.values()))
        load_s = time.monotonic() - load_started
        snap = await run.drained_snapshot()
        rss_after = rss_bytes(server.pid)
    finally:
        await run.close()

    report(run.tally, load_s)
    tenant_report(server, load_started_unix)
    failures = list(run.tally.failures)
    kv_free = 100.0 * (1.0 - snap.kv_cache_usage)
    print(
        f"\nKV pool after drain: {kv_free:.1f}% free "
        f"({snap.num_requests_running} running, {snap.num_requests_waiting} waiting)"
    )
    if kv_free < 100.0 or snap.num_requests_running or snap.num_requests_waiting:
        failures.append(f"not drained within {DRAIN_TIMEOUT_S:.0f} s: {kv_free:.1f}% of the KV pool free")
    growth = rss_after / rss_before - 1.0
    print(f"server RSS: {rss_before / 2**20:.0f} MiB after warm-up, {rss_after / 2**20:.0f} MiB after the run ({growth:+.1%})")
    if growth > MAX_RSS_GROWTH:
        failures.append(f"RSS grew {growth:.1%} (limit {MAX_RSS_GROWTH:.0%})")
    tracebacks = server.log_path.read_text(errors="replace").count("Traceback")
    print(f"server log: {server.log_path} ({tracebacks} tracebacks)")
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server log {server.log_path}")
    if failures:
        print(f"\nFAIL: {len(failures)} failures", file=sys.stderr)
        for failure in failures[:SHOWN_FAILURES]:
            print(f"  {failure}", file=sys.stderr)
        return 1
    print("\nPASS: no lost or corrupted stream, KV pool free, RSS within 5%")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_path = args.results_dir / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.log"
    print(f"starting a server (log: {log_path})", flush=True)
    with tempfile.TemporaryDirectory(prefix="protoserve-soak-") as scratch:
        secret_file = Path(scratch) / "identity_secret"
        secret_file.write_text(secrets.token_hex(32))
        server = ServerProcess.start(
            log_path, extra_args=("--identity-secret-file", str(secret_file)),
            env={"PROTOSERVE_API_KEYS": ",".join(TENANTS)},
        )
        try:
            return asyncio.run(soak(Target.of(server, secret_file.read_bytes().strip()), args))
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
