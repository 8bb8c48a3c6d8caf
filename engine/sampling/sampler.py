"""Sampler: the next token of each sequence from its logits row.

Every row is processed on its own with the same operations whatever the batch
holds, and random draws come from the sequence's own ``torch.Generator``: a
seeded request gets the same tokens alone or batched. Control flow is integer;
floats only carry logits and probabilities. A constrained row's grammar mask
touches that row only, so its neighbours' tokens are bit-for-bit what they would
be without it.

Order, per row: logit bias -> grammar mask -> min_tokens masking -> repetition /
frequency / presence penalties -> (greedy: argmax) temperature -> top-n-sigma ->
top-k -> top-p -> typical-p -> min-p -> XTC -> draw (llama.cpp's chain puts top-n-sigma
first among the filters too); with Mirostat, temperature -> Mirostat's own cut
-> draw. min_tokens never holds back the only tokens a grammar allows.

Logprobs are the log-softmax of the row after bias, masking (the grammar's
included), penalties and temperature (unscaled when greedy), before the
truncation filters: the distribution the sampler drew from, before it was cut
down. Impossible tokens report -9999.0 instead of -inf, as OpenAI does, so they
serialize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protoserve.engine.request import PositionLogprobs, TokenLogprob
from protoserve.engine.sampling import mirostat
from protoserve.engine.sampling.batched import batch_sampleable, sample_batch
from protoserve.engine.sampling.constraints.masks import apply_token_mask, masked_argmax
from protoserve.engine.sampling.nucleus import apply_top_p
from protoserve.engine.sampling.penalties import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    mask_tokens,
)
from protoserve.engine.sampling.sampling_params import bare_argmax
from protoserve.engine.sampling.xtc import apply_xtc
from protoserve.engine.scheduling.sequence import Sequence
from protoserve.kernels.cpu.argmax import argmax_rows

NEG_INF = float("-inf")
LOGPROB_FLOOR = -9999.0


@dataclass
class SampleResult:
    token_id: int
    logprobs: PositionLogprobs | None = None


def apply_top_n_sigma(logits: torch.Tensor, n: float) -> torch.Tensor:
    """Top-nσ, as llama.cpp's top-n-sigma sampler: keep the tokens whose logit is at least the largest
    minus n population standard deviations, both taken over the tokens still possible; 0 disables.

    Scaling every logit by 1/temperature scales the largest and the deviation alike, so the kept set
    is the same before or after temperature.
    """
    if n <= 0.0 or logits.shape[0] <= 1:
        return logits
    possible = logits[logits != NEG_INF].double()
    if possible.numel() == 0:
        return logits
    threshold = float(possible.max()) - n * float(possible.std(correction=0))
    return logits.masked_fill(logits < threshold, NEG_INF)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits (and ties with the k-th)."""
    if 0 < k < logits.shape[0]:
        kth = torch.topk(logits, k).values[-1]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    return logits


