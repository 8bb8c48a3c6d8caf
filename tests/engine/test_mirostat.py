"""Mirostat v1/v2 in the sampler, step by step against a plain transcription of llama.cpp's algorithm.

The transcription below follows ``llama_sampler_mirostat_apply`` and
``llama_sampler_mirostat_v2_apply`` line by line in scalar Python (temperature,
softmax over the candidates sorted by probability, the cut, a second softmax
over what is kept, one draw, the mu update), drawing its uniform from the same
generator as the sampler. On fixed logits both must pick the same token and
reach the same mu at every step.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_engine_batching import clone, fresh_rng, tokens
from tiny_checkpoint_ids import TINY_VOCAB

from protoserve.engine.errors import InvalidRequestError
from protoserve.engine.llm import LLM
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampler import Sampler
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def transcribed_step(row: list[float], mode: int, mu: float, tau: float, eta: float,
                     generator: torch.Generator, m: int = 100) -> tuple[int, float]:
    """One llama.cpp Mirostat step on one row of temperature-scaled logits: (token id, new mu)."""
    cands = sorted(((x, i) for i, x in enumerate(row) if x != -math.inf), key=lambda c: -c[0])
    p = softmax([x for x, _ in cands])
    if mode == 1:
        sum_ti_bi = sum_ti_sq = 0.0
        for i in range(min(m - 1, len(p) - 1)):
            t_i = math.log((i + 2) / (i + 1))
            b_i = math.log(p[i] / p[i + 1])
            sum_ti_bi += t_i * b_i
            sum_ti_sq += t_i * t_i
        s_hat = sum_ti_bi / sum_ti_sq
        epsilon_hat = s_hat - 1
        k = ((epsilon_hat * 2**mu) / (1 - len(row) ** (-epsilon_hat))) ** (1 / s_hat)
        size = max(int(k), 1)
    else:
        size = next((i for i, q in enumerate(p) if -math.log2(q) > mu), len(p)) or 1
    kept = softmax([x for x, _ in cands[:size]])
    u = float(torch.rand(1, generator=generator, dtype=torch.float64)) * math.fsum(kept)
    cum, idx = 0.0, len(kept) - 1
    for j, q in enumerate(kept):
        cum += q
        if cum > u:
            idx = j
            break
    observed_surprise = -math.log2(kept[idx])
    return cands[idx][1], mu - eta * (observed_surprise - tau)


def make_seq(sp: SamplingParams, seed: int) -> Sequence:
    return Sequence(seq_id=0, request_id="m", index=0, token_ids=[1], num_prompt_tokens=1, max_len=10_000,
                    sampling=sp, generator=torch.Generator().manual_seed(seed),
                    mirostat_mu=2 * sp.mirostat_tau)


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("tau, eta, temperature", [(5.0, 0.1, 1.0), (3.0, 0.3, 0.7), (8.0, 0.05, 1.3)])
def test_sampler_follows_the_published_algorithm_step_by_step(mode, tau, eta, temperature):
    vocab, steps = 2000, 60
    g = torch.Generator().manual_seed(1234 + mode)
    # Zipf-like rows with noise: the shape Mirostat's s_hat estimate assumes, as a language model's are.
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [(-1.1 * ranks.log() + 0.5 * torch.randn(vocab, generator=g))[torch.randperm(vocab, generator=g)]
            for _ in range(steps)]
    for r in rows[::7]:
        r[torch.randperm(vocab, generator=g)[:300]] = float("-inf")  # masked tokens are not candidates
    sp = SamplingParams(temperature=temperature, mirostat_mode=mode, mirostat_tau=tau, mirostat_eta=eta)
    assert sp.validate() == []
    seq = make_seq(sp, seed=99)
    reference = torch.Generator().manual_seed(99)
    sampler, mu, mus = Sampler(frozenset()), 2 * tau, set()
    for step, row in enumerate(rows):
        [got] = sampler(row.unsqueeze(0), [seq])
        # llama.cpp's temperature sampler runs first, in float32, as the engine's does.
        want, mu = transcribed_step((row / temperature).tolist(), mode, mu, tau, eta, reference)
        assert got.token_id == want, f"step {step}"
        assert seq.mirostat_mu == pytest.approx(mu, rel=1e-9, abs=1e-9), f"step {step}"
        assert row[want] != float("-inf")
        seq.append_token(got.token_id)
        mus.add(round(mu, 6))
    assert len(mus) > steps // 2  # mu moved every step, as the feedback loop should


def test_a_lower_tau_gives_less_surprising_text():
    """The point of the algorithm: tau sets how surprising the drawn tokens are, in either mode."""
    g = torch.Generator().manual_seed(5)
    vocab = 4000
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [-1.0 * ranks.log() + 0.3 * torch.randn(vocab, generator=g) for _ in range(300)]
    for mode in (1, 2):
        means = []
        for tau in (2.0, 4.0, 8.0):
            sp = SamplingParams(temperature=1.0, mirostat_mode=mode, mirostat_tau=tau, mirostat_eta=0.2)
            seq, sampler = make_seq(sp, seed=mode), Sampler(frozenset())
            surprises = []
            for row in rows:
                [got] = sampler(row.unsqueeze(0), [seq])
                surprises.append(-math.log2(float(torch.softmax(row.double(), dim=0)[got.token_id])))
            means.append(sum(surprises[100:]) / 200)
        print(f"mirostat {mode}: mean surprise {[round(m, 2) for m in means]} bits at tau 2, 4, 8")
        assert means[0] + 0.5 < means[1] and means[1] + 0.5 < means[2], (mode, means)


def test_mirostat_in_the_engine_is_per_sequence_and_batch_invariant(make_engine):
    rng = fresh_rng()
    reqs = []
    for i in range(10):
        sp = SamplingParams(max_tokens=rng.randint(5, 30), temperature=1.0, seed=rng.randrange(2**31),
                            mirostat_mode=1 + i % 2, mirostat_tau=rng.choice([3.0, 5.0]), logprobs=True,
                            n=2 if i % 3 == 0 else 1)
        reqs.append(TokenizedRequest(f"m{i}", [rng.randrange(256) for _ in range(rng.randint(1, 40))], sp))
    batched = LLM(engine=make_engine(max_num_seqs=32)).run([clone(r) for r in reqs])
    alone = LLM(engine=make_engine())
    for r, b in zip(reqs, batched, strict=True):
        [a] = alone.run([clone(r, "-alone")])
        assert tokens(a) == tokens(b), r.request_id
    assert all(t < TINY_VOCAB for c in batched for ch in c.choices for t in ch.token_ids)


@pytest.mark.parametrize(
    "fields, bad",
    [
        ({"mirostat_mode": 3}, ["mirostat_mode"]),
        ({"mirostat_mode": 2, "mirostat_tau": -1.0}, ["mirostat_tau"]),
        ({"mirostat_mode": 1, "mirostat_eta": 1.5}, ["mirostat_eta"]),
        ({"mirostat_mode": 2, "temperature": 0.0}, ["temperature"]),
        ({"mirostat_mode": 1, "top_p": 0.9, "top_k": 40}, ["top_k", "top_p"]),
        ({"mirostat_mode": 2, "min_p": 0.1, "typical_p": 0.5}, ["min_p", "typical_p"]),
        ({"mirostat_tau": 3.0}, ["mirostat_tau"]),  # set without a mode it would do nothing: refused
        ({"mirostat_eta": 0.5}, ["mirostat_eta"]),
    ],
)
def test_bad_mirostat_settings_are_refused_by_name(make_engine, fields, bad):
    sp = SamplingParams(**{"temperature": 1.0, **fields})
    assert [f for f, _ in sp.validate()] == bad
    with pytest.raises(InvalidRequestError):
        make_engine().add_request(TokenizedRequest("x", [1, 2, 3], sp))
