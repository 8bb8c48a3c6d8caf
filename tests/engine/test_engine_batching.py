"""Continuous batching on the tiny model: batched == alone, preemption, chunked prefill, prefix cache, abort."""

from __future__ import annotations

import random
import time

import pytest
import torch

from protoserve.engine.llm import LLM, Completion
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams


def fresh_rng() -> random.Random:
    """Different prompts every run; the seed is printed so a failure can be replayed."""
    seed = time.time_ns() % 2**32
    print(f"prompt rng seed: {seed}")
    return random.Random(seed)


def random_requests(rng: random.Random, count: int, max_prompt: int = 200) -> list[TokenizedRequest]:
    """Half greedy, half seeded sampling (interleaved), random prompt lengths and max_tokens."""
    reqs = []
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, max_prompt))]
        # Logprobs compared exactly catch a batch-dependent last bit even where the token does not flip.
        sp = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, logprobs=True, top_logprobs=2)
        if i % 2:
            sp.temperature, sp.top_p, sp.seed = 0.9, 0.95, rng.randrange(2**31)
        reqs.append(TokenizedRequest(f"req-{i}", prompt, sp))
    return reqs


def clone(r: TokenizedRequest, suffix: str = "") -> TokenizedRequest:
    sp = SamplingParams(**{k: (list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v)
                           for k, v in vars(r.sampling).items()})
    return TokenizedRequest(r.request_id + suffix, list(r.prompt_token_ids), sp, r.context_policy, r.priority,
                             r.cache_salt)


def tokens(c: Completion) -> list[list[int]]:
    return [ch.token_ids for ch in c.choices]


def logprobs(c: Completion) -> list:
    return [ch.logprobs for ch in c.choices]


def test_32_requests_batched_equal_alone(make_engine):
    """Greedy and seeded requests mixed in one batch, with chunked prefill beside decodes."""
    reqs = random_requests(fresh_rng(), 32)
    engine = make_engine(max_num_batched_tokens=256, max_num_seqs=32)
    start = time.perf_counter()
    batched = LLM(engine=engine).run([clone(r) for r in reqs])
    elapsed = time.perf_counter() - start
    generated = sum(len(c.choices[0].token_ids) for c in batched)
    print(f"32 requests, {generated} tokens in {elapsed:.2f}s = {generated / elapsed:.0f} tok/s, "
          f"{engine.stats().num_steps} steps")
    alone_llm = LLM(engine=make_engine(max_num_batched_tokens=256))
    for r, b in zip(reqs, batched, strict=True):
        [a] = alone_llm.run([clone(r, "-alone")])
        assert tokens(a) == tokens(b), f"{r.request_id} differs batched vs alone ({r.sampling})"
        assert a.choices[0].text == b.choices[0].text
        assert a.choices[0].logprobs == b.choices[0].logprobs, f"{r.request_id}: logprobs differ in the last bits"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_small_pool_preempts_and_matches_unconstrained(make_engine):
    rng = fresh_rng()
    reqs = [TokenizedRequest(f"p{i}", [rng.randrange(256) for _ in range(rng.randint(20, 60))],
                              SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True))
            for i in range(8)]
    big = make_engine(max_kv_blocks=256)
    expected = LLM(engine=big).run([clone(r) for r in reqs])
    assert big.stats().preemptions_total == 0
    small = make_engine(max_kv_blocks=14, max_model_len=200)  # 224 slots for 8 x up to 100 tokens
    got = LLM(engine=small).run([clone(r) for r in reqs])
    assert [tokens(c) for c in got] == [tokens(c) for c in expected]
    assert [logprobs(c) for c in got] == [logprobs(c) for c in expected]  # recompute is bit-exact
    assert small.stats().preemptions_total > 0
    assert sum(c.stats.preemptions for c in got) == small.stats().preemptions_total
    assert small.block_manager.num_free_blocks == 14


def test_chunked_prefill_gives_the_same_logits(make_engine):
    rng = fresh_rng()
    prompt = [rng.randrange(256) for _ in range(2000)]

    def first_logits(budget: int) -> tuple[torch.Tensor, int]:
        engine = make_engine(max_num_batched_tokens=budget, max_kv_blocks=160)
        captured = []
        execute = engine.runner.execute

        def capture(seqs, num_new):
            out = execute(seqs, num_new)
            captured.append(out)
            return out

        engine.runner.execute = capture
        LLM(engine=engine).run([TokenizedRequest("long", list(prompt), SamplingParams(max_tokens=1))])
        return captured[-1], len(captured)

    one_shot, steps_one = first_logits(2048)
    chunked, steps_chunked = first_logits(256)
    assert (steps_one, steps_chunked) == (1, 8)
    assert torch.equal(one_shot, chunked)


