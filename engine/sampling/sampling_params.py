"""SamplingParams: how tokens are chosen and when a request stops."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.speculative.params import SpeculativeParams


class ContextPolicy(StrEnum):
    """What to do when the prompt plus max_tokens does not fit the context window."""

    ALLOW_CONTEXT_STOP = "allow_context_stop"  # generate until the context is full, then finish with length
    REJECT = "reject"  # refuse when prompt + max_tokens exceeds the context
    TRUNCATE_LEFT = "truncate_left"  # drop the prompt's start until it fits
    TRUNCATE_RIGHT = "truncate_right"  # drop the prompt's end until it fits
    RESERVE_GENERATION = "reserve_generation"  # drop the prompt's start so max_tokens always fits


# The smallest temperature above 0 (greedy) that sampling uses; smaller ones are raised to it.
MIN_TEMPERATURE = 1e-2


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (defaults as vLLM/OpenAI).

    ``temperature == 0`` means greedy. ``max_tokens=None`` means "until the
    context window is full". Validation lives in ``validate()`` so the server
    can turn each problem into a field violation.

    ``constraint`` holds the output to a JSON Schema, regex, GBNF grammar or
    choice (whether it compiles is checked by ``LLMEngine.prepare``).
    ``mirostat_mode`` 1 or 2 replaces top-n-sigma/top-k/top-p/typical-p/min-p/XTC with llama.cpp's
    Mirostat v1/v2 (target surprise ``mirostat_tau`` bits, learning rate ``mirostat_eta``).
    ``xtc_probability`` turns on llama.cpp's XTC (engine/sampling/xtc.py) with ``xtc_threshold``.
    ``speculative`` opts the request in to speculative decoding (None: the engine's default, off);
    it changes how many tokens a step yields, never which: every feature but a constraint combines
    with it exactly (see Speculator.verify).
    """

    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    top_n_sigma: float = 0.0  # keep logits within n standard deviations of the largest; 0 disables
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    constraint: Constraint | None = None
    mirostat_mode: int = 0  # 0 off, 1 Mirostat, 2 Mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    xtc_probability: float = 0.0  # llama.cpp's XTC: how often to drop the likeliest candidates; 0 disables
    xtc_threshold: float = 0.1
    speculative: SpeculativeParams | None = None

    def __post_init__(self) -> None:
        # Logits over a smaller temperature overflow float32: infinities whose softmax is NaN, which
        # failed the whole engine step (every live request). vLLM raises such temperatures to the same floor.
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> list[tuple[str, str]]:
        """Return (field, problem) pairs for every invalid parameter; empty when valid."""
        bad: list[tuple[str, str]] = []
        if self.max_tokens is not None and self.max_tokens < 1:
            bad.append(("max_tokens", "must be at least 1"))
        if self.min_tokens < 0:
            bad.append(("min_tokens", "must be non-negative"))
        # Against a valid max_tokens only: a refused one is the problem, not the min_tokens it was compared with.
        if self.max_tokens is not None and self.max_tokens >= 1 and self.min_tokens > self.max_tokens:
            bad.append(("min_tokens", "must not exceed max_tokens"))
        if not 0.0 <= self.temperature <= 100.0:
            bad.append(("temperature", "must be in [0, 100]"))
        if self.top_k < 0:
            bad.append(("top_k", "must be non-negative (0 disables)"))
        if not 0.0 < self.top_p <= 1.0:
            bad.append(("top_p", "must be in (0, 1]"))
        if not 0.0 <= self.min_p <= 1.0:
            bad.append(("min_p", "must be in [0, 1]"))
        if not 0.0 < self.typical_p <= 1.0:
            bad.append(("typical_p", "must be in (0, 1]"))
        if not 0.0 <= self.top_n_sigma <= 100.0:
            bad.append(("top_n_sigma", "must be in [0, 100] (0 disables)"))
        if not 0.0 < self.repetition_penalty <= 100.0:
            bad.append(("repetition_penalty", "must be in (0, 100]"))
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad.append(("frequency_penalty", "must be in [-2, 2]"))
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad.append(("presence_penalty", "must be in [-2, 2]"))
        for token_id, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                bad.append(("logit_bias", f"token id {token_id} is outside the vocabulary [0, {vocab_size})"))
            if not -100.0 <= bias <= 100.0:
                bad.append(("logit_bias", f"bias {bias} for token {token_id} must be in [-100, 100]"))
        for token_id in self.stop_token_ids:
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                bad.append(("stop_token_ids", f"token id {token_id} is outside the vocabulary [0, {vocab_size})"))
        if any(s == "" for s in self.stop):
            bad.append(("stop", "stop strings must not be empty"))
        if not 1 <= self.n <= 16:
            bad.append(("n", "must be in [1, 16]"))
        if not 0 <= self.top_logprobs <= 20:
            bad.append(("top_logprobs", "must be in [0, 20]"))
        bad += self._mirostat_problems()
        bad += self._xtc_problems()
        if self.speculative is not None:
            bad += self.speculative.validate()
            if self.speculative.enabled and self.constraint is not None:
                # A draft row's grammar mask depends on the drafts before it; not built yet.
                bad.append(("speculative", "cannot be combined with a constraint yet: set speculative.method "
                                           "to \"off\" or drop the constraint"))
        if self.constraint is not None:
            bad += self.constraint.validate()
            if self.ignore_eos:
                bad.append(("ignore_eos", "cannot be combined with a constraint: the grammar decides where "
                                          "the output ends"))
        return bad

    def _mirostat_problems(self) -> list[tuple[str, str]]:
        """Mirostat picks the candidates itself: the truncation filters it replaces must stay off."""
        bad: list[tuple[str, str]] = []
        if self.mirostat_mode not in (0, 1, 2):
            return [("mirostat_mode", "must be 0 (off), 1 (Mirostat) or 2 (Mirostat 2.0)")]
        if not 0.0 <= self.mirostat_tau <= 100.0:
            bad.append(("mirostat_tau", "must be in [0, 100]"))
        if not 0.0 <= self.mirostat_eta <= 1.0:
            bad.append(("mirostat_eta", "must be in [0, 1]"))
        if self.mirostat_mode == 0:
            for name, default in (("mirostat_tau", 5.0), ("mirostat_eta", 0.1)):
                if getattr(self, name) != default:
                    bad.append((name, "has no effect unless mirostat_mode is 1 or 2"))
            return bad
        if self.greedy:
            bad.append(("temperature", "must be above 0 with mirostat_mode (0 is greedy decoding)"))
        for name, off in MIROSTAT_REPLACES.items():
            if getattr(self, name) != off:
                bad.append((name, f"must be {off} with mirostat_mode: Mirostat picks the candidates itself"))
        return bad

    def _xtc_problems(self) -> list[tuple[str, str]]:
        bad: list[tuple[str, str]] = []
        if not 0.0 <= self.xtc_probability <= 1.0:
            bad.append(("xtc_probability", "must be in [0, 1] (0 disables)"))
        if not 0.0 <= self.xtc_threshold <= 0.5:
            bad.append(("xtc_threshold", "must be in [0, 0.5]: above 0.5 at most one candidate qualifies, "
                                         "and XTC drops none"))
        if self.xtc_probability == 0.0:
            if self.xtc_threshold != 0.1:
                bad.append(("xtc_threshold", "has no effect unless xtc_probability is above 0"))
        elif self.greedy:
            bad.append(("temperature", "must be above 0 with xtc_probability (0 is greedy decoding)"))
        return bad

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Where(StrEnum):
    """Where a sampling field takes effect: what decides whether a row can use the batched sampler."""

    DEVICE = "device"  # the batched sampler applies it on the logits' device (engine/sampling/batched.py)
    HOST = "host"  # only the host sampler does: a row that uses it is sampled on the host
    NOT_SAMPLED = "not_sampled"  # stopping, output, request shape: no sampling step reads it


