"""Async scheduling (engine/execution/async_step.py): the same tokens, text and finish reasons with and without
overlapped steps, over a mixed run — greedy and seeded rows, requests ending by max_tokens, a stop token and
a stop string at different steps, a cancel mid-run, arrivals while others run, and a penalized request that
the overlap cannot serve (its steps fall back to plain) — and the setting's defaults and refusals.

Both engines sample on the batched sampler, as a device engine does; the engine's step logic is the same
on every device, and tests/models/test_device_path.py covers the Triton path.
"""

from __future__ import annotations

import pytest

from protoserve.engine.config import EngineConfig
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams

PROMPTS = {name: [(7 * i + 13 * k) % 200 + 3 for i in range(5 + k)] for k, name in enumerate(
    ["greedy", "seeded", "topk", "short", "stop-token", "stop-string", "cancel", "late-1", "late-2", "penalized"])}


def _params(stop_token: int | None, stop_text: str | None) -> dict[str, SamplingParams]:
    return {
        "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=16, temperature=0.9, seed=7, ignore_eos=True),
        "topk": SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=3),
        "short": SamplingParams(max_tokens=3, temperature=0.0),
        "stop-token": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                     stop_token_ids=[stop_token] if stop_token is not None else []),
        "stop-string": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                      stop=[stop_text] if stop_text else []),
        "cancel": SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
        "late-1": SamplingParams(max_tokens=8, temperature=0.7, seed=11, ignore_eos=True),
        "late-2": SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        "penalized": SamplingParams(max_tokens=5, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
    }


def _request(name: str, params: dict[str, SamplingParams]) -> TokenizedRequest:
    prompt = PROMPTS["greedy"] if name in ("stop-token", "stop-string") else PROMPTS[name]
    return TokenizedRequest(request_id=name, prompt_token_ids=list(prompt), sampling=params[name])


def run(make_engine, overlap: bool, stop_token: int | None = None, stop_text: str | None = None):
    """Each request's (tokens, text, finish reason); arrivals and the cancel keyed on tokens received."""
    engine = make_engine(async_scheduling=overlap, max_num_seqs=8)
    engine.sampler.batch_rows = True  # the batched sampler, as on a device, in both runs
    assert (engine.overlap is not None) is overlap
    params = _params(stop_token, stop_text)
    for name in ("greedy", "seeded", "topk", "short", "stop-token", "stop-string", "cancel"):
        engine.add_request(_request(name, params))
    got: dict[str, list] = {}
    arrivals = {"late-1": ("greedy", 3), "late-2": ("greedy", 9), "penalized": ("greedy", 14)}
    while engine.has_unfinished() or arrivals:
        for out in engine.step():
            tokens, text, reason = got.setdefault(out.request_id, [[], "", None])
            got[out.request_id] = [tokens + [t for d in out.deltas for t in d.token_ids],
                                   text + "".join(d.text for d in out.deltas),
                                   next((d.finish_reason for d in out.deltas if d.finish_reason), reason)]
        for name, (after, count) in list(arrivals.items()):
            if len(got.get(after, [[]])[0]) >= count or not engine.has_unfinished():
                engine.add_request(_request(name, params))
                del arrivals[name]
        if len(got.get("cancel", [[]])[0]) >= 4:
            engine.abort("cancel")
    return {name: tuple(v) for name, v in got.items()}, engine


def test_overlapped_steps_give_the_plain_steps_tokens(make_engine) -> None:
    reference, _ = run(make_engine, overlap=False)
    greedy = reference["greedy"][0]
    stop_token = greedy[6]
    stop_text = reference["greedy"][1][4:6]
    plain, plain_engine = run(make_engine, False, stop_token, stop_text)
    overlapped, engine = run(make_engine, True, stop_token, stop_text)
    assert overlapped == plain
    # The run really mixes what it claims: stops at different steps, a cancel, both kinds of step.
    assert len(plain["stop-token"][0]) <= 7 and plain["stop-token"][2].name == "STOP"
    assert plain["stop-string"][2].name == "STOP" and len(plain["stop-string"][0]) < 24
    assert plain["short"][2].name in ("LENGTH", "STOP") and len(plain["short"][0]) <= 3
    assert plain["cancel"][2].name == "CANCELLED" and len(plain["cancel"][0]) >= 4
    assert len(plain["late-1"][0]) == 8 and len(plain["penalized"][0]) == 5
    assert engine.overlap.num_overlapped > 10 and engine.overlap.num_plain > 0
    assert engine.overlap.pending is None and not engine.has_unfinished()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.generation_tokens_total == plain_engine.stats().generation_tokens_total


def test_async_scheduling_defaults_to_the_device_and_refuses_tensor_parallel() -> None:
    assert EngineConfig().overlaps_steps() is False
    assert EngineConfig(device="cuda").overlaps_steps() is True
    assert EngineConfig(device="cuda", async_scheduling=False).overlaps_steps() is False
    assert EngineConfig(device="cuda", tensor_parallel_size=2).overlaps_steps() is False
    assert EngineConfig(async_scheduling=True).overlaps_steps() is True
    with pytest.raises(ValueError, match="async_scheduling is not served with tensor_parallel_size > 1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2).validate()
