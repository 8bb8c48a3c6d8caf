"""Admission: validation, context policies, load shedding, and the stats a request and the engine report."""

from __future__ import annotations

import pytest

from protoserve.engine.errors import ContextLengthError, InvalidRequestError, QueueFullError
from protoserve.engine.llm import LLM
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.sampling_params import ContextPolicy, SamplingParams

LIMIT = 64


def req(rid: str, n_prompt: int, policy=ContextPolicy.ALLOW_CONTEXT_STOP, **sampling) -> TokenizedRequest:
    sampling.setdefault("temperature", 0.0)
    sampling.setdefault("ignore_eos", True)
    prompt = [(7 * i) % 256 for i in range(n_prompt)]
    return TokenizedRequest(rid, prompt, SamplingParams(**sampling), context_policy=policy)


@pytest.fixture
def engine(make_engine):
    return make_engine(max_model_len=LIMIT)


def test_allow_context_stop_generates_until_the_window_is_full(engine):
    [c] = LLM(engine=engine).run([req("a", 60, max_tokens=None)])
    assert len(c.choices[0].token_ids) == 4 and c.choices[0].finish_reason == FinishReason.LENGTH
    [c] = LLM(engine=engine).run([req("b", 60, max_tokens=100)])
    assert len(c.choices[0].token_ids) == 4 and c.choices[0].finish_reason == FinishReason.LENGTH
    with pytest.raises(ContextLengthError) as e:
        engine.add_request(req("c", LIMIT, max_tokens=1))
    assert e.value.limit == LIMIT and str(LIMIT) in str(e.value)


def test_reject_names_the_limit(engine):
    with pytest.raises(ContextLengthError) as e:
        engine.add_request(req("r", 60, ContextPolicy.REJECT, max_tokens=10))
    assert (e.value.requested, e.value.limit) == (70, LIMIT)
    assert "64" in str(e.value)
    [c] = LLM(engine=engine).run([req("ok", 60, ContextPolicy.REJECT, max_tokens=4)])
    assert len(c.choices[0].token_ids) == 4


@pytest.mark.parametrize(
    "policy, max_tokens, kept, slice_",
    [
        (ContextPolicy.TRUNCATE_LEFT, 8, LIMIT - 1, slice(100 - (LIMIT - 1), 100)),
        (ContextPolicy.TRUNCATE_RIGHT, 8, LIMIT - 1, slice(0, LIMIT - 1)),
        (ContextPolicy.RESERVE_GENERATION, 10, LIMIT - 10, slice(100 - (LIMIT - 10), 100)),
    ],
)
def test_truncation_policies(engine, make_engine, policy, max_tokens, kept, slice_):
    r = req("t", 100, policy, max_tokens=max_tokens)
    [c] = LLM(engine=engine).run([r])
    assert c.num_prompt_tokens == kept
    assert c.stats.prompt_tokens == kept and c.stats.truncated_prompt_tokens == 100 - kept
    assert engine.stats().truncated_prompt_tokens_total == 100 - kept
    expected_len = min(max_tokens, LIMIT - kept)
    assert len(c.choices[0].token_ids) == expected_len
    # Same as sending the kept part of the prompt yourself.
    direct = TokenizedRequest("d", r.prompt_token_ids[slice_], SamplingParams(max_tokens=max_tokens,
                                                                               temperature=0.0, ignore_eos=True))
    [d] = LLM(engine=make_engine(max_model_len=LIMIT)).run([direct])
    assert d.choices[0].token_ids == c.choices[0].token_ids


def test_reserve_generation_without_room_is_refused(engine):
    with pytest.raises(ContextLengthError):
        engine.add_request(req("x", 10, ContextPolicy.RESERVE_GENERATION, max_tokens=LIMIT))


def test_invalid_requests_list_every_violation(engine, make_engine):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(TokenizedRequest("bad", [], SamplingParams(top_p=0.0, n=0)))
    fields = {f for f, _ in e.value.violations}
    assert fields == {"prompt_token_ids", "top_p", "n"}
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(TokenizedRequest("bad2", [1, 99999], SamplingParams(logit_bias={99999: 1.0})))
    assert {f for f, _ in e.value.violations} == {"prompt_token_ids", "logit_bias"}
    with pytest.raises(InvalidRequestError) as e:
        make_engine(max_num_seqs=2).add_request(req("wide", 5, n=3))
    assert e.value.violations[0][0] == "n"
    engine.add_request(req("dup", 5))
    with pytest.raises(InvalidRequestError):
        engine.add_request(req("dup", 5))


def test_queue_full_sheds_load(make_engine):
    engine = make_engine(max_queue=2)
    engine.add_request(req("q1", 5))
    engine.add_request(req("q2", 5))
    with pytest.raises(QueueFullError) as e:
        engine.add_request(req("q3", 5))
    assert e.value.queue_len == 2
    engine.step()  # both admitted: the queue drains
    engine.add_request(req("q3", 5))


def test_request_and_engine_stats(make_engine):
    engine = make_engine()
    [c] = LLM(engine=engine).run([req("s", 40, max_tokens=9, n=2, temperature=1.0, seed=1)])
    s = c.stats
    assert s.prompt_tokens == 40 and s.generated_tokens == 18
    assert 0 <= s.queue_time_s <= s.time_to_first_token_s <= s.e2e_time_s
    assert s.prefill_time_s > 0 and s.decode_time_s > 0
    assert s.decode_tokens_per_s > 0
    assert s.kv_blocks >= 4  # 3 prompt blocks shared by both choices + a block of each choice's own
    assert s.kv_bytes == s.kv_blocks * engine.runner.block_bytes
    es = engine.stats()
    assert es.prompt_tokens_total == 40 and es.generation_tokens_total == 18
    assert es.running == es.waiting == 0 and es.kv_usage == 0.0
    assert es.kv_blocks_free == es.kv_blocks_total == 512
    assert es.num_steps == 9 and es.requests_finished_total == 1
    assert es.prefix_cache_queries == 40


def test_n_choices_finishing_in_the_fork_step(make_engine):
    engine = make_engine()
    [c] = LLM(engine=engine).run([req("n1", 20, n=3, max_tokens=1, temperature=1.0, seed=4)])
    assert [len(ch.token_ids) for ch in c.choices] == [1, 1, 1]
    assert all(ch.finish_reason == FinishReason.LENGTH for ch in c.choices)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.running == [] and engine.requests == {}
