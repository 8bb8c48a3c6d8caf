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
    """Greedy and seeded rows with penalties, bias, min_tokens, logprobs, Mirostat and n > 1 mixed in."""
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
        if i % 7 == 3 and i % 2:  # sampled rows only: Mirostat's mu must move once per emitted token
            sp = replace(sp, mirostat_mode=2, top_k=0, top_p=1.0)
        reqs.append(TokenizedRequest(f"r{i}", prompt, sp))
    return reqs


@pytest.mark.parametrize("corrupt", [0, 2, 3])
def test_output_identical_with_drafts(spec_tiny_loaded, corrupt):
    reqs = varied_requests(12)
    ref_done, ref = reference(spec_tiny_loaded, reqs)
    eng = engine(spec_tiny_loaded)
    eng.speculator.proposer = OracleProposer(ref, corrupt)
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


def test_speculative_row_beside_plain_rows_and_prefills(spec_tiny_loaded):
    """Batch invariance: one speculative request among plain ones (some still in prefill) gets the tokens
    it gets alone without speculation, and so do its neighbours."""
    reqs = varied_requests(10, seed=1)
    ref_done, ref = reference(spec_tiny_loaded, reqs[:1], max_num_batched_tokens=4096)
    eng = engine(spec_tiny_loaded, max_num_batched_tokens=24)  # long prompts chunk beside the drafts
    eng.speculator.proposer = OracleProposer(ref, corrupt=3)
    mixed = speculative(reqs[:1]) + [replace(r, sampling=replace(r.sampling)) for r in reqs[1:]]
    done = LLM(engine=eng).run(mixed)
    assert tokens(done[0]) == tokens(ref_done[0])
    assert done[0].stats.spec_accepted_tokens > 0
    plain_done, _ = reference(spec_tiny_loaded, reqs[1:])
    assert [tokens(c) for c in done[1:]] == [tokens(c) for c in plain_done]


def test_preemption_drops_drafts_and_recomputes(spec_tiny_loaded):
    reqs = [TokenizedRequest(f"p{i}", [10 + i] * 20, SamplingParams(max_tokens=40, temperature=0.0))
            for i in range(6)]
    ref_done, ref = reference(spec_tiny_loaded, reqs)
    eng = engine(spec_tiny_loaded, max_kv_blocks=40)  # 6 x 60 tokens need 90 blocks of 4
    eng.speculator.proposer = OracleProposer(ref, corrupt=4)
    done = LLM(engine=eng).run(speculative(reqs))
    assert eng.stats().preemptions_total > 0
    assert eng.stats().spec_decode_num_accepted_tokens > 0
    assert [tokens(c) for c in done] == [tokens(c) for c in ref_done]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_stop_string_and_stop_token_inside_accepted_drafts(spec_tiny_loaded):
    base = TokenizedRequest("s", list(b"stop strings"), SamplingParams(max_tokens=30, temperature=0.0))
    [full], ref = reference(spec_tiny_loaded, [base])
    out = full.choices[0].token_ids
    # A stop token and a stop string (one whole token's text) from the middle of the reference output.
    stop_token = out[12]
    stop_text = bytes([out[9]]).decode("latin-1") if out[9] < 128 else None
    sp = replace(base.sampling, stop_token_ids=[stop_token])
    if stop_text is not None and stop_text.isprintable():
        sp = replace(sp, stop=[stop_text])
    req = replace(base, sampling=sp)
    [want], _ = reference(spec_tiny_loaded, [req])
    eng = engine(spec_tiny_loaded)
    eng.speculator.proposer = OracleProposer(ref)  # drafts run past the stop: what follows must be dropped
    [got] = LLM(engine=eng).run(speculative([req]))
    assert want.choices[0].finish_reason == FinishReason.STOP
    assert tokens(got) == tokens(want)
    assert (got.choices[0].text, got.choices[0].stop_reason) == (want.choices[0].text, want.choices[0].stop_reason)
    assert len(tokens(got)[0]) < len(out)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_max_tokens_is_never_overrun(spec_tiny_loaded):
    reqs = [TokenizedRequest(f"m{i}", list(b"abcabcabc"), SamplingParams(max_tokens=i, temperature=0.0))
            for i in range(1, 9)]
    _, ref = reference(spec_tiny_loaded, [replace(r, sampling=replace(r.sampling, max_tokens=20)) for r in reqs])
    eng = engine(spec_tiny_loaded)
    eng.speculator.proposer = OracleProposer(ref)
    done = LLM(engine=eng).run(speculative(reqs))
    for r, c in zip(reqs, done, strict=True):
        assert tokens(c)[0] == ref[(r.request_id, 0)][: r.sampling.max_tokens]


def test_rollback_keeps_prefix_cache_right(spec_tiny_loaded):
    """Rejected drafts filled whole blocks (k=8, block 4): none of them may be cached under a name, and
    a later request sharing the prompt and output gets the logprobs a fresh engine gives."""
    prompt = list(b"prefix cache and speculation")
    first = TokenizedRequest("a", prompt, SamplingParams(max_tokens=40, temperature=0.0))
    [ref_a], ref = reference(spec_tiny_loaded, [first])
    eng = engine(spec_tiny_loaded)
    eng.speculator.proposer = OracleProposer(ref, corrupt=2)
    spec8 = SpeculativeParams(num_speculative_tokens=8)
    [a] = LLM(engine=eng).run([replace(first, sampling=replace(first.sampling, speculative=spec8))])
    assert tokens(a) == tokens(ref_a) and a.stats.spec_draft_tokens > a.stats.spec_accepted_tokens > 0
    final = prompt + ref_a.choices[0].token_ids
    named = set(chain_hashes(b"", final, 4, []))
    assert eng.block_manager.cached and set(eng.block_manager.cached) <= named, "a block of drafts was cached"
    follow = TokenizedRequest("b", final[:-3], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True,
                                                              top_logprobs=5))
    [b] = LLM(engine=eng).run([follow])
    assert b.stats.cached_prompt_tokens > len(prompt)
    [fresh] = reference(spec_tiny_loaded, [follow])[0]
    assert tokens(b) == tokens(fresh) and b.choices[0].logprobs == fresh.choices[0].logprobs


