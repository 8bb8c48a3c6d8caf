"""Roofline figures: what share of the machine's int8 peak a throughput figure, and its target, take.

A prompt token costs the multiply-adds of every layer's projections; a token
whose logits are sampled also costs the LM head. Prefill and batched decode of
the quantized variants run those on the int8 dot-product instruction that
``machine.int8_dot_peak`` measures, twice per multiply-add: the kernels
multiply each weight code by an activation code and by a code of that code's
rounding error (kernels/cpu/int8_dot_linear.cpp), which is what holds SmolLM2
int4's logits within the tests' bounds. So

    share of peak = tokens/s x multiply-adds per token x 2 / peak

for the measured figure and for its target. Attention, norms, the unpacking
and scaling of int4 blocks and the sampler are left out: the share is a lower
bound on what the figure needs, and a target whose share nears 1 cannot be met
on this machine by any kernel at this precision.

CPUs with AMX are left out: their tiles run the batched int8 work and are not
what the probe measures.

Single-stream decode is bound by memory, not arithmetic: each token reads
every weight once (int4 codes with their float16 group scale and min, the int8
head with its per-channel ones) and its sequence's cached K/V. ``decode_roofline``
holds a decode figure to ``machine.memory_bandwidth`` (bench/memory_bandwidth.py):

    share of bandwidth = tokens/s x bytes read per token / bytes per second

A decode at a long context reads the extra positions' K/V on top of what the
short-context decode reads, so against that decode it can keep at most
(``long_decode_ceiling``)

    ceiling = t_short / (t_short + extra positions x K/V bytes per position / bytes per second)

with t_short the measured short-context step: the K/V read at the probe's full
rate and costing nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.figures import Figure, Target, skipped
from bench.machine_peak import FIGURE as PEAK_FIGURE
from bench.memory_bandwidth import FIGURE as BANDWIDTH_FIGURE
from bench.targets import targets_for

if TYPE_CHECKING:
    from protoserve.engine.api import ModelConfig

SECTION = "roofline"
UNIT = "of peak"
# Single-stream decode figures held to the memory bandwidth: through gRPC, and the engine in turn with it.
DECODE_FIGURES = r"decode\.grpc|decode\.engine\.paired"
# A long-context decode against the short one (bench/sections/long_context.py), held to the K/V it adds.
LONG_DECODE_FIGURES = r"long_context\.self\.decode\.(\d+)"
# int8 dot products per weight multiply-add in the quantized linears: coarse and fine activation codes.
DOT_PRODUCTS_PER_MAC = 2


@dataclass(frozen=True)
class LinearWork:
    """Multiply-adds of a decoder's linear layers for one token."""

    body: int  # every layer's q, k, v, o, gate, up and down projections
    head: int  # the LM head, run only for tokens whose logits are sampled

    @classmethod
    def of(cls, config: ModelConfig) -> LinearWork:
        hidden, q_width = config.hidden_size, config.num_heads * config.head_dim
        kv_width = config.num_kv_heads * config.head_dim
        attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
        mlp = 3 * hidden * config.intermediate_size
        return cls(body=config.num_layers * (attention + mlp), head=hidden * config.vocab_size)

    def per_prompt_token(self, prompt_len: int) -> float:
        """Prefill of one prompt, per prompt token: only the last token's logits are computed."""
        return self.body + self.head / prompt_len

    def per_output_token(self, prompt_len: int, max_tokens: int) -> float:
        """A request of the serving load, per output token: the prompt and every output token but
        the last go through the layers; every output token's logits come from the head."""
        return ((prompt_len + max_tokens - 1) * self.body + max_tokens * self.head) / max_tokens


