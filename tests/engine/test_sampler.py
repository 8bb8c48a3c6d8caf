"""Sampler, penalties and filters on synthetic logits; filters checked against transformers' warpers."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from protoserve.engine.sampling.sampler import (
    Sampler,
    apply_min_p,
    apply_top_n_sigma,
    apply_top_p,
    apply_typical_p,
    draw,
)
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence

V = 64
EOS = 3


def make_seq(sp: SamplingParams, prompt=(1, 2), output=(), seed: int = 0) -> Sequence:
    g = torch.Generator()
    g.manual_seed(seed)
    return Sequence(
        seq_id=0, request_id="r", index=0, token_ids=list(prompt) + list(output), num_prompt_tokens=len(prompt),
        max_len=1000, sampling=sp, generator=g,
    )


def rand_logits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * 3


sampler = Sampler(frozenset({EOS}))


def kept(filtered: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(filtered)).flatten().tolist())


def test_top_k_1_equals_greedy():
    for s in range(20):
        logits = rand_logits(s)
        greedy = sampler.sample_row(logits, make_seq(SamplingParams(temperature=0.0))).token_id
        topk1 = sampler.sample_row(logits, make_seq(SamplingParams(temperature=1.5, top_k=1), seed=s)).token_id
        assert topk1 == greedy == int(torch.argmax(logits))


def test_top_k_restricts_to_k_best():
    logits = rand_logits(1)
    best3 = set(torch.topk(logits, 3).indices.tolist())
    got = {sampler.sample_row(logits, make_seq(SamplingParams(top_k=3, temperature=5.0), seed=s)).token_id
           for s in range(200)}
    assert got <= best3 and len(got) > 1


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_top_p_min_p_typical_p_match_transformers(p):
    for s in range(10):
        logits = rand_logits(s)
        ours = kept(apply_top_p(logits.clone(), p))
        theirs = kept(TopPLogitsWarper(p)(None, logits.clone()[None])[0])
        assert ours == theirs
        assert kept(apply_min_p(logits.clone(), p)) == kept(MinPLogitsWarper(p)(None, logits.clone()[None])[0])
        assert kept(apply_typical_p(logits.clone(), p)) == kept(
            TypicalLogitsWarper(p)(None, logits.clone()[None])[0])


def test_min_p_filters_unlikely_tokens():
    logits = torch.full((V,), -5.0)
    logits[10], logits[11], logits[12] = 2.0, 1.8, 0.0  # p12 / p10 = e^-2 ~ 0.135
    got = {sampler.sample_row(logits, make_seq(SamplingParams(min_p=0.2), seed=s)).token_id for s in range(300)}
    assert got == {10, 11}
    got = {sampler.sample_row(logits, make_seq(SamplingParams(min_p=0.0), seed=s)).token_id for s in range(300)}
    assert 12 in got


def test_typical_p_changes_the_support():
    logits = rand_logits(7)
    full = kept(apply_typical_p(logits.clone(), 1.0))
    cut = kept(apply_typical_p(logits.clone(), 0.3))
    assert len(cut) < len(full)
    got = {sampler.sample_row(logits, make_seq(SamplingParams(typical_p=0.3), seed=s)).token_id for s in range(200)}
    assert got <= cut


def test_presence_penalty_changes_tokens():
    logits = torch.zeros(V)
    logits[5], logits[6] = 1.0, 0.5
    seq = make_seq(SamplingParams(temperature=0.0), output=[5])
    assert sampler.sample_row(logits, seq).token_id == 5
    seq = make_seq(SamplingParams(temperature=0.0, presence_penalty=2.0), output=[5])
    assert sampler.sample_row(logits, seq).token_id == 6


def test_frequency_penalty_scales_with_count():
    logits = torch.zeros(V)
    logits[5], logits[6] = 1.0, 0.0
    sp = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    adjusted = sampler.adjust(logits, make_seq(sp, output=[5, 5, 6]))
    assert adjusted[5].item() == pytest.approx(1.0 - 0.8)
    assert adjusted[6].item() == pytest.approx(-0.4)
    assert sampler.sample_row(logits, make_seq(sp, output=[5, 5, 5])).token_id != 5


def test_repetition_penalty_matches_transformers():
    logits = rand_logits(3)
    tokens = [1, 2, 9, 9, 40]
    ours = sampler.adjust(logits, make_seq(SamplingParams(repetition_penalty=1.7), prompt=tokens[:2], output=tokens[2:]))
    theirs = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([tokens]), logits.clone()[None])[0]
    torch.testing.assert_close(ours, theirs)


def test_logit_bias_forces_a_token():
    for s in range(10):
        logits = rand_logits(s)
        seq = make_seq(SamplingParams(logit_bias={17: 100.0}), seed=s)
        assert sampler.sample_row(logits, seq).token_id == 17


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(V)
    logits[EOS], logits[8], logits[9] = 10.0, 9.0, 1.0
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[8])
    assert sampler.sample_row(logits, make_seq(sp, output=[9])).token_id == 9
    assert sampler.sample_row(logits, make_seq(sp, output=[9, 9])).token_id == EOS
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sampler.sample_row(logits, make_seq(ignore, output=[9])).token_id == EOS


def test_logprobs_are_log_softmax_of_the_logits():
    logits = rand_logits(5)
    ref = torch.log_softmax(logits, dim=0)
    for sp in (SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5),
               SamplingParams(temperature=1.0, top_k=4, logprobs=True, top_logprobs=5)):
        r = sampler.sample_row(logits, make_seq(sp, seed=2))
        assert r.logprobs is not None
        assert r.logprobs.chosen.logprob == pytest.approx(ref[r.token_id].item(), abs=1e-6)
        assert [t.token_id for t in r.logprobs.top] == torch.topk(ref, 5).indices.tolist()
        for t in r.logprobs.top:
            assert t.logprob == pytest.approx(ref[t.token_id].item(), abs=1e-6)
    # With temperature the distribution is the scaled one.
    r = sampler.sample_row(logits, make_seq(SamplingParams(temperature=2.0, logprobs=True), seed=1))
    assert r.logprobs.chosen.logprob == pytest.approx(torch.log_softmax(logits / 2, 0)[r.token_id].item(), abs=1e-6)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.stack([rand_logits(s) for s in range(4)])
    sp = SamplingParams(temperature=1.0, seed=123)
    alone = [sampler(logits[2:3], [make_seq(sp, seed=123)])[0].token_id]
    seqs = [make_seq(SamplingParams(temperature=0.7), seed=s) for s in (9, 8)] + [make_seq(sp, seed=123)]
    batched = sampler(logits[[0, 1, 2]], seqs)
    assert batched[2].token_id == alone[0]


def test_draw_follows_the_distribution_and_never_picks_zero_mass():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.2, 0.1, 0.0])
    g = torch.Generator().manual_seed(0)
    counts = [0] * 6
    n = 4000
    for _ in range(n):
        counts[draw(probs, g)] += 1
    assert counts[0] == counts[2] == counts[5] == 0
    for i, p in ((1, 0.7), (3, 0.2), (4, 0.1)):
        assert abs(counts[i] / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_batched_greedy_rows_choose_what_each_row_alone_would():
    """Plain greedy rows take one batch argmax; rows with a bias, held tokens, penalties, logprobs
    or temperature keep the per-row path. Every row's choice equals sample_row on that row alone,
    ties (first maximum) included."""
    cases = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={5: 100.0}),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        SamplingParams(temperature=0.0, top_logprobs=2),
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0),
    ]
    logits = torch.stack([rand_logits(i) for i in range(len(cases))])
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first index wins
    logits[7, EOS] = logits[7].max() + 1
    expected = [sampler.sample_row(logits[i], make_seq(sp, output=(2, 2), seed=i)) for i, sp in enumerate(cases)]
    seqs = [make_seq(sp, output=(2, 2), seed=i) for i, sp in enumerate(cases)]
    assert [sampler.plain_greedy(s) for s in seqs] == [True, False, False, False, False, False, False, True]
    got = sampler(logits, seqs)
    assert [r.token_id for r in got] == [r.token_id for r in expected]
    assert got[0].token_id == 7 and got[7].token_id == EOS
    assert got[5].logprobs is not None and got[0].logprobs is None


def llama_cpp_top_n_sigma(logits: list[float], n: float) -> list[float]:
    """llama.cpp's llama_sampler_top_n_sigma_apply (src/llama-sampling.cpp), step by step, on a list."""
    out = list(logits)
    if n <= 0.0 or len(out) <= 1:
        return out
    largest, total, count = out[0], 0.0, 0  # the largest starts at the first logit, as there
    for x in out:
        if x != -math.inf:  # tokens already cut take no part
            largest = max(largest, x)
            total += x
            count += 1
    mean = total / count if count > 0 else 0.0
    acc = sum((x - mean) ** 2 for x in out if x != -math.inf)
    std = math.sqrt(acc / count) if count > 0 else 0.0
    return [-math.inf if x < largest - n * std else x for x in out]


