"""Draft-model speculation on the real SmolLM2-135M: its int4 weights draft for its float32 self."""

from __future__ import annotations

import pytest

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.speculative.params import SpeculativeParams


@pytest.fixture(scope="module")
def smollm2_pair():
    from protoserve.engine.loader.load import load_model

    target = load_model(None, progress=False)
    draft = load_model(None, quantization="int4", progress=False, load_tokenizer=False)
    return target, draft


@pytest.mark.slow
def test_int4_draft_same_tokens_high_acceptance(smollm2_pair):
    target, draft = smollm2_pair
    ids = target.tokenizer.encode("<|im_start|>user\nWrite a short story about a dragon who learns to paint."
                                  "<|im_end|>\n<|im_start|>assistant\n")
    req = TokenizedRequest("story", ids, SamplingParams(max_tokens=40, temperature=0.0))
    [want] = LLM(engine=LLMEngine(target, EngineConfig(max_kv_blocks=128))).run([req])
    engine = LLMEngine(target, EngineConfig(max_kv_blocks=128))
    engine.enable_draft_model(draft)
    spec = SamplingParams(max_tokens=40, temperature=0.0,
                          speculative=SpeculativeParams(method="draft", num_speculative_tokens=4))
    [got] = LLM(engine=engine).run([TokenizedRequest("story-spec", ids, spec)])
    assert got.choices[0].token_ids == want.choices[0].token_ids
    s = got.stats
    rate = s.spec_accepted_tokens / s.spec_draft_tokens
    print(f"int4 draft for float32 SmolLM2: acceptance {rate:.2f} ({s.spec_accepted_tokens}/{s.spec_draft_tokens}), "
          f"{s.spec_num_drafts} verifications for {s.generated_tokens} tokens")
    # The same weights at two precisions agree on almost every greedy token; a draft cache that
    # kept stale K/V after a rejection would not.
    assert rate > 0.8