def apply_typical_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy, up to mass p."""
    if p >= 1.0:
        return logits
    logp = torch.log_softmax(logits, dim=0)
    entropy = -(logp.exp() * logp).nansum()
    distance = (-logp - entropy).abs()
    sorted_distance, order = torch.sort(distance, stable=True)
    cum = logp[order].exp().cumsum(dim=0)
    last = min(int((cum < p).sum()), logits.shape[0] - 1)
    remove = sorted_distance > sorted_distance[last]
    return logits.index_fill(0, order[remove], NEG_INF)


def apply_min_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop tokens less likely than p times the most likely one."""
    if p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=0)
    return logits.masked_fill(probs < p * probs.max(), NEG_INF)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw of one token with one uniform from the sequence's generator.

    ``right=True`` finds the first token whose cumulative mass exceeds u, so a
    zero-probability token can never be chosen.
    """
    cdf = probs.to(torch.float64).cumsum(dim=0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def position_logprobs(logp: torch.Tensor, token_id: int, num_top: int) -> PositionLogprobs:
    chosen = TokenLogprob(token_id, max(float(logp[token_id]), LOGPROB_FLOOR))
    top: list[TokenLogprob] = []
    if num_top > 0:
        values, ids = torch.topk(logp, min(num_top, logp.shape[0]))
        top = [TokenLogprob(int(i), max(float(v), LOGPROB_FLOOR)) for v, i in zip(values, ids, strict=True)]
    return PositionLogprobs(chosen=chosen, top=top)


class Sampler:
    """Chooses one token per row; knows the model's EOS ids for min_tokens masking."""

    def __init__(self, eos_token_ids: frozenset[int], batch_rows: bool = False) -> None:
        self.eos_token_ids = eos_token_ids
        # Sample the rows engine/sampling/batched.py serves as one batch where the logits are (always
        # for logits on a GPU; tests set it to run that path on CPU tensors).
        self.batch_rows = batch_rows

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 bitmask: torch.Tensor | None = None) -> list[SampleResult]:
        """One token per row; ``bitmask`` (int32 ``[rows, words]``) holds the grammar masks of the rows
        whose sequence has a matcher, and is ignored for the others."""
        assert logits.shape[0] == len(seqs)
        if not (self.batch_rows or logits.device.type != "cpu"):
            return self.on_host(logits, seqs, bitmask)
        results: list[SampleResult | None] = [None] * len(seqs)
        batched = [i for i, seq in enumerate(seqs) if batch_sampleable(seq)]
        if batched:
            index = torch.tensor(batched, dtype=torch.int64, device=logits.device)
            tokens = sample_batch(logits.index_select(0, index), [seqs[i] for i in batched])
            for i, token in zip(batched, tokens, strict=True):
                results[i] = SampleResult(token)
        rest = [i for i, r in enumerate(results) if r is None]
        if rest:  # only these rows' logits come to the host
            host = self.on_host(logits[rest].cpu(), [seqs[i] for i in rest],
                                bitmask[rest] if bitmask is not None else None)
            for i, r in zip(rest, host, strict=True):
                results[i] = r
        return results  # type: ignore[return-value]

    def on_host(self, logits: torch.Tensor, seqs: list[Sequence],
                bitmask: torch.Tensor | None = None) -> list[SampleResult]:
        """The per-row sampler over CPU logits."""
        plain = [self.plain_greedy(seq) for seq in seqs]
        # One reduction over the batch for every row that needs nothing else: the per-row path
        # copies each row (vocab floats) and pays a few tensor ops' dispatch, ~4 ms a step at 64
        # rows. The kernel takes the first maximum as NumPy's argmax and torch's do, so the tokens
        # are the same; it splits the rows over the threads, where the step's logits are read at
        # memory bandwidth (torch's max(dim=1) took 1.7-7.9 ms at 64 rows of 49152 on these CPUs).
        best: list[int] = []
        if any(plain):
            rows = logits.float()
            best = argmax_rows(rows)
            # Plain greedy rows under a grammar: the first maximum among the allowed tokens, per row,
            # as the per-row path would find it, without its copies.
            masked = [i for i, seq in enumerate(seqs) if plain[i] and seq.matcher is not None]
            if masked:
                assert bitmask is not None
                for i, token in zip(masked, masked_argmax(rows.numpy()[masked], bitmask[masked]), strict=True):
                    best[i] = token
        return [SampleResult(best[i]) if plain[i] else self.sample_row(logits[i], seq, _bits(bitmask, i, seq))
                for i, seq in enumerate(seqs)]

    def plain_greedy(self, seq: Sequence) -> bool:
        """Greedy with nothing that changes the row (bias, held tokens, penalties) or reads it (logprobs);
        a grammar mask may apply."""
        return bare_argmax(seq.sampling, seq.num_generated, seq.sampling_reshapes_for_good)

    def adjust(self, row: torch.Tensor, seq: Sequence, bits: torch.Tensor | None = None) -> torch.Tensor:
        """Bias, the grammar mask, min_tokens and penalties on a float32 copy of the row."""
        sp = seq.sampling
        row = row.to(torch.float32, copy=True)
        if sp.logit_bias:
            apply_logit_bias(row, sp.logit_bias)
        if bits is not None:
            apply_token_mask(row, bits)
        if seq.num_generated < sp.min_tokens:
            held = list(sp.stop_token_ids)
            if not sp.ignore_eos:
                held += sorted(self.eos_token_ids)
            held = [t for t in held if t < row.shape[0]]
            if bits is None or _leaves_a_token(row, held):
                mask_tokens(row, held)
        if sp.repetition_penalty != 1.0:
            seen = torch.unique(torch.tensor(seq.token_ids, dtype=torch.int64))
            apply_repetition_penalty(row, seen, sp.repetition_penalty)
        if (sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0) and seq.num_generated > 0:
            output = torch.tensor(seq.output_token_ids, dtype=torch.int64)
            apply_frequency_presence(row, output, sp.frequency_penalty, sp.presence_penalty)
        return row

    def sample_row(self, row: torch.Tensor, seq: Sequence, bits: torch.Tensor | None = None) -> SampleResult:
        sp = seq.sampling
        row = self.adjust(row, seq, bits)
        if sp.greedy:
            dist = row
            token_id = int(torch.argmax(row))
        elif sp.mirostat_mode:
            dist = row / sp.temperature
            token_id = self.mirostat_draw(dist, seq)
        else:
            dist = row / sp.temperature
            cut = apply_top_n_sigma(dist, sp.top_n_sigma)
            cut = apply_top_k(cut, sp.top_k)
            cut = apply_top_p(cut, sp.top_p)
            cut = apply_typical_p(cut, sp.typical_p)
            cut = apply_min_p(cut, sp.min_p)
            cut = apply_xtc(cut, sp.xtc_probability, sp.xtc_threshold, seq.generator)
            token_id = draw(torch.softmax(cut, dim=0), seq.generator)
        logprobs = None
        if sp.logprobs or sp.top_logprobs > 0:
            logprobs = position_logprobs(torch.log_softmax(dist, dim=0), token_id, sp.top_logprobs)
        return SampleResult(token_id, logprobs)

    def mirostat_draw(self, dist: torch.Tensor, seq: Sequence) -> int:
        """Cut the candidates as Mirostat v1/v2 does for the sequence's mu, draw, and move its mu."""
        sp = seq.sampling
        probs, ids = mirostat.sorted_candidates(dist)
        if sp.mirostat_mode == 1:
            keep = mirostat.v1_keep(probs, seq.mirostat_mu, dist.shape[0])
        else:
            keep = mirostat.v2_keep(probs, seq.mirostat_mu)
        kept = probs[:keep] / probs[:keep].sum()
        index = draw(kept, seq.generator)
        p_chosen = float(kept[index])
        seq.mirostat_mu = mirostat.updated_mu(seq.mirostat_mu, p_chosen, sp.mirostat_tau, sp.mirostat_eta)
        return int(ids[index])


def _bits(bitmask: torch.Tensor | None, i: int, seq: Sequence) -> torch.Tensor | None:
    return bitmask[i] if bitmask is not None and seq.matcher is not None else None


def _leaves_a_token(row: torch.Tensor, held: list[int]) -> bool:
    """Whether holding back ``held`` leaves some possible token (a grammar may allow only EOS)."""
    possible = torch.isfinite(row)
    possible[held] = False
    return bool(possible.any())
