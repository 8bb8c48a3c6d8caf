"""EngineStats: a snapshot of the engine's gauges and counters (vLLM's metric names where they exist)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """Taken after each step; frozen so another thread can read it while the next step runs.

    ``running``/``waiting`` count requests (not choices). ``kv_blocks_free`` includes
    cached blocks nobody references (they are evicted on demand), so
    ``kv_usage = 1 - free / total``. Prefix-cache counters are in tokens.
    """

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions_total: int = 0
    fair_preemptions_total: int = 0  # of those, made to admit a less-served caller's request
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    truncated_prompt_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_cancelled_total: int = 0
    num_steps: int = 0
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_time_s: float = 0.0
    # Speculative decoding (vLLM's vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # Grammar fast-forward (engine/sampling/constraints/fast_forward.py): forced tokens drafted, and kept.
    grammar_ff_draft_tokens: int = 0
    grammar_ff_accepted_tokens: int = 0
