"""Every SamplingParams field has one place in sampling (sampling_params.SAMPLING_FIELDS), and it holds.

A field the table does not classify fails here, so a new sampling parameter cannot be dropped silently
by the batched sampler (the GPU path): either the batched sampler applies it (DEVICE, checked against the
host sampler on rows that use it) or rows that use it go to the host sampler (HOST).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from protoserve.engine.sampling.batched import batch_sampleable
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampler import Sampler
from protoserve.engine.sampling.sampling_params import (
    MIROSTAT_REPLACES,
    SAMPLING_FIELDS,
    SamplingParams,
    Where,
    bare_argmax,
    host_only,
)
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.speculative.params import SpeculativeParams

VOCAB = 512
EOS = frozenset({0})
# A valid value that uses each field; a new field needs one here too.
USED = {
    "max_tokens": 5, "min_tokens": 3, "temperature": 0.7, "top_k": 5, "top_p": 0.5, "min_p": 0.2,
    "typical_p": 0.8, "top_n_sigma": 1.0, "repetition_penalty": 1.3, "frequency_penalty": 0.5,
    "presence_penalty": 0.5, "logit_bias": {5: 10.0}, "seed": 7, "stop": ["x"], "stop_token_ids": [3],
    "ignore_eos": True, "n": 2, "logprobs": True, "top_logprobs": 2, "skip_special_tokens": False,
    "constraint": Constraint.regex("a+"), "mirostat_mode": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2,
    "xtc_probability": 0.5, "xtc_threshold": 0.2, "speculative": SpeculativeParams(method="ngram"),
}
# Those only Mirostat reads: in use with it on; XTC's threshold likewise with XTC.
WITH_MIROSTAT = {"mirostat_tau", "mirostat_eta"}
WITH_XTC = {"xtc_threshold"}


def params_using(name: str, **base) -> SamplingParams:
    extra = {"mirostat_mode": 2} if name in WITH_MIROSTAT else {"xtc_probability": 0.5} if name in WITH_XTC else {}
    return SamplingParams(**{**base, **extra, name: USED[name]})


def seq_of(sp: SamplingParams, rng: random.Random, num_generated: int = 4) -> Sequence:
    prompt = [rng.randrange(1, VOCAB) for _ in range(6)]
    out = [rng.randrange(1, VOCAB) for _ in range(num_generated)]
    return Sequence(seq_id=0, request_id="r", index=0, token_ids=prompt + out, num_prompt_tokens=len(prompt),
                    max_len=100, sampling=sp, generator=torch.Generator().manual_seed(sp.seed or 0))


def test_every_field_is_classified_once() -> None:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(SAMPLING_FIELDS) == names, "classify the new field in sampling_params.SAMPLING_FIELDS"
    assert set(USED) == names, f"give the new field a value that uses it in {__file__}"


@pytest.mark.parametrize("name", sorted(SAMPLING_FIELDS))
def test_a_row_using_a_host_field_goes_to_the_host(name: str) -> None:
    sp = params_using(name)
    seq = seq_of(sp, random.Random(0), num_generated=0)
    if SAMPLING_FIELDS[name].where == Where.HOST:
        assert name in host_only(sp, 0) and not batch_sampleable(seq)
    else:
        assert name not in host_only(sp, 0)


def test_min_tokens_is_host_only_while_it_holds_eos_back() -> None:
    sp = SamplingParams(min_tokens=3)
    assert host_only(sp, 2) == ["min_tokens"] and host_only(sp, 3) == []


@pytest.mark.parametrize("name", sorted(n for n, use in SAMPLING_FIELDS.items() if use.where == Where.DEVICE))
def test_the_batched_sampler_applies_every_device_field_as_the_host_does(name: str) -> None:
    host, batched = Sampler(EOS), Sampler(EOS, batch_rows=True)
    changed = 0
    for trial in range(30):
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(trial)) * 3
        used, off = params_using(name, temperature=0.9, seed=trial), SamplingParams(temperature=0.9, seed=trial)
        if name == "temperature":
            off = SamplingParams(temperature=1.0, seed=trial)
        rows = [seq_of(sp, random.Random(trial)) for sp in (used, used, off)]
        assert batch_sampleable(rows[1])
        want = host(logits, [rows[0]])[0].token_id
        assert batched(logits, [rows[1]])[0].token_id == want, trial
        changed += want != host(logits, [rows[2]])[0].token_id
    assert changed, f"{name} never changed a token: the check above could not have caught it being dropped"


@pytest.mark.parametrize("name", sorted(SAMPLING_FIELDS))
def test_a_greedy_row_is_a_bare_argmax_unless_a_field_reshapes_it(name: str) -> None:
    if name in ("temperature", "mirostat_mode", "xtc_probability", *WITH_MIROSTAT, *WITH_XTC):
        return  # not greedy by definition
    sp = params_using(name, temperature=0.0)
    assert bare_argmax(sp, 0) is not SAMPLING_FIELDS[name].reshapes
    # The sampler's check, with what it reads once per sequence, says the same.
    assert Sampler(EOS).plain_greedy(seq_of(sp, random.Random(0), num_generated=0)) is not SAMPLING_FIELDS[name].reshapes


def test_min_tokens_reshapes_a_greedy_row_only_until_its_tokens_are_out() -> None:
    """min_tokens is used per step, not for good: the row becomes a bare argmax once it has them."""
    seq = seq_of(SamplingParams(temperature=0.0, min_tokens=2), random.Random(0), num_generated=0)
    sampler = Sampler(EOS)
    assert not sampler.plain_greedy(seq)
    seq.append_token(5)
    assert not sampler.plain_greedy(seq)
    seq.append_token(6)
    assert sampler.plain_greedy(seq)


@pytest.mark.parametrize("name", sorted(MIROSTAT_REPLACES))
def test_mirostat_refuses_the_candidate_filters_it_replaces(name: str) -> None:
    problems = dict(SamplingParams(temperature=1.0, mirostat_mode=2, **{name: USED[name]}).validate())
    assert "Mirostat picks the candidates itself" in problems[name]
    assert set(MIROSTAT_REPLACES) == {"top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability"}
