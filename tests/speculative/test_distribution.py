"""Sampled output keeps the target distribution under speculation (chi-square, tiny model).

Two independent samples of the first three tokens of one prompt, one decoded with
drafts and one without, each from its own seeds; a chi-square test of homogeneity
must not reject at significance 0.001. Drafts are the greedy continuation and the
target samples at temperature 0.6 with top_k 6, so drafts are accepted about a fifth of
the time. A verifier that redraws from the full p after a rejection (biased towards the
draft) gives p < 1e-4 here.
"""

from __future__ import annotations

from collections import Counter

from scipy.stats import chi2_contingency

from protoserve.engine.config import EngineConfig
from protoserve.engine.llm import LLM
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.request import TokenizedRequest
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.engine.speculative.params import SpeculativeParams

DRAWS = 2500
SIGNIFICANCE = 0.001
PROMPT = list(b"distribution")


class FixedDrafts:
    """Drafts the same continuation for every sequence, whatever it sampled so far."""

    def __init__(self, continuation: list[int]) -> None:
        self.continuation = continuation

    def propose(self, seq: Sequence, params: SpeculativeParams, max_drafts: int) -> list[int]:
        start = seq.num_generated
        return self.continuation[start : start + min(params.num_speculative_tokens, max_drafts)]


def sample_prefixes(loaded, seeds: range, speculative: SpeculativeParams | None, proposer=None):
    engine = LLMEngine(loaded, EngineConfig(max_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=1024,
                                               max_queue=DRAWS))
    if proposer is not None:
        engine.speculator.proposer = proposer
    sp = dict(max_tokens=3, temperature=0.6, top_k=6, speculative=speculative)
    done = LLM(engine=engine).run([TokenizedRequest(f"d{s}", PROMPT, SamplingParams(seed=s, **sp)) for s in seeds])
    return Counter(tuple(c.choices[0].token_ids) for c in done), engine.stats()


def test_sampled_tokens_keep_the_target_distribution(spec_tiny_loaded):
    greedy = LLM(engine=LLMEngine(spec_tiny_loaded, EngineConfig(max_kv_blocks=64))).run(
        [TokenizedRequest("g", PROMPT, SamplingParams(max_tokens=3, temperature=0.0))])[0].choices[0].token_ids
    plain, _ = sample_prefixes(spec_tiny_loaded, range(DRAWS), None)
    spec, stats = sample_prefixes(spec_tiny_loaded, range(DRAWS, 2 * DRAWS),
                                  SpeculativeParams(num_speculative_tokens=2), FixedDrafts(greedy))
    rate = stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens
    assert 0.05 < rate < 0.95, f"acceptance {rate:.2f}: both outcomes must be common for the test to mean much"
    # Outcomes seen at least 10 times in both samples together; the rest pooled into one cell.
    common = sorted(k for k in plain.keys() | spec.keys() if plain[k] + spec[k] >= 10)
    table = [[c[k] for k in common] + [sum(c.values()) - sum(c[k] for k in common)] for c in (plain, spec)]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 5, f"too few outcomes for a test: {table}"
    _, p_value, dof, _ = chi2_contingency(table)
    print(f"acceptance {rate:.3f}, {len(table[0])} cells, dof {dof}, p = {p_value:.4f}")
    assert p_value > SIGNIFICANCE, f"speculation changed the distribution (p = {p_value:.2e}): {table}"
