"""Grammar fast-forward: the tokens a constraint forces are drafted and verified in one forward, and the
output is token for token the step-by-step output (EngineConfig.grammar_fast_forward=False), in fewer steps.

On the tiny byte-level model every forced byte is a forced token, so forced runs are long; the
SmolLM2 checks at the end run a real tokenizer's multi-byte tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from test_engine_batching import clone

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import FinishReason, TokenizedRequest
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.speculative.params import SpeculativeParams


def _obj(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


ORDER = _obj({"customer_name": {"type": "string", "maxLength": 8},
              "shipping_status": {"enum": ["pending_payment", "shipped_to_customer", "delivered"]},
              "is_gift_wrapped": {"type": "boolean"},
              "quantity": {"type": "integer", "minimum": 0, "maximum": 99}})
CONSTRAINTS = {
    "json_schema": Constraint.json_schema(ORDER),
    "regex": Constraint.regex(r"(order|invoice)-number: [0-9]{2,3}, status: (open|closed|cancelled)"),
    "choice": Constraint.choice(["temperature_celsius", "temperature_fahrenheit", "pressure_kilopascal"]),
    "grammar": Constraint.grammar('root ::= "name=" [a-z]{1,6} "; role=" ("administrator" | "guest") ";"'),
}
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 1.0, "seed": 7, "n": 3, "top_p": 0.95},
    "logprobs": {"temperature": 0.8, "seed": 3, "logprobs": True, "top_logprobs": 2, "repetition_penalty": 1.2},
    "mirostat": {"temperature": 1.0, "seed": 11, "mirostat_mode": 2},
}


def request(rid: str, constraint: Constraint | None, prompt_seed: int, **sampling) -> TokenizedRequest:
    sampling.setdefault("max_tokens", 160)
    rng = random.Random(prompt_seed)
    prompt = [rng.randrange(256) for _ in range(rng.randint(3, 30))]
    return TokenizedRequest(rid, prompt, SamplingParams(constraint=constraint, **sampling))


def run_both(make_engine, reqs: list[TokenizedRequest], **config) -> tuple[list, list, LLMEngine, LLMEngine]:
    """The requests on an engine with fast-forward and on one without; completions and engines of each."""
    fast, plain = make_engine(**config), make_engine(grammar_fast_forward=False, **config)
    return (LLM(engine=fast).run([clone(r) for r in reqs]), LLM(engine=plain).run([clone(r) for r in reqs]),
            fast, plain)


def outcome(c) -> list[tuple]:
    """Everything a caller sees of a completion."""
    return [(ch.token_ids, ch.text, ch.finish_reason, ch.stop_reason, ch.logprobs) for ch in c.choices]


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_output_is_the_step_by_step_output_in_fewer_forwards(make_engine, kind, sampling):
    reqs = [request(f"{kind}-{i}", CONSTRAINTS[kind], i, **SAMPLING[sampling]) for i in range(3)]
    fast, plain, fast_engine, plain_engine = run_both(make_engine, reqs)
    for f, p in zip(fast, plain, strict=True):
        assert outcome(f) == outcome(p)
        assert all(ch.finish_reason == FinishReason.STOP for ch in f.choices)
    forced = fast_engine.stats()
    assert forced.grammar_ff_accepted_tokens > 0
    assert forced.num_steps < plain_engine.stats().num_steps
    assert plain_engine.stats().grammar_ff_draft_tokens == 0
    assert forced.spec_decode_num_draft_tokens == 0  # forced tokens are not speculative decoding's drafts


def test_a_choice_takes_a_step_per_token_the_model_chooses(make_engine):
    """Step by step, one forward per token; with fast-forward, "temperature_fahrenheit" takes three: the
    prompt's (it samples "t"), "emperature_" forced with "f" sampled after it, "ahrenheit" forced."""
    req = request("alone", CONSTRAINTS["choice"], 5, temperature=0.0)
    [fast], [plain], fast_engine, plain_engine = run_both(make_engine, [req])
    assert outcome(fast) == outcome(plain)
    assert fast.choices[0].text == "temperature_fahrenheit"
    assert plain_engine.stats().num_steps == len("temperature_fahrenheit")
    stats = fast_engine.stats()
    assert stats.num_steps == 3
    assert stats.grammar_ff_draft_tokens == stats.grammar_ff_accepted_tokens == len("emperature_ahrenheit")


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_max_tokens_cut_inside_a_forced_run(make_engine, kind):
    """Every length from 1 to past the output's: the last token may fall inside a forced run."""
    reqs = [request(f"{kind}-{m}", CONSTRAINTS[kind], 1, temperature=1.0, seed=2, max_tokens=m) for m in range(1, 40)]
    fast, plain, fast_engine, _ = run_both(make_engine, reqs)
    for r, f, p in zip(reqs, fast, plain, strict=True):
        assert outcome(f) == outcome(p)
        [choice] = f.choices
        assert len(choice.token_ids) <= r.sampling.max_tokens
        if choice.finish_reason == FinishReason.LENGTH:
            assert len(choice.token_ids) == r.sampling.max_tokens
    assert fast_engine.stats().grammar_ff_accepted_tokens > 0


