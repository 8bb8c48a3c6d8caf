"""N-gram speculation on the real SmolLM2-135M: a copy-heavy prompt decodes to the same tokens, faster."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.speculative.params import SpeculativeParams

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clockwork, "
           "trimmed the wick, and polished the great lens until it shone. Ships passing the rocky point "
           "relied on its beam to find the safe channel into the harbour.")


@pytest.fixture(scope="module")
def smollm2():
    from protoserve.engine.loader.load import load_model

    return load_model(None, progress=False)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def run(loaded, requests: list[TokenizedRequest], speculative: SpeculativeParams | None):
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=256, speculative=speculative))
    start = time.perf_counter()
    done = LLM(engine=engine).run([replace(r, sampling=replace(r.sampling)) for r in requests])
    return done, time.perf_counter() - start, engine


@pytest.mark.slow
def test_copy_heavy_prompt_same_tokens_with_ngram_drafts(smollm2):
    copy = TokenizedRequest("copy", chat(smollm2.tokenizer, f"{PASSAGE}\nRepeat the passage exactly."),
                            SamplingParams(max_tokens=48, temperature=0.0, logprobs=True))
    # A plain neighbour that opts out of the engine default, and a seeded sampled one that opts in.
    plain = TokenizedRequest("plain", chat(smollm2.tokenizer, "Name three colours."),
                             SamplingParams(max_tokens=16, temperature=0.0,
                                            speculative=SpeculativeParams(method="off")))
    sampled = TokenizedRequest("sampled", chat(smollm2.tokenizer, f"{PASSAGE}\nSummarise the passage."),
                               SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=7))
    reqs = [copy, plain, sampled]
    want, t_off, _ = run(smollm2, reqs, None)
    got, t_on, engine = run(smollm2, reqs, SpeculativeParams(num_speculative_tokens=4))
    for w, g in zip(want, got, strict=True):
        assert g.choices[0].token_ids == w.choices[0].token_ids, g.request_id
        assert g.choices[0].logprobs == w.choices[0].logprobs, g.request_id
    s = got[0].stats
    assert got[1].stats.spec_draft_tokens == 0  # opted out
    rate = s.spec_accepted_tokens / s.spec_draft_tokens
    print(f"copy-heavy: acceptance {rate:.2f} ({s.spec_accepted_tokens}/{s.spec_draft_tokens}), "
          f"{s.spec_num_drafts} verifications for {s.generated_tokens} tokens; batch {t_off:.2f}s -> {t_on:.2f}s")
    assert rate > 0.5
    assert s.spec_num_drafts < s.generated_tokens / 2
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
