"""``make bench``: protoserve against itself and against transformers, side by side in one run.

    python -m bench.run                    # default run: a few minutes on 2 cores
    python -m bench.run --full             # the thorough run
    python -m bench.run --only decode      # one section (SECTIONS below; --help lists them)
    python -m bench.run --json-out r.json  # also write every figure (and the run's metadata) here

Prints a table, then one JSON line per figure, on stdout; progress goes to
stderr. Every run is also saved under bench/results/ (gitignored), with the
server logs. See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import machine_check, machine_peak, memory_bandwidth, resources
from bench.compare import compare_figures
from bench.context import BenchContext
from bench.figures import Figure, resolve
from bench.profile import PROFILES, Profile
from bench.report import format_table, json_lines
from bench.roofline import DecodeBytes, LinearWork, RooflineInputs, roofline_figures
from bench.runner import Step, run_steps
from bench.sections import (
    activation,
    affinity,
    constrained,
    conversation,
    decode,
    fairness,
    families,
    host_loop,
    isolation,
    long_context,
    lora,
    moe,
    multi_model,
    offline,
    peer_engine,
    peer_serving,
    prefill,
    rag,
    serving,
    session_restore,
    speculative,
)
from bench.targets import targets_for

SECTIONS = {
    "offline": offline.steps,
    "prefill": prefill.steps,
    "decode": decode.steps,
    "serving": serving.steps,
    "isolation": isolation.steps,
    "fairness": fairness.steps,
    "constrained": constrained.steps,
    "rag": rag.steps,
    "lora": lora.steps,
    "speculative": speculative.steps,
    "moe": moe.steps,
    "families": families.steps,
    "affinity": affinity.steps,
    "activation": activation.steps,
    "peer_serving": peer_serving.steps,
    "peer_engine": peer_engine.steps,
    "long_context": long_context.steps,
    "conversation": conversation.steps,
    "multi_model": multi_model.steps,
    "session_restore": session_restore.steps,
    "host_loop": host_loop.steps,
}
RESULTS_DIR = Path(__file__).resolve().parent / "results"
log = logging.getLogger("bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true", help="the thorough run (tens of minutes)")
    size.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes: checks the harness end to end; the numbers mean little",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help=f"run only this section (repeatable or comma-separated): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--model",
        metavar="NAME|PATH",
        help="measure this model instead of the default SmolLM2 GGUF: a checkpoint path or an installed "
        "model's short name (`protoserve models`, e.g. gemma3-270m); transformers loads the same file",
    )
    parser.add_argument("--json-out", metavar="FILE", help="also write all results to FILE")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, here and in the server [2]")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (prompt bodies and lengths) [0]")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where runs and server logs go")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (tracebacks of failures)")
    return parser


def selected_sections(only: Sequence[str]) -> list[str]:
    """Sections to run, in the canonical order; all of them when ``only`` is empty."""
    names = [n.strip() for item in only for n in item.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    return [s for s in SECTIONS if not names or s in names]


def collect_steps(ctx: BenchContext, sections: Sequence[str]) -> list[Step]:
    return [step for name in sections for step in SECTIONS[name](ctx)]


def finish(figures: list[Figure], served: str = "fp32", roofline: RooflineInputs | None = None) -> list[Figure]:
    """Add the comparisons (and the roofline figures, given their inputs), then attach targets
    and ratios to transformers."""
    figures = figures + compare_figures(figures, served)
    if roofline is not None:
        figures = figures + roofline_figures(figures, roofline)
    return resolve(figures, targets_for(f.name for f in figures))


def roofline_inputs(profile: Profile) -> RooflineInputs | None:
    """The default model's linear work, the profile's serving workload and this CPU; None (no
    roofline figures, the rest of the report intact) if the model's shape cannot be read."""
    from protoserve.engine.runtime import read_model_config
    from protoserve.kernels.cpu.extension import cpu_flags

    try:
        config = read_model_config(resources.model_path())
    except Exception as exc:  # noqa: BLE001 - reported, and the measured figures still print
        log.warning("no roofline figures: the model's shape could not be read (%s)", exc)
        return None
    return RooflineInputs(
        work=LinearWork.of(config),
        serving_prompt_len=profile.serving_prompt_len,
        serving_max_tokens=profile.serving_max_tokens,
        int8_dot_variant=profile.serving_variant.quantization != "none",
        amx="amx_int8" in cpu_flags().split(),
        # bytes a token reads as the served weights are stored (int4/int8 layers, an int8 head)
        decode_bytes=DecodeBytes.of(config, layers=quantization) if (
            quantization := profile.serving_variant.quantization) in ("int4", "int8") else None,
        # a single-stream request's mean context over its decode
        decode_context=profile.decode_prompt_len + profile.decode_tokens // 2,
        long_decode_short_prompt=long_context.SHORT_PROMPT,
    )


