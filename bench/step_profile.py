"""Step-level timing of the fused C++ decoder step: median wall time of decode steps at a batch size.

Engine-direct on the served variant (int4 layers, int8 head, bf16 K/V, deterministic mode): ``rows``
sequences with ``context``-token prompts are prefilled, then each decode step's FusedStep call is
timed alone (no sampler, no scheduler). ``--phases`` also splits those steps' time by phase of the
layer loop (kernels/cpu/step_phases.py). Usage:

    python -m bench.step_profile --rows 16 64 --context 128 --steps 30 [--phases] [--kv-cache-dtype int8]
        [--shared-prefix 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def time_decode_steps(engine, rows: int, context: int, steps: int, phases: dict[str, float] | None = None,
                      shared_prefix: int = 0) -> list[float]:
    """Seconds per FusedStep call over ``steps`` decode steps of ``rows`` sequences; ``phases``, when
    given, gets those steps' seconds per phase added to it. ``shared_prefix``: the prompts' first tokens
    are the same (a system prompt), cached by the first sequence for the others."""
    from protoserve.engine.api import SamplingParams, TokenizedRequest
    from protoserve.engine.runtime import timed_fused_steps

    with timed_fused_steps(phases=phases is not None) as calls:
        gen = torch.Generator().manual_seed(rows)
        ids = []
        # Enough new tokens that every sequence is still decoding once the last prompt is in.
        budget = steps + rows * context // 64 + 8
        prefix = torch.randint(100, 40000, (shared_prefix,), generator=gen).tolist()
        for i in range(rows):
            prompt = prefix + torch.randint(100, 40000, (context - shared_prefix,), generator=gen).tolist()
            ids.append(f"profile-{rows}-{i}-{time.monotonic_ns()}")
            engine.add_request(
                TokenizedRequest(
                    request_id=ids[-1],
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True),
                )
            )
            if i == 0 and shared_prefix:  # the prefix in the cache before the others arrive
                while engine.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
                    engine.step()
        while engine.has_unfinished() and sum(c.num_tokens == rows for c in calls) <= steps:
            engine.step()
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    decode = [c for c in calls if c.num_tokens == rows][1:]  # one token per sequence; the first dropped
    for call in decode if phases is not None else ():
        for name, seconds in call.phases.items():
            phases[name] = phases.get(name, 0.0) + seconds
    time_decode_steps.mean_context = sum(c.mean_seq_len for c in decode) / max(1, len(decode))
    return [c.seconds for c in decode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--precision", choices=("exact", "fast"), default="exact")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=None, help="K/V cache block size [the engine's]")
    parser.add_argument("--phases", action="store_true", help="also split the decode steps' time by phase")
    parser.add_argument("--kv-cache-dtype", default=None, help="K/V storage [the served variant's, bfloat16]")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every prompt starts with (a system prompt in the prefix cache) [0]")
    args = parser.parse_args()
    if not 0 <= args.shared_prefix <= args.context:
        parser.error(f"--shared-prefix must lie in 0..--context ({args.context}), got {args.shared_prefix}")
    from bench.profile import INT4_KV_BF16
    from bench.resources import load_engine_model
    from protoserve.engine.api import EngineConfig
    from protoserve.engine.runtime import LLMEngine

    torch.set_num_threads(args.threads)
    config = EngineConfig(deterministic=True, kv_cache_dtype=args.kv_cache_dtype or INT4_KV_BF16.kv_cache_dtype,
                          activation_precision=args.precision)
    if args.block_size is not None:
        config.block_size = args.block_size
    engine = LLMEngine(load_engine_model(INT4_KV_BF16), config)
    for _ in range(args.rounds):
        for rows in args.rows:
            phases: dict[str, float] | None = {} if args.phases else None
            t = time_decode_steps(engine, rows, args.context, args.steps, phases, args.shared_prefix)
            print(
                f"rows={rows} context={args.context} shared prefix={args.shared_prefix} step median {statistics.median(t) * 1e3:.2f} ms "
                f"min {min(t) * 1e3:.2f} ms -> {rows / statistics.median(t):.0f} tok/s ({len(t)} steps, "
                f"mean context {time_decode_steps.mean_context:.0f})",
                flush=True,
            )
            if phases:
                total = sum(phases.values())
                print("  " + ", ".join(f"{name} {phases[name] / len(t) * 1e3:.2f} ms ({phases[name] / total:.0%})"
                                       for name in phases), flush=True)


if __name__ == "__main__":
    main()
