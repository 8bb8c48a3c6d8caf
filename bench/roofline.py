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

Single-stream decode is left out (it streams the weights from memory, not
bound by arithmetic), as are CPUs with AMX, whose tiles run the batched int8
work and are not what the probe measures.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bench.figures import Figure, Target, skipped
from bench.machine_peak import FIGURE as PEAK_FIGURE
from bench.targets import targets_for

if TYPE_CHECKING:
    from protoserve.engine.models.config import ModelConfig

SECTION = "roofline"
UNIT = "of peak"
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


@dataclass(frozen=True)
class RooflineInputs:
    """What the figures are measured on: the model's work, the serving workload and the machine."""

    work: LinearWork
    serving_prompt_len: int
    serving_max_tokens: int
    int8_dot_variant: bool  # the served variant's linears run on int8 dot products
    amx: bool  # the CPU has AMX tiles, which the probe does not measure


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
    work_of = {f.name: work for f in figures if (work := macs_per_token(f.name, inputs)) is not None}
    names = list(work_of)
    if not names:
        return []
    peak = by_name.get(PEAK_FIGURE)
    reason = None
    if peak is None or peak.value is None:
        reason = f"{PEAK_FIGURE} was not measured"
    elif inputs.amx:
        reason = "AMX tiles run the batched int8 work on this CPU; the probe measures the vector units"
    elif not inputs.int8_dot_variant:
        reason = "the served variant's linears do not run on int8 dot products"
    if reason is not None:
        return [skipped(f"roofline.{name}", UNIT, SECTION, reason) for name in names]
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
    return out
