"""Profile: the sizes of one benchmark run (default, --full, or --smoke).

The default run takes a few minutes on the 2-core machine; ``--full`` is the
thorough one (nano-vllm's 256-request offline shape, more requests per load
level, every variant in both engine modes); ``--smoke`` only checks the
harness end to end on a busy machine, and its numbers mean little.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.resources import Variant

FP32 = Variant("float32", "none")
BF16 = Variant("bfloat16", "none")
# Quantized weights with float32 K/V (the engine's auto would store them in bfloat16).
INT8 = Variant("float32", "int8", "float32")
INT4 = Variant("float32", "int4", "float32")
# The headline variant: int4 layers and bf16 K/V, as llama.cpp's Q4 figures run with f16 K/V.
INT4_KV_BF16 = Variant("float32", "int4", "bfloat16")


@dataclass(frozen=True)
class Profile:
    """Every size and list of variants a run uses."""

    name: str
    repeats: int  # single-stream decode and prefill: median of this many runs
    decode_prompt_len: int
    decode_tokens: int
    prefill_lengths: tuple[int, ...]
    offline_requests: int
    offline_prompt_len: tuple[int, int]  # uniform, inclusive
    offline_output_len: tuple[int, int]
    offline_hf_batch: int
    concurrencies: tuple[int, ...]
    serving_prompt_len: int
    serving_max_tokens: int
    requests_per_worker: int  # each load level sends concurrency * this many requests ...
    min_requests: int  # ... but at least this many, in each of serving_rounds rounds:
    # every path runs the level once per round, the paths in turn, and a figure pools its rounds
    serving_rounds: int
    level_max_seconds: float  # no new requests after this long at one level
    long_mix_concurrency: int
    long_mix_every: int  # every k-th request of the long-prompt mix ...
    long_prompt_len: int  # ... has a prompt this long
    long_mix_transformers: bool  # static batches padded to the long prompts are slow: --full only
    openai_concurrencies: tuple[int, ...]
    decode_variants: tuple[tuple[Variant, bool], ...]  # (variant, deterministic)
    offline_variants: tuple[tuple[Variant, bool], ...]
    prefill_variants: tuple[tuple[Variant, bool], ...]
    # The variant of the headline server figures (decode.grpc, prefill.grpc, serving.*) and of the
    # in-process engine they are compared with; int4 with bf16 K/V is what llama.cpp's Q4 figures (f16 K/V)
    # compare with.
    serving_variant: Variant
    server_variants: tuple[Variant, ...]  # other servers: single-stream decode and one load level
    server_variant_concurrency: int
    # Isolation: streams decoding while one huge prompt arrives (issue 21); each round is one run
    # without the prompt and one with it, in turn.
    isolation_streams: int = 4
    isolation_max_tokens: int = 64
    isolation_rounds: int = 3
    isolation_prompt_bytes: int = 20_000_000
    # Fairness (issue 42): tenant A's closed loop of long streams, tenant B's short request every second;
    # each load runs this long, and a loop's tokens count after the first fifth (its ramp).
    fairness_window_s: float = 30.0
    fairness_rounds: int = 2
    fairness_streams: int = 64
    fairness_long_tokens: int = 4000

    def level_requests(self, concurrency: int) -> int:
        return max(self.min_requests, concurrency * self.requests_per_worker)


def _both_modes(*variants: Variant) -> tuple[tuple[Variant, bool], ...]:
    return tuple((v, det) for v in variants for det in (True, False))


DEFAULT = Profile(
    name="default",
    repeats=3,
    decode_prompt_len=32,
    decode_tokens=128,
    prefill_lengths=(512, 2048),
    offline_requests=32,
    offline_prompt_len=(64, 512),
    offline_output_len=(32, 128),
    offline_hf_batch=16,
    concurrencies=(1, 4, 16, 64),
    serving_prompt_len=64,
    serving_max_tokens=64,
    requests_per_worker=2,
    min_requests=4,
    serving_rounds=2,
    level_max_seconds=60.0,
    long_mix_concurrency=16,
    long_mix_every=4,
    long_prompt_len=1024,
    long_mix_transformers=False,
    openai_concurrencies=(16,),
    decode_variants=(
        (FP32, True), (BF16, True), (INT8, True), (INT4, True), (INT4_KV_BF16, True), (INT4_KV_BF16, False)
    ),
    offline_variants=((FP32, True), (INT8, True), (INT4_KV_BF16, True)),
    prefill_variants=((FP32, True), (INT4_KV_BF16, True)),
    serving_variant=INT4_KV_BF16,
    server_variants=(FP32,),
    server_variant_concurrency=16,
)

FULL = Profile(
    name="full",
    repeats=5,
    decode_prompt_len=32,
    decode_tokens=512,
    prefill_lengths=(512, 2048),
    # nano-vllm's bench.py: 256 sequences, prompt and output lengths uniform from 100;
    # outputs capped at 512 (not 1024) so the transformers baseline ends in minutes.
    offline_requests=256,
    offline_prompt_len=(100, 1024),
    offline_output_len=(100, 512),
    offline_hf_batch=16,
    concurrencies=(1, 4, 16, 64),
    serving_prompt_len=64,
    serving_max_tokens=64,
    requests_per_worker=8,
    min_requests=16,
    serving_rounds=2,
    level_max_seconds=180.0,
    long_mix_concurrency=16,
    long_mix_every=4,
    long_prompt_len=1024,
    long_mix_transformers=True,
    openai_concurrencies=(1, 4, 16, 64),
    decode_variants=_both_modes(FP32, BF16, INT8, INT4, INT4_KV_BF16),
    offline_variants=_both_modes(FP32, BF16, INT8, INT4, INT4_KV_BF16),
    prefill_variants=_both_modes(FP32, BF16, INT8, INT4, INT4_KV_BF16),
    serving_variant=INT4_KV_BF16,
    server_variants=(FP32, BF16, INT8, INT4),
    server_variant_concurrency=16,
    fairness_window_s=60.0,
)

SMOKE = Profile(
    name="smoke",
    repeats=1,
    decode_prompt_len=16,
    decode_tokens=8,
    prefill_lengths=(128, 512),
    offline_requests=4,
    offline_prompt_len=(16, 64),
    offline_output_len=(4, 8),
    offline_hf_batch=16,
    concurrencies=(1, 4),
    serving_prompt_len=64,
    serving_max_tokens=8,
    requests_per_worker=1,
    min_requests=2,
    serving_rounds=1,
    level_max_seconds=60.0,
    long_mix_concurrency=4,
    long_mix_every=4,
    long_prompt_len=512,
    long_mix_transformers=False,
    openai_concurrencies=(4,),
    decode_variants=((FP32, True), (FP32, False)),
    offline_variants=((FP32, True),),
    prefill_variants=((FP32, True),),
    serving_variant=FP32,
    server_variants=(),
    server_variant_concurrency=4,
    isolation_max_tokens=16,
    isolation_rounds=1,
    fairness_window_s=5.0,
    fairness_rounds=1,
    fairness_streams=4,
    fairness_long_tokens=64,
)

PROFILES = {p.name: p for p in (DEFAULT, FULL, SMOKE)}
