"""The batched sampler (engine/sampling/batched.py) against the per-row host sampler it mirrors.

On device cuda a step's logits stay on the GPU and the rows this path serves are sampled there. It
must give each row the token the host sampler gives: same filters in the same order and the draw's
uniform from the sequence's own generator. Checked here on CPU tensors (the operations are device
agnostic; tests/models/test_device_path.py runs the engine with it on the Triton path): random
batches of greedy and sampled rows with top-k/top-p/min-p and penalties give the host's tokens and
leave every generator in the host's state; rows it does not serve go to the host sampler.
"""

from __future__ import annotations

import random

import torch

from protoserve.engine.sampling.batched import batch_sampleable
from protoserve.engine.sampling.sampler import Sampler
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence

VOCAB = 512
EOS = frozenset({0})


def _params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.5, 0.8, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 5, 50, VOCAB + 3]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
        presence_penalty=rng.choice([0.0, 0.0, 0.7]),
        seed=rng.randrange(1 << 30),
    )


def _seqs(rng: random.Random, params: list[SamplingParams]) -> list[Sequence]:
    seqs = []
    for i, sp in enumerate(params):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 20))]
        out = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 12))]
        seq = Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=prompt + out, num_prompt_tokens=len(prompt),
                       max_len=100, sampling=sp, generator=torch.Generator().manual_seed(sp.seed or 0))
        seqs.append(seq)
    return seqs


def _pair(rng_seed: int, rows: int) -> tuple[torch.Tensor, list[Sequence], list[Sequence]]:
    rng = random.Random(rng_seed)
    params = [_params(rng) for _ in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rng_seed)) * 3
    return logits, _seqs(random.Random(rng_seed), params), _seqs(random.Random(rng_seed), params)


def test_batched_rows_get_the_host_samplers_tokens():
    host, batched = Sampler(EOS), Sampler(EOS, batch_rows=True)
    for trial in range(40):
        logits, seqs_a, seqs_b = _pair(trial, rows=random.Random(trial).randrange(1, 24))
        assert all(batch_sampleable(s) for s in seqs_b)
        for _ in range(3):  # the generators move on alike: later draws agree too
            want = [r.token_id for r in host(logits, seqs_a)]
            got = [r.token_id for r in batched(logits, seqs_b)]
            assert got == want, (trial, got, want)


def test_rows_it_does_not_serve_go_to_the_host_sampler():
    rng = random.Random(7)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3, logit_bias={5: 50.0}),
              SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2), SamplingParams(temperature=1.0, seed=4),
              SamplingParams(temperature=0.7, seed=5, min_tokens=4), SamplingParams(temperature=1.1, seed=6,
                                                                                    typical_p=0.9)]
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(7))
    seqs_a, seqs_b = _seqs(random.Random(1), params), _seqs(random.Random(1), params)
    assert [batch_sampleable(s) for s in seqs_b] == [True, False, False, True, seqs_b[4].num_generated >= 4, False]
    want = Sampler(EOS)(logits, seqs_a)
    got = Sampler(EOS, batch_rows=True)(logits, seqs_b)
    assert [r.token_id for r in got] == [r.token_id for r in want]
    assert got[2].logprobs == want[2].logprobs and got[2].logprobs is not None
    assert got[1].token_id == 5  # the bias row kept its bias
    del rng


def test_penalties_change_the_greedy_token_as_on_the_host():
    logits = torch.zeros(1, VOCAB)
    logits[0, 9], logits[0, 10] = 2.0, 1.9
    sp = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    [seq] = _seqs(random.Random(0), [sp])
    seq.token_ids.append(9)  # token 9 seen: 2.0 / 1.5 < 1.9
    assert Sampler(EOS, batch_rows=True)(logits, [seq])[0].token_id == 10
