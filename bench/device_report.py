"""The engine's serving figures on one device, vLLM-style: TTFT, ITL and throughput at c=1/16/64.

``make bench DEVICE=cuda`` (``python -m bench.device_report --device cuda``) loads the model on the
device and runs, engine-direct (LLMEngine stepped in this process), closed-loop loads of
``concurrency`` requests in flight, each a fresh-nonce prompt of ``--prompt-len`` tokens and
``--output-len`` generated tokens (``ignore_eos``), after a warm-up. Beside them, transformers'
``generate`` on the same device and the same weights (one request at a time, greedy, static cache
off) as the peer of the single-stream figure. Each weight format given is a row of the report.

Each load also reports the device's idle time per step (bench/device_idle.py: step wall time less
the forwards' busy time on CUDA events): what async scheduling hides; ``FORMAT/sync`` rows run with it off.

``--random-weights`` builds a random checkpoint with the default model's shape (SmolLM2-135M: the same
layers, heads and vocabulary, so the same work per token) where the model's weights cannot travel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import engine_direct
from bench.device_idle import timed_device_steps
from bench.stats import percentile
from bench.workload import NonceSource, PromptFactory

CONCURRENCIES = (1, 16, 64)
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                     tie_word_embeddings=True, rms_norm_eps=1e-5)


@dataclass
class LoadFigure:
    quantization: str
    concurrency: int
    requests: int
    tokens_per_s: float  # generated tokens over wall time
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    idle_ms_per_step: float | None = None  # the device waiting on the host (cuda only)


def random_smollm2_checkpoint(directory: Path) -> Path:
    """A Llama checkpoint with SmolLM2-135M's shape and random weights, saved with transformers."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def run_load(engine, factory: PromptFactory, concurrency: int, prompt_len: int, output_len: int,
             quantization: str) -> LoadFigure:
    from protoserve.engine.api import SamplingParams, TokenizedRequest

    n = max(2 * concurrency, 4)
    requests = [TokenizedRequest(request_id=f"load-{concurrency}-{i}", prompt_token_ids=list(factory.prompt(prompt_len)),
                                 sampling=SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
                for i in range(n)]
    start = time.perf_counter()
    with timed_device_steps(engine) as idle:
        timelines = engine_direct.run_tokenized(engine, requests, concurrency=concurrency)
    seconds = time.perf_counter() - start
    ttfts = [t.ttft for t in timelines if t.ttft is not None]
    itls = [gap for t in timelines for gap in t.inter_token_latencies()]
    return LoadFigure(quantization, concurrency, n, sum(t.output_tokens for t in timelines) / seconds,
                      1000 * percentile(ttfts, 50), 1000 * percentile(ttfts, 99),
                      1000 * percentile(itls, 50), 1000 * percentile(itls, 99), idle.idle_ms_per_step())


def transformers_single_stream(model_path: Path, device: str, prompt: Sequence[int], output_len: int) -> float:
    """Generated tokens/s of transformers' greedy ``generate`` on one prompt (the c=1 peer)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    ids = torch.tensor([list(prompt)], device=device)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
    model.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
    runs = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(output_len / (time.perf_counter() - start))
    return statistics.median(runs)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_report", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--model", type=Path, help="GGUF file or HF directory [the default SmolLM2 GGUF]")
    parser.add_argument("--random-weights", action="store_true",
                        help="a random checkpoint of SmolLM2-135M's shape instead of --model")
    parser.add_argument("--quantization", default="none,none/sync,none/eager,int8,int4,fp8",
                        help="weight formats, comma-separated; FORMAT/eager runs without CUDA graphs, "
                        "FORMAT/sync without async scheduling")
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' generate")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)

    from protoserve.engine.api import EngineConfig
    from protoserve.engine.runtime import LLMEngine, load_model, resolve_device

    try:
        resolve_device(args.device)
    except ValueError as exc:
        print(f"bench.device_report: {exc}", file=sys.stderr)
        return 2
    scratch = tempfile.TemporaryDirectory()
    path = random_smollm2_checkpoint(Path(scratch.name)) if args.random_weights else args.model
    factory = PromptFactory(NonceSource(), seed=0, token_range=(100, 40000))
    figures: list[LoadFigure] = []
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    for row in args.quantization.split(","):
        quantization, _, mode = row.partition("/")
        if quantization == "fp8" and args.device != "cuda":
            continue  # the CPU has no FP8 kernel
        loaded = load_model(path, quantization=quantization, progress=False, device=args.device,
                            load_tokenizer=False)
        engine = LLMEngine(loaded, EngineConfig(device=args.device, kv_cache_bytes=2 * 1024**3,
                                                cuda_graphs=mode != "eager",
                                                async_scheduling=False if mode == "sync" else None))
        # eager or sync beside the default: single stream and the largest load tell the difference
        levels = [c for c in concurrencies if c == 1 or mode not in ("eager", "sync") or c == max(concurrencies)]
        for c in levels:  # warm-up: kernels compile, and each batch size's decode graph is captured, here
            run_load(engine, factory, c, args.prompt_len, 8, row)
        for c in levels:
            figures.append(run_load(engine, factory, c, args.prompt_len, args.output_len, row))
            print(json.dumps(asdict(figures[-1])), flush=True)
        del engine, loaded
    peer = None
    if not args.no_peer and path is not None and Path(path).is_dir():
        peer = transformers_single_stream(Path(path), args.device, factory.prompt(args.prompt_len), args.output_len)
    print(f"\n{args.device}: prompt {args.prompt_len}, output {args.output_len} tokens, engine-direct")
    print(f"{'weights':<10} {'c':>3} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'idle/step':>9}")
    for f in figures:
        print(f"{f.quantization:<10} {f.concurrency:>3} {f.tokens_per_s:>9.1f} {f.ttft_p50_ms:>7.1f}ms "
              f"{f.ttft_p99_ms:>7.1f}ms {f.itl_p50_ms:>6.2f}ms {f.itl_p99_ms:>6.2f}ms "
              f"{'-' if f.idle_ms_per_step is None else f'{f.idle_ms_per_step:.2f}ms':>9}")
    if peer is not None:
        ours = next((f.tokens_per_s for f in figures if f.quantization == "none" and f.concurrency == 1), None)
        ratio = f" (engine float32 c=1: {ours / peer:.2f}x)" if ours else ""
        print(f"transformers generate, float32, one stream: {peer:.1f} tok/s{ratio}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"device": args.device, "figures": [asdict(f) for f in figures],
                                             "transformers_single_stream_tok_s": peer}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
