"""What the family tests share: their tiny checkpoints built once per module, transformers' logits beside
ours, and one mixed continuous batch through LLMEngine.

The checkpoints themselves are written by ``bench.tiny_checkpoints`` (the families bench section
writes its own the same way); each family module says which config (family_checkpoints.py,
dense_family_checkpoints.py, test_deepseek_family.py).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from bench.tiny_checkpoints import EOS, hf_logits

if TYPE_CHECKING:
    from protoserve.engine.llm_engine import LLMEngine

Built = tuple[Path, nn.Module]


def checkpoint_cache(tmp_path_factory, make: Callable[[str, Path], nn.Module | None],
                     prefix: str = "") -> Callable[[str], Built]:
    """``get(name)`` -> (directory, transformers model), ``make(name, directory)`` run once per name (a
    ``make`` that returns no model leaves None beside the directory)."""
    built: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in built:
            directory = tmp_path_factory.mktemp(f"{prefix}{name}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built[name] = (directory, make(name, directory))
        return built[name]

    return get


def logit_diffs(hf: nn.Module, prompts: list[list[int]], ours: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per prompt, each position's largest |logit difference| from transformers'."""
    out = []
    for prompt, logits in zip(prompts, ours, strict=True):
        ref = hf_logits(hf, prompt)
        assert ref.abs().max() > 1.0  # weights scaled so the comparison is not between near-zeros
        out.append((logits - ref).abs().amax(-1))
    return out


def worst_diff(hf: nn.Module, prompts: list[list[int]], ours: list[torch.Tensor]) -> float:
    """The largest |logit difference| from transformers' over every position of every prompt."""
    return max(d.max().item() for d in logit_diffs(hf, prompts, ours))


def mixed_batch(path: Path, prompts: list[list[int]], greedy: int, sampled: int = 5, sampled_len: int = 40,
                sampled_tokens: int = 20) -> tuple[LLMEngine, dict[str, list[int]]]:
    """``prompts`` greedy (``greedy`` tokens each, ids ``greedy-i``) among ``sampled`` seeded sampling
    requests of random lengths, through one LLMEngine whose small step budget chunks the prefills beside
    the decodes; returns the engine and each request's tokens."""
    from protoserve.engine.config import EngineConfig
    from protoserve.engine.llm import LLM
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.loader.load import load_model
    from protoserve.engine.request import TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams

    engine = LLMEngine(load_model(path, progress=False),
                       EngineConfig(max_kv_blocks=256, block_size=4, max_num_batched_tokens=24))
    rng = random.Random(5)
    requests = [TokenizedRequest(f"greedy-{i}", p, SamplingParams(max_tokens=greedy, temperature=0.0,
                                                                    ignore_eos=True))
                for i, p in enumerate(prompts)]
    for i in range(sampled):
        prompt = [rng.randrange(EOS) for _ in range(rng.randint(3, sampled_len))]
        sampling = SamplingParams(max_tokens=rng.randint(4, sampled_tokens), temperature=0.9, seed=i,
                                  ignore_eos=True)
        requests.insert(2 * i % (len(requests) + 1), TokenizedRequest(f"sampled-{i}", prompt, sampling))
    done = LLM(engine=engine).run(requests)
    return engine, {c.request_id: c.choices[0].token_ids for c in done}
