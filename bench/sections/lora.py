"""LoRA: a batch spread over four adapters, as a share of the base model's speed at the same concurrency.

Engine-direct, the served variant. Four adapters of rank 16 on all seven projections, random
weights, are written in PEFT's format to a temporary directory and loaded into one engine
(``enable_lora(4)``: all four resident). Each round draws fresh prompts (unique nonces) and runs
them twice, all requests sent at once: once on the base model alone, once with request i under
adapter i mod 4, the two in alternating order (ABBA), so drift in the machine's load falls on both
alike. Requests are greedy with EOS ignored and a fixed ``max_tokens``, so both runs produce the
same tokens' worth of work; the prefix cache keys blocks by adapter, so neither run reuses the
other's prompt blocks. The figure is output tokens over wall time (first add to last finish),
pooled over the rounds; the ratio is what serving four adapters in one batch costs: the low-rank
products inside the fused step (kernels/cpu/lora.cpp) and the barriers around them.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.context import BenchContext
from bench.engine_direct import run_tokenized
from bench.figures import Figure, Target
from bench.resources import EngineModel
from bench.runner import Step
from bench.stats import significant
from bench.timeline import RequestTimeline

SECTION = "lora"
WORKLOAD = 13
PROMPT_LEN = 64
ADAPTERS = 4
RANK = 16
RATIO_TARGET = Target(0.8, "higher")  # the issue's: four adapters in one batch keep 80% of the base speed
_ids = itertools.count()


@dataclass(frozen=True)
class Sizes:
    max_tokens: int
    rounds: int
    concurrency: int = 16


SIZES = {"smoke": Sizes(8, 1, 4), "default": Sizes(64, 4), "full": Sizes(128, 6)}


def write_random_adapter(path: Path, config: Any, rank: int, seed: int) -> Path:
    """A PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for a base model of
    ``config`` at ``path``: rank ``rank`` on all seven projections, seeded random A and B.

    A's rows have unit expected norm on unit inputs and B is small, so the adapter changes the
    model's output without driving its activations out of range; the speed does not depend on it.
    """
    import torch
    from safetensors.torch import save_file

    from protoserve.engine.runtime import (
        ADAPTER_CONFIG_FILE,
        ADAPTER_WEIGHTS_FILE,
        LORA_PROJECTIONS,
        adapter_tensor_name,
        lora_projection_shapes,
    )

    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for proj, (out_f, in_f) in lora_projection_shapes(config).items():
            tensors[adapter_tensor_name(layer, proj, "A")] = torch.randn(rank, in_f, generator=g) / in_f**0.5
            tensors[adapter_tensor_name(layer, proj, "B")] = torch.randn(out_f, rank, generator=g) * 0.02
    save_file(tensors, path / ADAPTER_WEIGHTS_FILE)
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_PROJECTIONS),
           "bias": "none", "lora_dropout": 0.0}
    (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(cfg))
    return path


def spread(count: int, names: list[str]) -> list[str]:
    """Request i's adapter: the names in turn, so each adapter gets an equal share of the batch."""
    return [names[i % len(names)] for i in range(count)]


def _requests(prompts: list[tuple[int, ...]], max_tokens: int, adapters: list[str | None]) -> list[Any]:
    from protoserve.engine.api import SamplingParams, TokenizedRequest

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [TokenizedRequest(f"lora-{next(_ids)}", list(p), sp, adapter=a)
            for p, a in zip(prompts, adapters, strict=True)]


@dataclass
class Pooled:
    """Output tokens and wall seconds summed over rounds, for one path; each round's rate kept."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: list[float] = field(default_factory=list)  # each round's tok/s

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, timelines: list[RequestTimeline]) -> None:
        tokens = sum(t.output_tokens for t in timelines)
        seconds = max(t.finished for t in timelines) - min(t.sent for t in timelines)
        self.tokens += tokens
        self.seconds += seconds
        self.rounds.append(tokens / seconds)


def _measure(
    engine: Any, factory: Any, sizes: Sizes, adapters: dict[bool, list[str | None]]
) -> dict[bool, Pooled]:
    """ABBA rounds of the base path (False) and the mixed path (True) on the same fresh prompts."""
    c = sizes.concurrency
    for mixed in (False, True):  # first calls of each path's kernel shapes, unmeasured
        run_tokenized(engine, _requests([factory.prompt(PROMPT_LEN) for _ in range(c)], 8, adapters[mixed]))
    pools = {False: Pooled(), True: Pooled()}
    for round_ in range(sizes.rounds):
        prompts = [factory.prompt(PROMPT_LEN) for _ in range(c)]
        for mixed in (False, True) if round_ % 2 == 0 else (True, False):
            timelines = run_tokenized(engine, _requests(prompts, sizes.max_tokens, adapters[mixed]))
            if any(t.output_tokens != sizes.max_tokens for t in timelines):
                raise RuntimeError("a request generated other than max_tokens tokens with EOS ignored")
            pools[mixed].add(timelines)
    return pools


def _speed_step(ctx: BenchContext, sizes: Sizes) -> Step:
    variant = ctx.profile.serving_variant
    c = sizes.concurrency
    base_name, mixed_name = f"{SECTION}.engine.base.c{c}", f"{SECTION}.engine.mixed{ADAPTERS}.c{c}"
    ratio_name = f"{SECTION}.ratio.c{c}"

    def run(loaded: Any) -> list[Figure]:
        from bench import engine_direct

        engine = engine_direct.make_engine(loaded, variant, deterministic=True)
        names = [f"bench-lora-{i}" for i in range(ADAPTERS)]
        try:
            with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
                stack = engine.enable_lora(ADAPTERS)
                for i, name in enumerate(names):
                    stack.load(name, write_random_adapter(Path(tmp) / name, loaded.config, RANK, seed=i))
                paths = {False: [None] * c, True: spread(c, names)}
                pools = _measure(engine, ctx.factory(WORKLOAD), sizes, paths)
        finally:
            loaded.model.adapters = None  # the loaded model outlives this engine: later steps run it plain
        base, mixed = pools[False], pools[True]
        details = {"requests": c * sizes.rounds, "rounds": sizes.rounds, "max_tokens": sizes.max_tokens,
                   "prompt_len": PROMPT_LEN}
        return [
            Figure(base_name, base.rate, "tok/s", SECTION,
                   details={**details, "rounds_tok_s": [significant(r) for r in base.rounds]},
                   note=f"no adapter, greedy, {variant.label}"),
            Figure(mixed_name, mixed.rate, "tok/s", SECTION,
                   details={**details, "adapters": ADAPTERS, "rank": RANK,
                            "rounds_tok_s": [significant(r) for r in mixed.rounds]},
                   note=f"same prompts, request i under adapter i mod {ADAPTERS}"),
            Figure(ratio_name, mixed.rate / base.rate, "ratio", SECTION, target=RATIO_TARGET,
                   details={"mixed_tok_s": significant(mixed.rate), "base_tok_s": significant(base.rate)}),
        ]

    expects = ((base_name, "tok/s"), (mixed_name, "tok/s"), (ratio_name, "ratio"))
    description = f"{ADAPTERS}-adapter mixed batch vs base, engine-direct"
    return Step(SECTION, EngineModel(variant), description, run, expects)


def steps(ctx: BenchContext) -> list[Step]:
    return [_speed_step(ctx, SIZES.get(ctx.profile.name, SIZES["default"]))]
