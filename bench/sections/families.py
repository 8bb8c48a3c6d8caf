"""Families: Gemma 2, Phi-3 and DeepSeek-V3 on tiny random checkpoints, a correctness smoke.

Each family's checkpoint is written here with transformers' own classes (bench/tiny_checkpoints.py,
as the model tests write theirs): Gemma 2 with soft-capping and alternating local/global layers,
Phi-3 with fused projections, longrope and a window, DeepSeek-V3 with multi-head latent attention
and MoE (shared experts, group-limited routing, yarn rope). The engine serves it in this process
(LLMEngine stepped, one greedy request, EOS ignored) and reports prefill tok/s (the prompt over its
time to first token) and decode tok/s (after the first token), labelled smoke: random tiny models
say nothing of speed on real ones, so these figures carry no target and no claim.

What the section checks is correctness: the engine's greedy tokens identical to transformers', and
the largest |logit difference| from transformers over the prompt and the generated tokens (float32,
one forward each). ``families.<name>.correct`` is 1 (pass) or 0 (fail), held to a target of 1; its
details carry the error and whether the tokens matched.

Phi-3's prompts are longer than its original context (48), so transformers rotates by the long
factors, as the engine does for its default context. The step hangs on the default engine model
only because every step needs a resource; it does not touch it.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.context import BenchContext
from bench.figures import Figure, Target
from bench.resources import EngineModel
from bench.runner import Step
from bench.timeline import RequestTimeline
from bench.tiny_checkpoints import (
    TINY,
    hf_greedy,
    hf_logits,
    random_model,
    random_prompts,
    save_checkpoint,
)

SECTION = "families"
FAMILIES = ("gemma2", "phi3", "deepseek_v3")
MAX_LOGIT_ERROR = 1e-4  # float32 against transformers, as the model tests hold every family
CORRECT_TARGET = Target(1.0, "higher")
SMOKE_NOTE = "smoke: a tiny random model, no speed claim"


@dataclass(frozen=True)
class Sizes:
    prompt_len: int  # past Phi-3's original context (48)
    decode_tokens: int


SIZES = {"smoke": Sizes(56, 8), "default": Sizes(128, 32), "full": Sizes(256, 64)}


def hf_config(family: str) -> Any:
    """The tiny transformers config of ``family``."""
    from transformers import DeepseekV3Config, Gemma2Config, Phi3Config

    if family == "gemma2":
        return Gemma2Config(**TINY, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                            attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                            hidden_activation="gelu_pytorch_tanh")
    if family == "phi3":
        longrope = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                    "long_factor": [1.0 + 0.6 * i for i in range(8)]}
        return Phi3Config(**TINY, num_hidden_layers=2, original_max_position_embeddings=48, rms_norm_eps=1e-5,
                          rope_scaling=longrope, sliding_window=24)
    if family == "deepseek_v3":
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
        return DeepseekV3Config(**{**TINY, "num_key_value_heads": 4}, num_hidden_layers=2, kv_lora_rank=32,
                                q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                                moe_intermediate_size=32, first_k_dense_replace=1, n_shared_experts=1,
                                routed_scaling_factor=2.5, rope_parameters=yarn)
    raise ValueError(family)


@dataclass(frozen=True)
class FamilyResult:
    prefill_tok_s: float
    decode_tok_s: float
    greedy_equal: bool
    max_logit_error: float

    @property
    def correct(self) -> bool:
        return self.greedy_equal and self.max_logit_error < MAX_LOGIT_ERROR


def serve_greedy(engine: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], RequestTimeline]:
    """One greedy request (EOS ignored) stepped to its end: its tokens and when they came."""
    from protoserve.engine.api import SamplingParams, TokenizedRequest

    timeline = RequestTimeline(sent=time.perf_counter(), prompt_tokens=len(prompt))
    engine.add_request(TokenizedRequest(f"{SECTION}-smoke", prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            new = [t for delta in out.deltas for t in delta.token_ids]
            tokens.extend(new)
            timeline.add_chunk(time.perf_counter(), len(new))
    timeline.finish(time.perf_counter())
    return tokens, timeline


def measure(family: str, sizes: Sizes, directory: Path) -> FamilyResult:
    """Write ``family``'s checkpoint under ``directory``, serve one greedy request of it, and hold the
    result to transformers."""
    import torch

    from protoserve.engine.api import EngineConfig
    from protoserve.engine.runtime import LLMEngine, all_position_logits, load_model

    hf = save_checkpoint(random_model(hf_config(family), norm_center=0.0 if family == "gemma2" else 1.0), directory)
    loaded = load_model(directory, progress=False)
    [prompt] = random_prompts((sizes.prompt_len,), seed=7)
    tokens, timeline = serve_greedy(LLMEngine(loaded, EngineConfig()), prompt, sizes.decode_tokens)
    decode = timeline.decode_tokens_per_s()
    if timeline.ttft is None or decode is None:
        raise RuntimeError(f"{family}: the request produced {len(tokens)} tokens")
    with torch.inference_mode():
        ours = all_position_logits(loaded.model, prompt + tokens)
    error = (ours - hf_logits(hf, prompt + tokens)).abs().max().item()
    return FamilyResult(sizes.prompt_len / timeline.ttft, decode,
                        tokens == hf_greedy(hf, prompt, sizes.decode_tokens), error)


def figures(family: str, result: FamilyResult, sizes: Sizes) -> list[Figure]:
    shape = {"prompt_len": sizes.prompt_len, "decode_tokens": sizes.decode_tokens}
    return [
        Figure(f"{SECTION}.{family}.prefill", result.prefill_tok_s, "tok/s", SECTION, details=shape,
               note=SMOKE_NOTE),
        Figure(f"{SECTION}.{family}.decode", result.decode_tok_s, "tok/s", SECTION, details=shape,
               note=SMOKE_NOTE),
        Figure(f"{SECTION}.{family}.correct", 1.0 if result.correct else 0.0, "pass", SECTION,
               target=CORRECT_TARGET,
               details={"greedy_tokens_equal": result.greedy_equal,
                        "max_logit_error": float(f"{result.max_logit_error:.3g}"), **shape},
               note=f"greedy tokens and logits within {MAX_LOGIT_ERROR:g} of transformers"),
    ]


def _step(family: str, sizes: Sizes) -> Step:
    def run(_loaded: Any) -> list[Figure]:
        with tempfile.TemporaryDirectory(prefix=f"bench-{family}-") as directory:
            return figures(family, measure(family, sizes, Path(directory)), sizes)

    expects = tuple((f"{SECTION}.{family}.{what}", unit)
                    for what, unit in (("prefill", "tok/s"), ("decode", "tok/s"), ("correct", "pass")))
    return Step(SECTION, EngineModel(), f"tiny random {family}: correctness smoke against transformers", run,
                expects)


def steps(ctx: BenchContext) -> list[Step]:
    sizes = SIZES.get(ctx.profile.name, SIZES["default"])
    return [_step(family, sizes) for family in FAMILIES]