# Bytes of one weight's storage in the CPU kernels' layouts: int4 codes in 32-value groups with a
# float16 scale and min each (GGUF Q4_1's 20 bytes per 32); int8 codes per channel, with a float16
# scale and min per output channel.
INT4_GROUP, INT4_GROUP_BYTES = 32, 20
INT8_CHANNEL_META = 4
WEIGHT_FORMATS = ("int4", "int8")


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes a single-stream decode step reads from memory per token."""

    weights: int  # every layer's projections and norms, the final norm and the LM head, as stored
    kv_per_position: int  # the cached K and V of one context position, every layer

    @classmethod
    def of(
        cls, config: ModelConfig, layers: str = "int4", head: str = "int8", kv_bytes: int = 2
    ) -> DecodeBytes:
        """The served layout: ``layers``/``head`` "int4" (grouped) or "int8" (per channel); K/V of
        ``kv_bytes`` a value (2: bfloat16, the default under quantized weights)."""
        for name, fmt in (("layers", layers), ("head", head)):
            if fmt not in WEIGHT_FORMATS:
                raise ValueError(f"{name} must be one of {WEIGHT_FORMATS}, got {fmt!r}")
        if kv_bytes not in (2, 4):
            raise ValueError(f"kv_bytes must be 2 (bfloat16) or 4 (float32), got {kv_bytes}")
        work = LinearWork.of(config)
        h = config.hidden_size
        q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # output channels of one layer's q, k, v, o, gate, up, down projections
        channels = q_width + 2 * kv_width + h + 2 * config.intermediate_size + h

        def stored(macs: int, out_channels: int, fmt: str) -> int:
            if fmt == "int4":
                return macs * INT4_GROUP_BYTES // INT4_GROUP
            return macs + out_channels * INT8_CHANNEL_META

        norms = (2 * config.num_layers + 1) * h * 4  # float32, with the embedding row read too
        weights = (stored(work.body, config.num_layers * channels, layers)
                   + stored(work.head, config.vocab_size, head) + norms + h * 4)  # fmt: skip
        return cls(weights=weights, kv_per_position=2 * config.num_layers * kv_width * kv_bytes)

    def per_token(self, context: int) -> float:
        """A token decoded at ``context`` cached positions (its own included)."""
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return self.weights + context * self.kv_per_position


def decode_roofline(figure: Figure, bytes_per_token: float, bandwidth: Figure | None) -> Figure:
    """``roofline.<figure>``: the share of the measured memory bandwidth a single-stream decode
    figure (tokens/s) reads, and the tokens/s the bandwidth would allow at that many bytes a token."""
    name = f"roofline.{figure.name}"
    if bandwidth is None or bandwidth.value is None:
        return skipped(name, "of bandwidth", SECTION, f"{BANDWIDTH_FIGURE} was not measured")
    if figure.value is None:
        return skipped(name, "of bandwidth", SECTION, f"{figure.name} was not measured")
    bytes_per_s = bandwidth.value * 1e9
    details = {"of": figure.name, "mb_per_token": round(bytes_per_token / 1e6, 2),
               "gbps": round(figure.value * bytes_per_token / 1e9, 2), "bandwidth_gbps": bandwidth.value,
               "ceiling_tokens_per_s": round(bytes_per_s / bytes_per_token, 1)}  # fmt: skip
    return Figure(
        name=name,
        value=figure.value * bytes_per_token / bytes_per_s,
        unit="of bandwidth",
        section=SECTION,
        details=details,
    )


def long_decode_ceiling(ratio: Figure, short: Figure | None, extra_positions: int, kv_per_position: int,
                        bandwidth: Figure | None) -> Figure:
    """``roofline.<ratio>``: the most a decode ``extra_positions`` further into its context can keep of the
    ``short`` decode's tokens/s, its extra K/V read at ``bandwidth`` and nothing else added (unit "x")."""
    name = f"roofline.{ratio.name}"
    if bandwidth is None or bandwidth.value is None:
        return skipped(name, "x", SECTION, f"{BANDWIDTH_FIGURE} was not measured")
    if short is None or short.value is None:
        return skipped(name, "x", SECTION, "the short decode was not measured")
    extra_s = extra_positions * kv_per_position / (bandwidth.value * 1e9)
    short_s = 1.0 / short.value
    ceiling = short_s / (short_s + extra_s)
    details = {"of": ratio.name, "extra_kv_mb": round(extra_positions * kv_per_position / 1e6, 1),
               "extra_kv_ms": round(extra_s * 1e3, 2), "short_step_ms": round(short_s * 1e3, 2),
               "bandwidth_gbps": bandwidth.value}  # fmt: skip
    if ratio.value is not None:
        details["of_ceiling"] = round(ratio.value / ceiling, 3)
    return Figure(name=name, value=ceiling, unit="x", section=SECTION, details=details)


