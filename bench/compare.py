"""Comparison figures: one path over another, both measured in this run.

``compare.grpc_vs_engine.*`` and ``compare.sse_vs_engine.*`` are what the gRPC
server and the gateway's SSE keep of the engine's speed (target >= 0.95),
``compare.sse_vs_grpc.*`` what the gateway's SSE keeps of gRPC's (target >=
0.90), ``compare.det_vs_fast.*`` what deterministic (batch-invariant) kernels
keep of the fast ones. For latencies the ratio is
inverted, so above 1 always means the first path is better.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from bench.figures import Figure, skipped, speedup

SECTION = "compare"


@dataclass(frozen=True)
class Comparison:
    """``name`` = figure ``numerator`` over figure ``denominator``."""

    name: str
    numerator: str
    denominator: str


def comparisons(names: Iterable[str], served: str = "fp32") -> list[Comparison]:
    """Every comparison whose two figures are in ``names``, in a stable order.

    ``served`` is the label of the variant the server figures ran (the engine figure they are held to).
    """
    names = list(names)
    present = set(names)
    out: list[Comparison] = []

    def add(name: str, numerator: str, denominator: str) -> None:
        if numerator in present and denominator in present:
            out.append(Comparison(name, numerator, denominator))

    # Held to the engine measured in turn with it when that ran (see bench/sections/decode.py).
    if "decode.engine.paired" in present:
        add("compare.grpc_vs_engine.decode", "decode.grpc", "decode.engine.paired")
    else:
        add("compare.grpc_vs_engine.decode", "decode.grpc", f"decode.engine.{served}.det")
    add("compare.sse_vs_grpc.decode", "decode.sse", "decode.grpc")
    for name in names:
        if m := re.fullmatch(r"prefill\.grpc\.(\d+)", name):
            paired = f"prefill.engine.paired.{m[1]}"
            engine = paired if paired in present else f"prefill.engine.{served}.det.{m[1]}"
            add(f"compare.grpc_vs_engine.prefill.{m[1]}", name, engine)
    for name in names:
        # serving.grpc.c16, and serving.stream4.grpc.c16 from the server streaming 4 tokens a message
        if m := re.fullmatch(r"serving\.((?:stream\d+\.)?)grpc\.((?:long_mix\.)?c\d+)", name):
            variant, key = m[1], m[2]
            add(f"compare.grpc_vs_engine.{variant}{key}", name, f"serving.{variant}engine.{key}")
            add(f"compare.sse_vs_engine.{variant}{key}", f"serving.{variant}sse.{key}", f"serving.{variant}engine.{key}")
            add(f"compare.sse_vs_grpc.{variant}{key}", f"serving.{variant}sse.{key}", name)
            add(f"compare.openai_vs_grpc.{variant}{key}", f"serving.{variant}openai-sse.{key}", name)
    for name in names:
        if m := re.fullmatch(r"(decode|offline)\.engine\.([\w-]+)\.det", name):
            add(f"compare.det_vs_fast.{m[1]}.{m[2]}", name, f"{m[1]}.engine.{m[2]}.fast")
    return out


def compare_figures(figures: Iterable[Figure], served: str = "fp32") -> list[Figure]:
    """The comparison figures for whatever was measured; skipped ones when a side has no value."""
    by_name = {f.name: f for f in figures}
    out = []
    for c in comparisons(by_name, served):
        num, den = by_name[c.numerator], by_name[c.denominator]
        details = {"of": c.numerator, "over": c.denominator}
        if num.value is None or den.value is None:
            missing = c.numerator if num.value is None else c.denominator
            out.append(skipped(c.name, "ratio", SECTION, f"{missing} was not measured"))
            continue
        ratio = speedup(num.value, den.value, num.better)
        out.append(Figure(name=c.name, value=ratio, unit="ratio", section=SECTION, details=details))
    return out
