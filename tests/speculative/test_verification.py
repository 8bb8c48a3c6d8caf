"""Speculative verification on the tiny model: output never changes, K/V and the prefix cache stay right.

An oracle proposer drafts from a reference run without speculation (optionally with
wrong tokens mixed in), so every path is exercised on purpose: all drafts accepted
(bonus token), a rejection at each position, drafts cut by the budget or the pool.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from protoserve.engine.config import EngineConfig
from protoserve.engine.errors import InvalidRequestError
from protoserve.engine.llm import LLM, Completion
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.block_manager import chain_hashes
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.speculative.params import SpeculativeParams

SPEC = SpeculativeParams(num_speculative_tokens=5)
WRONG = 3  # a token id the corrupted drafts use (swapped for another when it happens to be right)


class OracleProposer:
    """Drafts each choice's reference continuation; every ``corrupt``-th draft (counting over the run) is wrong."""

    def __init__(self, reference: dict[tuple[str, int], list[int]], corrupt: int = 0) -> None:
        self.reference = reference
        self.corrupt = corrupt
        self.count = 0

    def propose(self, seq: Sequence, params: SpeculativeParams, max_drafts: int) -> list[int]:
        ref = self.reference[(seq.request_id.removesuffix("-spec"), seq.index)]
        drafts = ref[seq.num_generated : seq.num_generated + min(params.num_speculative_tokens, max_drafts)]
        out = []
        for t in drafts:
            self.count += 1
            if self.corrupt and self.count % self.corrupt == 0:
                t = WRONG if t != WRONG else WRONG + 1
            out.append(t)
        return out


def engine(loaded, **config) -> LLMEngine:
    config.setdefault("max_kv_blocks", 256)
    config.setdefault("block_size", 4)
    return LLMEngine(loaded, EngineConfig(**config))


def tokens(c: Completion) -> list[list[int]]:
    return [ch.token_ids for ch in c.choices]


def reference(loaded, requests: list[TokenizedRequest], **config) -> tuple[list[Completion], dict]:
    done = LLM(engine=engine(loaded, **config)).run([replace(r, sampling=replace(r.sampling)) for r in requests])
    ref = {(c.request_id, ch.index): ch.token_ids for c in done for ch in c.choices}
    return done, ref


def speculative(requests: list[TokenizedRequest]) -> list[TokenizedRequest]:
    return [replace(r, request_id=r.request_id + "-spec", sampling=replace(r.sampling, speculative=SPEC))
            for r in requests]


def varied_requests(count: int, seed: int = 0) -> list[TokenizedRequest]:
    """Greedy and seeded rows with penalties, bias, min_tokens, logprobs and n > 1 mixed in."""
    rng = random.Random(seed)
    reqs = []
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        sp = SamplingParams(max_tokens=rng.randint(8, 30), temperature=0.0, logprobs=True, top_logprobs=2)
        if i % 2:
            sp = replace(sp, temperature=0.9, top_k=40, top_p=0.95, seed=rng.randrange(2**31))
        if i % 3 == 0:
            sp = replace(sp, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
        if i % 4 == 1:
            sp = replace(sp, min_tokens=5, logit_bias={65: 3.0})
        if i % 5 == 2:
            sp = replace(sp, n=3)
        reqs.append(TokenizedRequest(f"r{i}", prompt, sp))
    return reqs


@pytest.mark.parametrize("corrupt", [0, 2, 3])
def test_output_identical_with_drafts(spec_tiny_loaded, corrupt):
    reqs = varied_requests(12)
    ref_done, ref = reference(spec_tiny_loaded, reqs)
    eng = engine(spec_tiny_loaded)
    eng.proposer = OracleProposer(ref, corrupt)
    done = LLM(engine=eng).run(speculative(reqs))
    for r, a, b in zip(reqs, ref_done, done, strict=True):
        assert tokens(a) == tokens(b), f"{r.request_id} ({r.sampling})"
        assert [ch.logprobs for ch in a.choices] == [ch.logprobs for ch in b.choices], r.request_id
        assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
        assert [ch.finish_reason for ch in a.choices] == [ch.finish_reason for ch in b.choices]
    drafted = sum(c.stats.spec_draft_tokens for c in done)
    accepted = sum(c.stats.spec_accepted_tokens for c in done)
    stats = eng.stats()
    assert (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens) == (drafted, accepted)
    assert drafted > 0
    if corrupt == 0:
        assert accepted == drafted  # every draft is the reference token
    else:
        assert 0 < accepted < drafted
    assert sum(c.stats.generated_tokens for c in done) == sum(c.stats.generated_tokens for c in ref_done)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