@dataclass(frozen=True)
class RooflineInputs:
    """What the figures are measured on: the model's work, the serving workload and the machine."""

    work: LinearWork
    serving_prompt_len: int
    serving_max_tokens: int
    int8_dot_variant: bool  # the served variant's linears run on int8 dot products
    amx: bool  # the CPU has AMX tiles, which the probe does not measure
    # Single-stream decode: bytes per token of the served variant and the context it is measured
    # at (the decode profile's prompt plus half its new tokens); None: no decode roofline.
    decode_bytes: DecodeBytes | None = None
    decode_context: int = 96
    # long_context's short decode: the prompt its long decodes' extra positions are counted from.
    long_decode_short_prompt: int = 32


def macs_per_token(name: str, inputs: RooflineInputs) -> float | None:
    """Multiply-adds per counted token of a prefill or serving-level figure (None for others)."""
    if m := re.fullmatch(r"prefill\.grpc\.(\d+)", name):
        return inputs.work.per_prompt_token(int(m[1]))
    if re.fullmatch(r"serving\.grpc\.c\d+", name):
        return inputs.work.per_output_token(inputs.serving_prompt_len, inputs.serving_max_tokens)
    return None


def roofline_figures(figures: Iterable[Figure], inputs: RooflineInputs) -> list[Figure]:
    """``roofline.<figure>`` for every gRPC prefill and serving-level figure measured in this run.

    Value: the share of the peak the measured figure takes; target: the share its own target needs.
    """
    figures = list(figures)
    by_name = {f.name: f for f in figures}
    decode = []
    if inputs.decode_bytes is not None:
        per_token = inputs.decode_bytes.per_token(inputs.decode_context)
        decode = [decode_roofline(f, per_token, by_name.get(BANDWIDTH_FIGURE)) for f in figures
                  if re.fullmatch(DECODE_FIGURES, f.name)]  # fmt: skip
        short = by_name.get("long_context.protoserve.decode.short")
        decode += [long_decode_ceiling(f, short, int(m[1]) - inputs.long_decode_short_prompt,
                                       inputs.decode_bytes.kv_per_position, by_name.get(BANDWIDTH_FIGURE))
                   for f in figures if (m := re.fullmatch(LONG_DECODE_FIGURES, f.name))]  # fmt: skip
    work_of = {f.name: work for f in figures if (work := macs_per_token(f.name, inputs)) is not None}
    names = list(work_of)
    if not names:
        return decode
    peak = by_name.get(PEAK_FIGURE)
    reason = None
    if peak is None or peak.value is None:
        reason = f"{PEAK_FIGURE} was not measured"
    elif inputs.amx:
        reason = "AMX tiles run the batched int8 work on this CPU; the probe measures the vector units"
    elif not inputs.int8_dot_variant:
        reason = "the served variant's linears do not run on int8 dot products"
    if reason is not None:
        return [skipped(f"roofline.{name}", UNIT, SECTION, reason) for name in names] + decode
    usable = peak.value / DOT_PRODUCTS_PER_MAC  # weight multiply-adds per second, in GMAC/s
    goals = targets_for(names)
    out = []
    for name in names:
        figure, work = by_name[name], work_of[name]
        if figure.value is None:
            out.append(skipped(f"roofline.{name}", UNIT, SECTION, f"{name} was not measured"))
            continue
        gmacs = figure.value * work / 1e9
        details = {"of": name, "gmacs": round(gmacs, 1), "usable_peak_gmacs": round(usable, 1),
                   "mmacs_per_token": round(work / 1e6, 1)}  # fmt: skip
        target = None
        goal = goals.get(name)
        if goal is not None and goal.better == "higher":
            target_gmacs = goal.threshold * work / 1e9
            details["target_gmacs"] = round(target_gmacs, 1)
            target = Target(round(target_gmacs / usable, 3), "higher")
        out.append(
            Figure(
                name=f"roofline.{name}",
                value=gmacs / usable,
                unit=UNIT,
                section=SECTION,
                target=target,
                details=details,
            )
        )
    return out + decode