def test_shared_prefix_skips_cached_blocks_and_salt_isolates(make_engine):
    rng = fresh_rng()
    prefix = [rng.randrange(256) for _ in range(512)]
    first = TokenizedRequest("a", prefix + [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
    second = TokenizedRequest("b", prefix + [9, 8, 7, 6], SamplingParams(max_tokens=8, temperature=0.0,
                                                                          logprobs=True))
    engine = make_engine()
    llm = LLM(engine=engine)
    llm.run([first])
    hits_before = engine.stats().prefix_cache_hits
    [b] = llm.run([clone(second)])
    assert b.stats.cached_prompt_tokens == 512
    assert engine.stats().prefix_cache_hits - hits_before == 512
    [fresh] = LLM(engine=make_engine(enable_prefix_caching=False)).run([clone(second)])
    assert tokens(b) == tokens(fresh) and logprobs(b) == logprobs(fresh)
    other = clone(second, "-salted")
    other.cache_salt = b"another-tenant"
    [c] = llm.run([other])
    assert c.stats.cached_prompt_tokens == 0
    assert tokens(c) == tokens(fresh)


def test_abort_frees_blocks_at_once_and_others_are_unaffected(make_engine):
    rng = fresh_rng()
    reqs = [TokenizedRequest(f"x{i}", [rng.randrange(256) for _ in range(rng.randint(30, 90))],
                              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)) for i in range(3)]
    expected = LLM(engine=make_engine()).run([clone(reqs[0]), clone(reqs[2])])
    engine = make_engine()
    for r in reqs:
        engine.add_request(clone(r))
    collected: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    finals = {}
    for _ in range(5):
        for out in engine.step():
            for d in out.deltas:
                collected[out.request_id] += d.token_ids
    held = len(engine.requests["x1"].seqs[0].block_table)
    free_before = engine.block_manager.num_free_blocks
    assert held > 0 and engine.abort("x1")
    assert engine.block_manager.num_free_blocks == free_before + held  # freed now, not at the next step
    assert not engine.abort("x1")
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.deltas:
                collected[out.request_id] += d.token_ids
            if out.finished:
                finals[out.request_id] = out
    assert finals["x1"].deltas[0].finish_reason == FinishReason.CANCELLED
    assert collected["x0"] == expected[0].choices[0].token_ids
    assert collected["x2"] == expected[1].choices[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.stats().requests_cancelled_total == 1


def test_priority_request_runs_first(make_engine):
    engine = make_engine(max_num_seqs=1, priority_aging_steps=0)
    low = TokenizedRequest("low", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))
    high = TokenizedRequest("high", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0), priority=10)
    engine.add_request(low)
    engine.add_request(high)
    order = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
    assert order == ["high", "low"]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_low_precision_kv_cache_fits_more_tokens_and_stays_batch_invariant(make_engine, kv_dtype):
    """kv_cache_dtype="bfloat16": the same byte budget holds twice the blocks; "int8" (codes and a float32
    scale per token and KV head) holds D / (D + 4) of four times as many. A request's tokens and logprobs
    still do not depend on the batch it runs in."""
    budget = 4 * 1024 * 1024
    fp32 = make_engine(max_kv_blocks=None, kv_cache_bytes=budget)
    low = make_engine(max_kv_blocks=None, kv_cache_bytes=budget, kv_cache_dtype=kv_dtype)
    head_dim = fp32.runner.kv_cache.head_dim
    ratio = 2 if kv_dtype == "bfloat16" else 4 * head_dim / (head_dim + 4)
    assert low.runner.num_blocks == int(fp32.runner.num_blocks * ratio)
    assert low.runner.kv_cache.k[0].dtype == getattr(torch, kv_dtype)
    reqs = random_requests(fresh_rng(), 12, max_prompt=120)
    batched = LLM(engine=make_engine(kv_cache_dtype=kv_dtype, max_num_batched_tokens=128)).run(
        [clone(r) for r in reqs]
    )
    alone_llm = LLM(engine=make_engine(kv_cache_dtype=kv_dtype))
    for r, b in zip(reqs, batched, strict=True):
        [a] = alone_llm.run([clone(r, "-alone")])
        assert tokens(a) == tokens(b), f"{r.request_id} differs batched vs alone with {kv_dtype} K/V"
        assert logprobs(a) == logprobs(b)


def test_auto_kv_cache_dtype_is_bfloat16_for_quantized_weights(make_engine, tiny_loaded):
    """kv_cache_dtype="auto": the activation dtype, except bfloat16 K/V under int8/int4 weights (as
    llama.cpp keeps f16 K/V for its quantized models); an explicit setting always wins."""
    from dataclasses import replace

    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.models.kv_cache import resolve_kv_dtype

    assert resolve_kv_dtype("auto", torch.float32, "none") == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, "none") == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, "int4") == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, "int8") == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.float32, "int4") == torch.float32
    assert resolve_kv_dtype("bfloat16", torch.float32, "none") == torch.bfloat16

    plain = make_engine()
    assert plain.kv_cache_dtype == "float32" and plain.runner.kv_cache.k[0].dtype == torch.float32
    # The runner reads the loader's resolved quantization; the tiny float model stands in for a packed one.
    quantized = LLMEngine(replace(tiny_loaded, quantization="int4"), EngineConfig(max_kv_blocks=64))
    assert quantized.kv_cache_dtype == "bfloat16" and quantized.runner.kv_cache.k[0].dtype == torch.bfloat16
    pinned = LLMEngine(
        replace(tiny_loaded, quantization="int4"), EngineConfig(max_kv_blocks=64, kv_cache_dtype="float32")
    )
    assert pinned.kv_cache_dtype == "float32"