@pytest.mark.parametrize("stop", [{"stop": ["status"]}, {"stop": ["_nam", "fahr"]},
                                  {"stop_token_ids": [ord("_")]}, {"stop": ["d\": ", "e="]}])
def test_stop_inside_a_forced_run(make_engine, stop):
    reqs = [request(f"{kind}-{i}", c, i, temperature=0.0 if i % 2 else 1.0, seed=i, **stop)
            for kind, c in CONSTRAINTS.items() for i in range(2)]
    fast, plain, fast_engine, _ = run_both(make_engine, reqs)
    assert fast_engine.stats().grammar_ff_accepted_tokens > 0
    stopped = 0
    for f, p in zip(fast, plain, strict=True):
        assert outcome(f) == outcome(p)
        stopped += f.choices[0].stop_reason is not None
    assert stopped >= 3  # the stops above fall inside forced runs of most of these outputs


def test_streamed_deltas_carry_the_forced_tokens_with_the_sampled_one(make_engine):
    """The text streamed step by step joins into the step-by-step text; a fast-forward step's delta holds
    the sampled token and the forced tokens after it."""
    req = request("stream", CONSTRAINTS["json_schema"], 4, temperature=1.0, seed=9)

    def streamed(engine: LLMEngine) -> list[tuple[str, list[int]]]:
        engine.add_request(clone(req))
        deltas = []
        while engine.has_unfinished():
            for out in engine.step():
                deltas += [(d.text, d.token_ids) for d in out.deltas]
        return deltas

    fast = streamed(make_engine())
    plain = streamed(make_engine(grammar_fast_forward=False))
    assert "".join(t for t, _ in fast) == "".join(t for t, _ in plain)
    assert [t for _, ids in fast for t in ids] == [t for _, ids in plain for t in ids]
    assert max(len(ids) for _, ids in plain) == 1
    assert max(len(ids) for _, ids in fast) > 5  # '"shipping_status": "' and the like come in one delta
    assert len(fast) < len(plain)


def test_preemption_and_chunked_steps_keep_the_output(make_engine):
    """A pool too small for every sequence preempts (drafts dropped, tokens recomputed) and a small step
    budget leaves drafts out of steps; the output stays the step-by-step one."""
    reqs = [request(f"p{i}", list(CONSTRAINTS.values())[i % 4], i, temperature=1.0, seed=i, n=2) for i in range(8)]
    fast, plain, fast_engine, _ = run_both(make_engine, reqs, max_kv_blocks=14, block_size=4,
                                           max_num_batched_tokens=24)
    assert [outcome(c) for c in fast] == [outcome(c) for c in plain]
    assert fast_engine.scheduler.counters.preemptions > 0
    assert fast_engine.stats().grammar_ff_accepted_tokens > 0


def test_forced_tokens_cached_as_prefix_serve_a_follow_up(make_engine):
    """Blocks full of forced tokens (their K/V computed with the token before them) go to the prefix
    cache; a follow-up whose prompt extends the first output reads them and decodes what an engine
    without prefix caching decodes."""
    first = request("turn1", CONSTRAINTS["json_schema"], 6, temperature=0.0)
    engine = make_engine(block_size=4)
    [done] = LLM(engine=engine).run([first])
    prompt = list(first.prompt_token_ids) + done.choices[0].token_ids + list(b"\nagain: ")
    follow = TokenizedRequest("turn2", prompt, replace(first.sampling))
    [cached] = LLM(engine=engine).run([follow])
    assert cached.stats.cached_prompt_tokens >= len(done.choices[0].token_ids) // 2
    [fresh] = LLM(engine=make_engine(block_size=4, enable_prefix_caching=False,
                                     grammar_fast_forward=False)).run([clone(follow)])
    assert outcome(cached) == outcome(fresh)