def cut_some(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """The row with a third of its tokens already impossible (as a grammar mask or a filter leaves it)."""
    g = torch.Generator().manual_seed(seed)
    return logits.index_fill(0, torch.randperm(V, generator=g)[: V // 3], float("-inf"))


@pytest.mark.parametrize("n", [0.25, 1.0, 2.0, 3.5])
def test_top_n_sigma_keeps_what_llama_cpp_keeps(n):
    for s in range(40):
        logits = rand_logits(s) if s % 2 else cut_some(rand_logits(s), s)
        got = apply_top_n_sigma(logits, n)
        want = llama_cpp_top_n_sigma(logits.tolist(), n)
        assert kept(got) == {i for i, x in enumerate(want) if x != -math.inf}, (n, s)
        assert kept(got) and (n > 1.0 or len(kept(got)) < len(kept(logits)))  # small n does cut
        survivors = torch.isfinite(got)
        assert torch.equal(got[survivors], logits[survivors])  # kept logits are untouched
        # Temperature scales the largest logit and the deviation alike: the same tokens survive it.
        assert kept(apply_top_n_sigma(logits / 0.7, n)) == kept(got)


def test_top_n_sigma_zero_is_off_and_the_sampler_draws_only_what_it_keeps():
    logits = rand_logits(3)
    assert torch.equal(apply_top_n_sigma(logits, 0.0), logits)
    allowed = kept(apply_top_n_sigma(logits / 2.0, 0.5))
    assert 1 < len(allowed) < V
    draws = {sampler.sample_row(logits, make_seq(SamplingParams(temperature=2.0, top_n_sigma=0.5), seed=s)).token_id
             for s in range(300)}
    assert draws <= allowed and len(draws) > 1
    # Before top-k, as in llama.cpp's chain: the deviation is the whole row's, not the k survivors'.
    both = {sampler.sample_row(logits, make_seq(SamplingParams(temperature=2.0, top_n_sigma=0.5, top_k=2),
                                                seed=s)).token_id for s in range(100)}
    assert both <= allowed & set(torch.topk(logits, 2).indices.tolist())


def test_top_n_sigma_is_validated_and_off_under_mirostat():
    assert SamplingParams(top_n_sigma=1.5).validate() == []
    assert SamplingParams(top_n_sigma=-1.0).validate() == [("top_n_sigma", "must be in [0, 100] (0 disables)")]
    assert ("top_n_sigma", "must be 0.0 with mirostat_mode: Mirostat picks the candidates itself") in SamplingParams(
        mirostat_mode=2, top_n_sigma=1.0
    ).validate()



@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1e-8])
def test_a_tiny_temperature_samples_the_likeliest_token_instead_of_failing(temperature):
    """Logits over 1e-40 overflow to inf (NaN probabilities, no nucleus left): raised to the floor, as vLLM does."""
    sp = SamplingParams(temperature=temperature, top_p=0.5, top_k=10, min_p=0.1, seed=1)
    assert sp.temperature == 1e-2 and not sp.greedy
    logits = rand_logits(5)
    result = sampler.sample_row(logits.clone(), make_seq(sp))
    assert result.token_id == int(torch.argmax(logits))
