"""Step-level timing of the fused C++ decoder step: median wall time of decode steps at a batch size.

Engine-direct on the served variant (int4 layers, int8 head, bf16 K/V, deterministic mode): ``rows``
sequences with ``context``-token prompts are prefilled, then each decode step's FusedStep call is
timed alone (no sampler, no scheduler). ``--phases`` also splits those steps' time by phase of the
layer loop (kernels/cpu/step_phases.py). Usage:

    python -m bench.step_profile --rows 16 64 --context 128 --steps 30 [--phases]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch


def time_decode_steps(engine, rows: int, context: int, steps: int, phases: dict[str, float] | None = None) -> list[float]:
    """Seconds per FusedStep call over ``steps`` decode steps of ``rows`` sequences; ``phases``, when
    given, gets those steps' seconds per phase added to it."""
    from protoserve.engine.models import fused_step
    from protoserve.engine.request import TokenizedRequest
    from protoserve.engine.sampling.sampling_params import SamplingParams
    from protoserve.kernels.cpu import step_phases

    times: list[tuple[int, float]] = []
    contexts: list[float] = []
    original = fused_step.FusedStep.__call__

    def timed(self, batch, *args, **kwargs):
        decode = int(batch.slot_mapping.numel()) == rows
        split_phases = phases is not None and decode
        with step_phases.timed() if split_phases else contextlib.nullcontext({}) as split:
            t0 = time.perf_counter()
            out = original(self, batch, *args, **kwargs)
            elapsed = time.perf_counter() - t0
        # The first decode step is dropped below: its phases are not counted either.
        if split_phases and any(n == rows for n, _ in times):
            for name in step_phases.PHASES:
                phases[name] = phases.get(name, 0.0) + split[name]
        times.append((int(batch.slot_mapping.numel()), elapsed))
        if times[-1][0] == rows:
            contexts.append(float(batch.seq_lens.float().mean()))
        return out

    fused_step.FusedStep.__call__ = timed
    try:
        gen = torch.Generator().manual_seed(rows)
        ids = []
        # Enough new tokens that every sequence is still decoding once the last prompt is in.
        budget = steps + rows * context // 64 + 8
        for i in range(rows):
            prompt = torch.randint(100, 40000, (context,), generator=gen).tolist()
            ids.append(f"profile-{rows}-{i}-{time.monotonic_ns()}")
            engine.add_request(
                TokenizedRequest(
                    request_id=ids[-1],
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True),
                )
            )
        while engine.has_unfinished() and sum(n == rows for n, _ in times) <= steps:
            engine.step()
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
    finally:
        fused_step.FusedStep.__call__ = original
    time_decode_steps.mean_context = sum(contexts[1:]) / max(1, len(contexts) - 1)
    return [t for n, t in times if n == rows][1:]  # decode steps (one token per sequence), first dropped


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
    args = parser.parse_args()
    from bench import engine_direct
    from bench.profile import INT4_KV_BF16
    from bench.resources import load_engine_model

    torch.set_num_threads(args.threads)
    if args.block_size is None:
        engine = engine_direct.make_engine(load_engine_model(INT4_KV_BF16), INT4_KV_BF16, deterministic=True)
    else:
        from protoserve.engine.config import EngineConfig
        from protoserve.engine.llm_engine import LLMEngine

        engine = LLMEngine(
            load_engine_model(INT4_KV_BF16),
            EngineConfig(
                deterministic=True, kv_cache_dtype=INT4_KV_BF16.kv_cache_dtype, block_size=args.block_size
            ),
        )
    if args.precision != "exact":
        engine.runner.model.set_activation_precision(args.precision)
    for _ in range(args.rounds):
        for rows in args.rows:
            phases: dict[str, float] | None = {} if args.phases else None
            t = time_decode_steps(engine, rows, args.context, args.steps, phases)
            print(
                f"rows={rows} context={args.context} step median {statistics.median(t) * 1e3:.2f} ms "
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