def metadata(
    profile: Profile, sections: Sequence[str], threads: int, started: float, load_start: Sequence[float]
):
    import torch

    return {
        "profile": profile.name,
        "sections": list(sections),
        "threads": threads,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "model": resources.model_path().name,
        "cpu": machine_check.describe_cpu(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def write_results(path: Path, meta: dict[str, Any], figures: Sequence[Figure]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "figures": [f.to_json() for f in figures]}, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s bench: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    profile = PROFILES["full" if args.full else "smoke" if args.smoke else "default"]
    resources.use_model(args.model)
    sections = selected_sections(args.only)
    started, load_start = time.time(), os.getloadavg()

    import torch

    # Same thread count for every in-process path (engine and transformers) and the server.
    torch.set_num_threads(args.threads)
    log.info(
        "profile %s, sections %s, %d threads, load average %s",
        profile.name,
        ",".join(sections),
        args.threads,
        " ".join(f"{x:.2f}" for x in load_start),
    )
    # First, while nothing is loaded: the instruction peak the roofline figures are held to.
    peak = machine_peak.peak_figure(args.threads)
    log.info("%s = %s", peak.name, f"{peak.value:.1f} {peak.unit}" if peak.value is not None else peak.note)
    # One core's rate beside it: tells the CPU generation, and a core held by another process.
    machine = machine_check.cores_free_figures(args.threads, peak)
    # The memory bandwidth single-stream decode is held to (roofline.decode_*).
    machine.append(memory_bandwidth.bandwidth_figure(args.threads))
    for f in machine:
        if f.note and f.target is not None:
            log.warning("%s = %.2f: %s", f.name, f.value, f.note)
    ctx = BenchContext(profile, seed=args.seed)
    measured = run_steps(collect_steps(ctx, sections), args.results_dir, args.threads)
    figures = finish([peak, *machine, *measured], profile.serving_variant.label, roofline_inputs(profile))
    meta = metadata(profile, sections, args.threads, started, load_start)

    print(
        f"protoserve bench: profile={meta['profile']} sections={','.join(sections)} threads={args.threads} "
        f"cpus={meta['cpus']} cpu={meta['cpu']!r} torch={meta['torch']} model={meta['model']} "
        f"served={profile.serving_variant.label} "
        f"took={meta['seconds']}s "
        f"load_avg start={meta['load_average_start'][0]} end={meta['load_average_end'][0]}"
    )
    print("ratios: 'x transformers' > 1 means protoserve is better (faster, or lower latency)\n")
    print(format_table(figures))
    print()
    for line in json_lines(figures):
        print(line)

    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    saved = args.results_dir / f"bench-{profile.name}-{stamp}.json"
    write_results(saved, meta, figures)
    if args.json_out:
        write_results(Path(args.json_out), meta, figures)
    log.info("results saved to %s", saved)
    return 0


if __name__ == "__main__":
    sys.exit(main())
