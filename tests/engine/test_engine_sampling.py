"""Sampling parameters end to end on the tiny model: each one observable, and able to fail."""

from __future__ import annotations

import torch
from tiny_checkpoint_ids import TINY_EOS

from protoserve.engine.llm import LLM
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams

PROMPT = list(b"The quick brown fox jumps over the lazy dog. ")


def run_one(make_engine, prompt=PROMPT, **sampling):
    llm = LLM(engine=make_engine())
    [c] = llm.run([TokenizedRequest("r", list(prompt), SamplingParams(**sampling))])
    return c


def test_top_k_1_equals_greedy(make_engine):
    greedy = run_one(make_engine, max_tokens=16, temperature=0.0).choices[0].token_ids
    topk = run_one(make_engine, max_tokens=16, temperature=1.0, top_k=1, seed=5).choices[0].token_ids
    assert topk == greedy
    sampled = run_one(make_engine, max_tokens=16, temperature=1.5, seed=5).choices[0].token_ids
    assert sampled != greedy


def test_seed_reproduces_and_differs(make_engine):
    a = run_one(make_engine, max_tokens=16, temperature=1.0, seed=1).choices[0].token_ids
    b = run_one(make_engine, max_tokens=16, temperature=1.0, seed=1).choices[0].token_ids
    c = run_one(make_engine, max_tokens=16, temperature=1.0, seed=2).choices[0].token_ids
    assert a == b and a != c


def test_presence_and_repetition_penalties_change_tokens(make_engine):
    base = run_one(make_engine, max_tokens=24, temperature=0.0, ignore_eos=True).choices[0].token_ids
    assert len(set(base)) < len(base), "greedy on the tiny model repeats tokens"
    presence = run_one(make_engine, max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=2.0)
    assert presence.choices[0].token_ids != base
    rep = run_one(make_engine, max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=5.0)
    assert rep.choices[0].token_ids != base
    assert len(set(rep.choices[0].token_ids)) > len(set(base))


def test_logit_bias_forces_a_token(make_engine):
    c = run_one(make_engine, max_tokens=6, temperature=1.0, seed=3, logit_bias={ord("A"): 100.0})
    assert c.choices[0].token_ids == [ord("A")] * 6
    assert c.choices[0].text == "AAAAAA"
    assert c.choices[0].finish_reason == FinishReason.LENGTH


def test_min_tokens_suppresses_eos_and_ignore_eos_continues(make_engine):
    c = run_one(make_engine, max_tokens=20, temperature=0.0, min_tokens=5, logit_bias={TINY_EOS: 100.0})
    ids = c.choices[0].token_ids
    assert len(ids) == 6 and ids[-1] == TINY_EOS and TINY_EOS not in ids[:5]
    assert c.choices[0].finish_reason == FinishReason.STOP and c.choices[0].stop_reason is None
    c = run_one(make_engine, max_tokens=7, temperature=0.0, ignore_eos=True, logit_bias={TINY_EOS: 100.0})
    assert c.choices[0].token_ids == [TINY_EOS] * 7
    assert c.choices[0].finish_reason == FinishReason.LENGTH
    assert c.choices[0].text == ""  # EOS is special: never rendered


def test_min_p_and_typical_p_change_sampling(make_engine):
    def sample(**kw):
        return [run_one(make_engine, max_tokens=12, temperature=2.0, seed=s, **kw).choices[0].token_ids
                for s in range(3)]

    free = sample()
    assert sample(min_p=0.5) != free
    assert sample(typical_p=0.2) != free
    # min_p=1 keeps only the most likely token: greedy.
    greedy = run_one(make_engine, max_tokens=12, temperature=0.0).choices[0].token_ids
    assert sample(min_p=1.0) == [greedy] * 3


def test_stop_string_cut_exactly_across_token_boundaries(make_engine):
    base = run_one(make_engine, max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={TINY_EOS: -100.0})
    text = base.choices[0].text
    assert len(text) >= 12, text
    stop = text[6:9]  # tokens are bytes here: a three-character stop string spans token boundaries
    cut = run_one(make_engine, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
                  logit_bias={TINY_EOS: -100.0})
    ch = cut.choices[0]
    assert ch.text == text[: text.find(stop)]
    assert (ch.finish_reason, ch.stop_reason) == (FinishReason.STOP, stop)


def test_stop_token_ids(make_engine):
    base = run_one(make_engine, max_tokens=30, temperature=0.0, ignore_eos=True).choices[0].token_ids
    stop_id = base[3]
    first = base.index(stop_id)
    c = run_one(make_engine, max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    ch = c.choices[0]
    assert ch.token_ids == base[: first + 1]
    assert (ch.finish_reason, ch.stop_reason) == (FinishReason.STOP, stop_id)


def test_logprobs_match_log_softmax_of_model_logits(make_engine):
    engine = make_engine()
    rows = []
    execute = engine.runner.execute

    def capture(seqs, num_new):
        out = execute(seqs, num_new)
        rows.append(out[0].clone())
        return out

    engine.runner.execute = capture
    [c] = LLM(engine=engine).run(
        [TokenizedRequest("lp", PROMPT, SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=4))]
    )
    ch = c.choices[0]
    assert len(ch.logprobs) == 5 == len(rows)
    for token, lp, logits in zip(ch.token_ids, ch.logprobs, rows, strict=True):
        ref = torch.log_softmax(logits.float(), dim=0)
        assert lp.chosen.token_id == token == int(torch.argmax(logits))
        assert abs(lp.chosen.logprob - ref[token].item()) < 1e-5
        assert [t.token_id for t in lp.top] == torch.topk(ref, 4).indices.tolist()
        assert all(abs(t.logprob - ref[t.token_id].item()) < 1e-5 for t in lp.top)


def test_n_samples_share_prompt_blocks_and_reuse_the_seed(make_engine):
    engine = make_engine()
    prompt = PROMPT[:40]  # two full 16-token blocks and a partial one
    engine.add_request(TokenizedRequest("n3", prompt, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11,
                                                                      ignore_eos=True)))
    outs: dict[int, list[int]] = {}

    def collect(outputs):
        for out in outputs:
            for d in out.deltas:
                outs.setdefault(d.index, []).extend(d.token_ids)

    collect(engine.step())  # prefill, then fork
    seqs = engine.requests["n3"].seqs
    assert len(seqs) == 3
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert [engine.block_manager.blocks[b].ref_count for b in shared] == [3, 3]
    collect(engine.step())  # the children recompute the partial block into blocks of their own
    assert len({s.block_table[2] for s in seqs}) == 3
    while engine.has_unfinished():
        collect(engine.step())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    [n3] = LLM(engine=make_engine()).run([TokenizedRequest("again", prompt, SamplingParams(
        n=3, max_tokens=10, temperature=1.0, seed=11, ignore_eos=True))])
    choices = [ch.token_ids for ch in n3.choices]
    assert choices == [outs[0], outs[1], outs[2]]
    assert len({tuple(c) for c in choices}) == 3, "each choice has its own generator"
    [n1] = LLM(engine=make_engine()).run([TokenizedRequest("one", prompt, SamplingParams(
        max_tokens=10, temperature=1.0, seed=11, ignore_eos=True))])
    assert choices[0] == n1.choices[0].token_ids, "choice 0 uses the request seed itself"
