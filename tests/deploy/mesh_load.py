"""A mixed load through Envoy: gRPC Generate, native REST /v1/generate (transcoded), OpenAI /v1/completions.

Every call records when it started and ended and how it ended, so a test can tell which failures
fell on a replica's in-flight work and whether any call hung.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import httpx

from protoserve.v1 import inference_pb2, inference_pb2_grpc

KINDS = ("grpc", "rest", "openai")
# Envoy's health-check interval in the mesh (conftest.py): short, so rotation changes are quick to see.
HEALTH_CHECK_INTERVAL_S = 0.5
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    kind: str
    user: str
    started: float
    ended: float
    code: str  # "OK", a gRPC status name, or an HTTP status

    @property
    def ok(self) -> bool:
        return self.code == "OK"


class MixedClient:
    """One connection of each kind to Envoy's listener."""

    def __init__(self, envoy_url: str, model: str) -> None:
        self.model = model
        self.http = httpx.Client(base_url=envoy_url, timeout=CALL_TIMEOUT_S)
        self.channel = grpc.insecure_channel(envoy_url.removeprefix("http://"))
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    def call(self, kind: str, user: str, max_tokens: int = 4, prompt: str = "The quick brown fox") -> Outcome:
        started = time.monotonic()
        headers = {"x-user-id": user}
        try:
            if kind == "grpc":
                request = inference_pb2.GenerateRequest(
                    prompt=prompt, sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0)
                )
                self.stub.Generate(request, metadata=tuple(headers.items()), timeout=CALL_TIMEOUT_S)
                code = "OK"
            elif kind == "rest":
                body = {"prompt": prompt, "sampling": {"max_tokens": max_tokens, "temperature": 0}}
                reply = self.http.post("/v1/generate", json=body, headers=headers)
                code = "OK" if reply.status_code == 200 else str(reply.status_code)
            elif kind == "openai":
                body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                reply = self.http.post("/v1/completions", json=body, headers=headers)
                code = "OK" if reply.status_code == 200 else str(reply.status_code)
            else:
                raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        except grpc.RpcError as exc:
            code = exc.code().name
        except httpx.TimeoutException:
            code = "TIMEOUT"
        except httpx.TransportError as exc:
            code = type(exc).__name__
        return Outcome(kind, user, started, time.monotonic(), code)


def run_load(
    envoy_url: str, model: str, users: Sequence[str], *, workers: int, duration_s: float, max_tokens: int = 4
) -> list[Outcome]:
    """``workers`` threads cycling over (kind, user) pairs for ``duration_s``; every call's outcome."""
    pairs = itertools.cycle([(k, u) for u in users for k in KINDS])
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + duration_s

    def work() -> None:
        client = MixedClient(envoy_url, model)
        try:
            while time.monotonic() < deadline:
                with lock:
                    kind, user = next(pairs)
                outcome = client.call(kind, user, max_tokens=max_tokens)
                with lock:
                    outcomes.append(outcome)
        finally:
            client.close()

    threads = [threading.Thread(target=work, name=f"load-{i}") for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(duration_s + 2 * CALL_TIMEOUT_S)
    return outcomes
