"""Sessions that survive a restart (serve --kv-offload-dir): a ~3,000-token conversation's prefix
blocks, persisted at shutdown, are loaded by the next server instead of recomputed: its next turn
reports them in ``usage.prompt_tokens_details.cached_tokens`` (and the native stats) and its tokens
are the uninterrupted server's; another identity sending the same conversation loads none of them."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import openai

from protoserve.v1 import metrics_pb2, metrics_pb2_grpc

WORDS = ("river stone lantern orchard copper meadow harbor violet engine garden silver thunder paper "
         "window falcon marble candle forest bridge winter signal canyon velvet anchor").split()


def long_message(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + ("." if i % 12 == 11 else "") for i in range(words))


def client(server, user: str | None = None) -> openai.OpenAI:
    headers = {"x-user-id": user} if user else None
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
                         default_headers=headers, timeout=600)


def turn(oa: openai.OpenAI, messages: list[dict]):
    model = oa.models.list().data[0].id
    return oa.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.0)


def prefix_cache_hits(server) -> int:
    """The native metrics' count of prompt tokens served from the prefix cache."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = metrics_pb2_grpc.MetricsServiceStub(channel).GetMetrics(metrics_pb2.GetMetricsRequest(), timeout=30)
    return reply.snapshot.prefix_cache_hits


def test_a_conversation_resumes_after_a_restart_from_its_persisted_blocks(spawn_server, tmp_path: Path):
    offload = tmp_path / "kv"
    args = ("--kv-offload-dir", str(offload), "--data-dir", str(tmp_path / "data"))  # same identities after
    first = [{"role": "user", "content": long_message(47, 2750) + "\nSummarize the text above in one line."}]

    server = spawn_server(*args)
    reply = turn(client(server), first)
    assert reply.usage.prompt_tokens > 2900
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": "Which word came first?"}]
    uninterrupted = turn(client(server), second)
    kept = uninterrupted.usage.prompt_tokens_details.cached_tokens
    assert kept >= reply.usage.prompt_tokens - 16  # the first turn's prompt, from memory
    assert server.stop() == 0
    assert "blocks written" in server.log()
    assert sum(p.stat().st_size for p in offload.rglob("*.kv")) > 0

    restarted = spawn_server(*args)
    resumed = turn(client(restarted), second)
    assert resumed.choices[0].message.content == uninterrupted.choices[0].message.content
    cached = resumed.usage.prompt_tokens_details.cached_tokens
    assert cached >= kept  # loaded from disk: at least what the uninterrupted server held in memory
    assert prefix_cache_hits(restarted) == cached

    stranger = turn(client(restarted, user="someone-else"), second)
    assert stranger.usage.prompt_tokens_details.cached_tokens == 0
    assert "Traceback" not in restarted.log()
