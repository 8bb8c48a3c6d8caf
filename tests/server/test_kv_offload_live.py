"""Sessions that survive a restart (serve --kv-offload-dir): a ~3,000-token conversation's prefix
blocks, persisted at shutdown, are loaded by the next server instead of recomputed: its next turn
reports them in ``usage.prompt_tokens_details.cached_tokens`` (and the native metrics) and its tokens
are the uninterrupted server's; another identity loads none of them, nor does a server with another
quantization, and damaged files are recomputed with a warning."""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest

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


@pytest.fixture
def stopped_after():
    """Stop the servers a test starts when it ends: they share the data dir, whose RAG store one
    process at a time may open."""
    servers = []
    yield lambda server: servers.append(server) or server
    for server in servers:
        server.stop()


@dataclass
class Persisted:
    """A first server's conversation: turn 2 as it answered it, and the blocks it left on disk."""

    offload: Path
    data_dir: Path
    second: list[dict]
    uninterrupted: openai.types.chat.ChatCompletion
    first_prompt_tokens: int

    def args(self, offload: Path | None = None) -> tuple[str, ...]:
        # The same data dir: the same identity secret, so the same identities after the restart.
        return "--kv-offload-dir", str(offload or self.offload), "--data-dir", str(self.data_dir)

    def copy(self, to: Path) -> Path:
        return Path(shutil.copytree(self.offload, to))


@pytest.fixture(scope="module")
def persisted(spawn_server, tmp_path_factory) -> Persisted:
    root = tmp_path_factory.mktemp("kv-offload")
    first = [{"role": "user", "content": long_message(47, 2750) + "\nSummarize the text above in one line."}]
    done = Persisted(root / "kv", root / "data", [], None, 0)
    server = spawn_server(*done.args())
    reply = turn(client(server), first)
    done.first_prompt_tokens = reply.usage.prompt_tokens
    done.second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                   {"role": "user", "content": "Which word came first?"}]
    done.uninterrupted = turn(client(server), done.second)
    assert server.stop() == 0
    assert "blocks written" in server.log()
    return done


def test_a_conversation_resumes_after_a_restart_from_its_persisted_blocks(spawn_server, stopped_after, persisted,
                                                                           tmp_path):
    assert persisted.first_prompt_tokens > 2900
    kept = persisted.uninterrupted.usage.prompt_tokens_details.cached_tokens
    assert kept >= persisted.first_prompt_tokens - 16  # the first turn's prompt, from memory

    restarted = stopped_after(spawn_server(*persisted.args(persisted.copy(tmp_path / "kv"))))
    resumed = turn(client(restarted), persisted.second)
    assert resumed.choices[0].message.content == persisted.uninterrupted.choices[0].message.content
    cached = resumed.usage.prompt_tokens_details.cached_tokens
    assert cached >= kept  # loaded from disk: at least what the uninterrupted server held in memory
    assert prefix_cache_hits(restarted) == cached

    stranger = turn(client(restarted, user="someone-else"), persisted.second)
    assert stranger.usage.prompt_tokens_details.cached_tokens == 0
    assert "Traceback" not in restarted.log()


def test_another_quantization_loads_nothing(spawn_server, stopped_after, persisted, tmp_path):
    other = stopped_after(spawn_server("--quantization", "int8", *persisted.args(persisted.copy(tmp_path / "kv"))))
    assert "written under another model configuration" in other.log()
    assert turn(client(other), persisted.second).usage.prompt_tokens_details.cached_tokens == 0


def test_damaged_blocks_warn_and_the_answer_is_still_right(spawn_server, stopped_after, persisted, tmp_path):
    offload = persisted.copy(tmp_path / "kv")
    for path in offload.rglob("*.kv"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x55  # a flipped byte in the K/V
        path.write_bytes(bytes(data))
    server = stopped_after(spawn_server(*persisted.args(offload)))
    answer = turn(client(server), persisted.second)
    assert answer.choices[0].message.content == persisted.uninterrupted.choices[0].message.content
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    assert "checksum mismatch (damaged); recomputing its tokens" in server.log()
    assert "Traceback" not in server.log()