def test_speculative_neighbours_keep_their_drafts_and_the_constrained_rows_their_forced_tokens(make_engine):
    """n-gram speculation for unconstrained requests in the same batch as fast-forwarding constrained ones:
    each kind of draft is verified its own way and counted apart."""
    speculative = SpeculativeParams(num_speculative_tokens=3, prompt_lookup_min=1)
    repeat = list(b"abcabcabcabcabcabc")
    reqs = [request(f"c{i}", list(CONSTRAINTS.values())[i], i, temperature=0.0) for i in range(4)]
    reqs += [TokenizedRequest(f"u{i}", repeat + [i], SamplingParams(max_tokens=24, temperature=0.0))
             for i in range(3)]
    fast, plain, fast_engine, _ = run_both(make_engine, reqs, speculative=speculative)
    [alone] = [LLM(engine=make_engine(grammar_fast_forward=False)).run([clone(r)]) for r in reqs[4:5]]
    assert [outcome(c) for c in fast] == [outcome(c) for c in plain]
    assert outcome(fast[4]) == outcome(alone[0])
    stats = fast_engine.stats()
    assert stats.grammar_ff_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > 0
    assert all(c.stats.spec_draft_tokens == 0 for c in fast[:4])


# -- SmolLM2: a real tokenizer, JSON keys of several tokens -------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from protoserve.engine.loader.load import load_model

    return load_model(None, progress=False)


def test_smollm2_json_schema_outputs_equal_in_fewer_forwards(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"An order as JSON: {json.dumps(ORDER)}"}]))
    schema = Constraint.json_schema(ORDER)
    sampling = [SamplingParams(temperature=0.0, max_tokens=96, constraint=schema),
                SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=96, constraint=schema),
                SamplingParams(temperature=0.7, seed=1, logprobs=True, top_logprobs=2, max_tokens=25, constraint=schema)]
    reqs = [TokenizedRequest(f"s{i}", prompt, sp) for i, sp in enumerate(sampling)]
    runs = {}
    for ff in (True, False):
        engine = LLMEngine(smollm2, EngineConfig(grammar_fast_forward=ff, max_kv_blocks=256))
        runs[ff] = (LLM(engine=engine).run([clone(r) for r in reqs]), engine.stats())
    (fast, fast_stats), (plain, plain_stats) = runs[True], runs[False]
    assert [outcome(c) for c in fast] == [outcome(c) for c in plain]
    assert json.loads(fast[0].choices[0].text).keys() == ORDER["properties"].keys()
    assert fast_stats.grammar_ff_accepted_tokens > 20
    assert fast_stats.num_steps < plain_stats.num_steps * 0.7


# -- the GPU path: the Triton kernels, here under the CPU interpreter ----------------------------------


@pytest.mark.slow  # the Triton kernels under the CPU interpreter: make test, not make test-fast
def test_triton_path_gives_the_step_by_step_output(tiny_model_dir, monkeypatch):
    """On the device kernels the forced run's K/V come from a multi-token forward (its prefill attention,
    its matmuls over several rows) where step by step they came from one-token decodes: the tokens must
    not change."""
    from protoserve.engine.loader.load import load_model
    from protoserve.engine.models import device_ops
    from protoserve.kernels import triton as triton_kernels

    if not (triton_kernels.available() and triton_kernels.interpreting()):
        pytest.skip("the Triton interpreter is not set up (TRITON_INTERPRET=1 before triton is imported)")
    monkeypatch.setattr(device_ops, "TRITON_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    loaded = load_model(str(tiny_model_dir), dtype="float32", quantization="none", progress=False)
    assert loaded.model.fused_step is None  # the Triton kernels, not the C++ step
    reqs = [request(f"t{i}", c, i, temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=48)
            for i, c in enumerate(CONSTRAINTS.values())]
    runs = {}
    for ff in (True, False):
        engine = LLMEngine(loaded, EngineConfig(grammar_fast_forward=ff, max_kv_blocks=64, block_size=4))
        runs[ff] = (LLM(engine=engine).run([clone(r) for r in reqs]), engine.stats())
    assert [outcome(c) for c in runs[True][0]] == [outcome(c) for c in runs[False][0]]
    assert runs[True][1].grammar_ff_accepted_tokens > 0


def test_forced_tokens_never_crowd_a_running_sequence_out_of_a_step(make_engine):
    """Drafts fit in what the step's token budget leaves after every running sequence's own token: each
    decoding sequence advances every step, however long its neighbours' forced runs."""
    engine = make_engine(max_num_batched_tokens=10)
    for i in range(6):
        engine.add_request(request(f"b{i}", CONSTRAINTS["json_schema"], i, temperature=1.0, seed=i))
    while engine.has_unfinished():
        decoding = {s: s.num_tokens for s in engine.scheduler.running if s.num_uncomputed_tokens == 1}
        engine.step()
        assert all(s.is_finished or s.num_tokens > before for s, before in decoding.items())
    assert engine.stats().grammar_ff_accepted_tokens > 0
