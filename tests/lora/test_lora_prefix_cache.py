"""The prefix cache keys blocks by adapter: a prompt's K/V computed under adapter A never serves the
same prompt under adapter B or the base model, while the same adapter still hits the cache.

The check is on logprobs (the logits of every generated position): a request that wrongly reused
another adapter's blocks would read K/V computed with other weights and get other logits.
"""

from __future__ import annotations

from lora_helpers import prompts

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.loader.load import load_model
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True)


def _engine(loaded, make_adapter) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=256, block_size=4, enable_prefix_caching=True))
    stack = engine.enable_lora(2)
    stack.load("a", make_adapter("llama", seed=21)[0])
    stack.load("b", make_adapter("llama", ["q_proj", "k_proj", "v_proj"], seed=22)[0])
    return engine


def _run(engine: LLMEngine, rid: str, prompt: list[int], adapter: str | None) -> tuple[list[float], int]:
    """(logprob of each generated token, cached prompt tokens) of one request run to the end alone."""
    engine.add_request(TokenizedRequest(rid, prompt, SP, adapter=adapter))
    logprobs, cached = [], -1
    while engine.has_unfinished():
        for out in engine.step():
            for d in out.deltas:
                logprobs.extend(p.chosen.logprob for p in d.logprobs)
            if out.finished:
                cached = out.stats.cached_prompt_tokens
    return logprobs, cached


def test_blocks_never_shared_across_adapters(tiny_family, make_adapter) -> None:
    loaded = load_model(tiny_family("llama")[0], progress=False)
    prompt = prompts(lens=(24,))[0]
    fresh = {name: _run(_engine(loaded, make_adapter), "x", prompt, name)[0] for name in (None, "a", "b")}
    assert len({tuple(v) for v in fresh.values()}) == 3  # the three really compute different logits

    engine = _engine(loaded, make_adapter)
    for i, name in enumerate([None, "a", "b", "a", None, "b"]):
        got, cached = _run(engine, f"r{i}", prompt, name)
        assert got == fresh[name], f"request {i} under {name!r} reused another adapter's K/V"
        assert cached == (0 if i < 3 else 20), (i, name, cached)  # same adapter again: 5 full blocks hit


def test_salt_mixes_name_and_content(tiny_family, make_adapter) -> None:
    loaded = load_model(tiny_family("llama")[0], progress=False)
    stack = _engine(loaded, make_adapter).adapters
    salts = {stack.cache_salt(b"user", n) for n in ("a", "b")} | {stack.cache_salt(b"user", None),
                                                                   stack.cache_salt(b"other", "a")}
    assert len(salts) == 4
    stack.unload("a")
    stack.load("a", make_adapter("llama", seed=23)[0])  # same name, other weights: other blocks
    assert stack.cache_salt(b"user", "a") not in salts
