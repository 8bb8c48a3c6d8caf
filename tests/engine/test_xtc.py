"""XTC (engine/sampling/xtc.py) against a transcription of llama.cpp's ``llama_sampler_xtc_apply``.

llama.cpp keeps the candidates as a list of (token, logit) after its earlier samplers; ours keeps a
logits row with the dropped tokens at -inf. Both draw XTC's chance only while two or more candidates
remain, and keep the same candidates after it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from protoserve.engine.sampling.sampler import Sampler
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.sampling.xtc import apply_xtc
from protoserve.engine.scheduling.sequence import Sequence


def llama_cpp_xtc(cands: list[tuple[int, float]], probability: float, threshold: float, chance: float,
                  min_keep: int = 1) -> list[tuple[int, float]]:
    """llama_sampler_xtc_apply, line for line (src/llama-sampling.cpp)."""
    if probability <= 0.0 or threshold > 0.5 or len(cands) < 2:
        return cands
    if chance > probability:
        return cands
    # llama_sampler_softmax_impl: sorted by logit, descending, with probabilities
    cands = sorted(cands, key=lambda c: -c[1])
    top = cands[0][1]
    exps = [math.exp(logit - top) for _, logit in cands]
    total = sum(exps)
    probs = [e / total for e in exps]
    pos_last = 0
    for i, p in enumerate(probs):
        if p >= threshold:
            pos_last = i
        else:
            break
    if len(cands) - pos_last >= min_keep and pos_last > 0:
        cands = cands[pos_last:]
    return cands


@pytest.mark.parametrize("trial", range(200))
def test_the_same_candidates_survive_as_in_llama_cpp(trial: int) -> None:
    rng = random.Random(trial)
    vocab = rng.choice([2, 3, 8, 50])
    logits = torch.tensor([rng.gauss(0, rng.choice([0.5, 2.0, 5.0])) for _ in range(vocab)], dtype=torch.float64)
    dropped = rng.sample(range(vocab), rng.randrange(0, vocab))  # what earlier filters took away
    logits[dropped] = float("-inf")
    probability, threshold = rng.choice([0.0, 0.3, 1.0]), rng.choice([0.0, 0.05, 0.1, 0.3, 0.5])
    generator = torch.Generator().manual_seed(trial)
    chance_source = torch.Generator().manual_seed(trial)
    cands = [(t, float(logits[t])) for t in range(vocab) if math.isfinite(logits[t])]
    draws = probability > 0.0 and len(cands) >= 2
    chance = float(torch.rand((), generator=chance_source, dtype=torch.float64)) if draws else 1.0
    want = {t for t, _ in llama_cpp_xtc(cands, probability, threshold, chance)}
    got = apply_xtc(logits, probability, threshold, generator)
    assert {t for t in range(vocab) if math.isfinite(got[t])} == want
    assert generator.get_state().equal(chance_source.get_state())  # one uniform drawn, or none


def test_it_drops_the_likeliest_keeping_the_least_likely_above_the_threshold() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    out = apply_xtc(logits, 1.0, 0.1, torch.Generator().manual_seed(0))
    assert torch.isinf(out[:2]).all() and torch.isfinite(out[2:]).all()


def test_a_seeded_request_keeps_its_tokens_and_xtc_changes_them() -> None:
    def tokens(**xtc) -> list[int]:
        sp = SamplingParams(temperature=1.0, seed=5, **xtc)
        seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2, 3], num_prompt_tokens=3, max_len=99,
                       sampling=sp, generator=torch.Generator().manual_seed(5))
        logits = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)) * 3
        sampler = Sampler(frozenset({0}))
        return [sampler(logits[i : i + 1], [seq])[0].token_id for i in range(40)]

    assert tokens(xtc_probability=1.0, xtc_threshold=0.05) == tokens(xtc_probability=1.0, xtc_threshold=0.05)
    assert tokens(xtc_probability=1.0, xtc_threshold=0.05) != tokens()


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"xtc_probability": 1.5}, "xtc_probability", "[0, 1]"),
        ({"xtc_probability": 0.5, "xtc_threshold": 0.6}, "xtc_threshold", "[0, 0.5]"),
        ({"xtc_threshold": 0.2}, "xtc_threshold", "no effect unless xtc_probability"),
        ({"xtc_probability": 0.5, "temperature": 0.0}, "temperature", "above 0 with xtc_probability"),
        ({"xtc_probability": 0.5, "mirostat_mode": 2}, "xtc_probability", "Mirostat picks the candidates"),
    ],
)
def test_settings_xtc_cannot_honour_are_refused_by_name(fields: dict, field: str, words: str) -> None:
    problems = dict(SamplingParams(**fields).validate())
    assert words in problems[field], problems