@dataclass(frozen=True)
class FieldUse:
    """One SamplingParams field's place in sampling.

    ``off``: the value at which the field changes nothing. ``candidates``: a filter over the candidate
    tokens, which Mirostat replaces (it must be ``off`` with mirostat_mode). ``reshapes``: it changes the
    logits before the pick or reads their distribution, so even a greedy row that uses it takes the
    sampler's per-row path, not a bare argmax. ``in_use``, for a field whose use depends on the sequence:
    whether a row uses it, given how many tokens it has generated.
    """

    where: Where
    off: object = None
    candidates: bool = False
    reshapes: bool = False
    in_use: Callable[[SamplingParams, int], bool] | None = None

    def used(self, name: str, params: SamplingParams, num_generated: int) -> bool:
        if self.in_use is not None:
            return self.in_use(params, num_generated)
        return getattr(params, name) != self.off


# Every field, once: a new one missing here fails tests/engine/test_sampling_fields.py, so none is
# silently dropped on the GPU path (the batched sampler serves only rows whose HOST fields are unused).
SAMPLING_FIELDS: dict[str, FieldUse] = {
    "max_tokens": FieldUse(Where.NOT_SAMPLED),
    # EOS is masked on the host until min_tokens are out; past that the row is batched again.
    "min_tokens": FieldUse(Where.HOST, 0, reshapes=True, in_use=lambda p, generated: generated < p.min_tokens),
    "temperature": FieldUse(Where.DEVICE, 1.0),
    "top_k": FieldUse(Where.DEVICE, 0, candidates=True),
    "top_p": FieldUse(Where.DEVICE, 1.0, candidates=True),
    "min_p": FieldUse(Where.DEVICE, 0.0, candidates=True),
    "typical_p": FieldUse(Where.HOST, 1.0, candidates=True),
    "top_n_sigma": FieldUse(Where.HOST, 0.0, candidates=True),
    "repetition_penalty": FieldUse(Where.DEVICE, 1.0, reshapes=True),
    "frequency_penalty": FieldUse(Where.DEVICE, 0.0, reshapes=True),
    "presence_penalty": FieldUse(Where.DEVICE, 0.0, reshapes=True),
    "logit_bias": FieldUse(Where.HOST, {}, reshapes=True),
    "seed": FieldUse(Where.DEVICE),  # the draw's uniform comes from the row's own generator either way
    "stop": FieldUse(Where.NOT_SAMPLED),
    "stop_token_ids": FieldUse(Where.NOT_SAMPLED),
    "ignore_eos": FieldUse(Where.NOT_SAMPLED),
    "n": FieldUse(Where.NOT_SAMPLED),
    "logprobs": FieldUse(Where.HOST, False, reshapes=True),
    "top_logprobs": FieldUse(Where.HOST, 0, reshapes=True),
    "skip_special_tokens": FieldUse(Where.NOT_SAMPLED),
    "constraint": FieldUse(Where.HOST, None),  # its grammar's mask is applied on the host
    "mirostat_mode": FieldUse(Where.HOST, 0),
    "mirostat_tau": FieldUse(Where.HOST, 5.0, in_use=lambda p, generated: p.mirostat_mode != 0),
    "mirostat_eta": FieldUse(Where.HOST, 0.1, in_use=lambda p, generated: p.mirostat_mode != 0),
    "xtc_probability": FieldUse(Where.HOST, 0.0, candidates=True),
    "xtc_threshold": FieldUse(Where.HOST, 0.1, in_use=lambda p, generated: p.xtc_probability != 0.0),
    "speculative": FieldUse(Where.NOT_SAMPLED),  # how many tokens a step yields, never which
}
MIROSTAT_REPLACES = {name: use.off for name, use in SAMPLING_FIELDS.items() if use.candidates}
# The fields bare_argmax reads, taken out once: it runs for every row of every step. Those whose use
# never changes during a request are read once per sequence (reshapes_for_good); the rest every step.
_RESHAPING_FOR_GOOD = tuple((name, use) for name, use in SAMPLING_FIELDS.items()
                            if use.reshapes and use.in_use is None)
_RESHAPING_PER_STEP = tuple((name, use) for name, use in SAMPLING_FIELDS.items()
                            if use.reshapes and use.in_use is not None)


def host_only(params: SamplingParams, num_generated: int) -> list[str]:
    """The fields a row uses that only the host sampler applies (empty: the batched sampler can serve it)."""
    return [name for name, use in SAMPLING_FIELDS.items()
            if use.where == Where.HOST and use.used(name, params, num_generated)]


def reshapes_for_good(params: SamplingParams) -> bool:
    """Sampled, or a field in use reshapes every row of the request: no step of it is a bare argmax."""
    return not params.greedy or any(use.used(name, params, 0) for name, use in _RESHAPING_FOR_GOOD)


def bare_argmax(params: SamplingParams, num_generated: int, for_good: bool | None = None) -> bool:
    """Greedy, and no field in use reshapes the row: its token is the logits' argmax (under any grammar mask).

    ``for_good``: ``reshapes_for_good(params)`` computed once for the request, which the per-row check
    of every step then skips."""
    if for_good is None:
        for_good = reshapes_for_good(params)
    return not for_good and not any(use.used(name, params, num_generated) for name, use in _RESHAPING_PER_STEP)