def test_refusals_name_the_field(spec_tiny_loaded):
    eng = engine(spec_tiny_loaded)
    bad = SamplingParams(speculative=SpeculativeParams(num_speculative_tokens=0))
    with pytest.raises(InvalidRequestError) as exc:
        eng.add_request(TokenizedRequest("x", [1, 2], bad))
    assert "speculative.num_speculative_tokens" in str(exc.value)
    constrained = SamplingParams(speculative=SPEC, constraint=Constraint(kind="regex", text="[ab]+"))
    with pytest.raises(InvalidRequestError) as exc:
        eng.add_request(TokenizedRequest("y", [1, 2], constrained))
    assert "speculative" in str(exc.value) and "constraint" in str(exc.value)
    with pytest.raises(ValueError, match="speculative.method"):
        LLMEngine(spec_tiny_loaded, EngineConfig(max_kv_blocks=8, speculative=SpeculativeParams(method="medusa")))


def test_drafts_back_off_while_nothing_is_accepted(spec_tiny_loaded):
    """Every draft wrong: output unchanged, and drafting backs off (1, 2, 4, ... steps skipped) instead of
    paying for k wasted positions each step."""
    req = TokenizedRequest("w", list(b"backoff"), SamplingParams(max_tokens=60, temperature=0.0))
    [want], ref = reference(spec_tiny_loaded, [req])
    eng = engine(spec_tiny_loaded)
    eng.speculator.proposer = OracleProposer(ref, corrupt=1)
    [got] = LLM(engine=eng).run(speculative([req]))
    assert tokens(got) == tokens(want)
    s = got.stats
    assert s.spec_accepted_tokens == 0
    # Verifications at decode steps 1, 4, 9, 18, 35: each miss doubles the skip (2, 4, 8, 16, ...).
    assert s.spec_num_drafts == 5, s


@pytest.fixture(scope="module")
def tiny_int4_draft(spec_tiny_loaded):
    """The tiny model's own weights at int4: close to the target, not equal (some drafts miss)."""
    from protoserve.engine.loader.load import load_model

    return load_model(str(spec_tiny_loaded.source), dtype="float32", quantization="int4", progress=False,
                      load_tokenizer=False)


def test_draft_model_drafts_change_no_token(spec_tiny_loaded, tiny_int4_draft):
    reqs = varied_requests(10, seed=2)
    ref_done, _ = reference(spec_tiny_loaded, reqs)
    eng = engine(spec_tiny_loaded, max_num_batched_tokens=32)
    eng.enable_draft_model(tiny_int4_draft)
    draft = SpeculativeParams(method="draft", num_speculative_tokens=4)
    done = LLM(engine=eng).run([replace(r, request_id=r.request_id + "-spec",
                                        sampling=replace(r.sampling, speculative=draft)) for r in reqs])
    for r, a, b in zip(reqs, ref_done, done, strict=True):
        assert tokens(a) == tokens(b), r.request_id
        assert [ch.logprobs for ch in a.choices] == [ch.logprobs for ch in b.choices], r.request_id
    stats = eng.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.step()  # the next step frees the draft model's K/V of finished sequences
    assert not eng.speculator.draft_proposer.states
    assert eng.speculator.draft_proposer.blocks.num_free_blocks == eng.speculator.draft_proposer.blocks.num_blocks


def test_draft_method_needs_a_draft_model(spec_tiny_loaded):
    eng = engine(spec_tiny_loaded)
    sp = SamplingParams(speculative=SpeculativeParams(method="draft"))
    with pytest.raises(InvalidRequestError, match="speculative.method"):
        eng.add_request(TokenizedRequest("d", [1, 2], sp))
    with pytest.raises(ValueError, match="needs speculative_model"):
        EngineConfig(speculative=SpeculativeParams(method="draft")).validate()


def test_no_drafts_above_the_batch_size_limit(spec_tiny_loaded):
    reqs = [TokenizedRequest(f"b{i}", [20 + i] * 8, SamplingParams(max_tokens=12, temperature=0.0)) for i in range(3)]
    ref_done, ref = reference(spec_tiny_loaded, reqs)
    busy = engine(spec_tiny_loaded, speculative_disable_by_batch_size=2)
    busy.speculator.proposer = OracleProposer(ref)
    assert [tokens(c) for c in LLM(engine=busy).run(speculative(reqs))] == [tokens(c) for c in ref_done]
    assert busy.stats().spec_decode_num_drafts == 0  # three running all along
    roomy = engine(spec_tiny_loaded, speculative_disable_by_batch_size=3)
    roomy.speculator.proposer = OracleProposer(ref)
    LLM(engine=roomy).run(speculative(reqs))
    assert roomy.stats().spec_decode_num_drafts > 0
