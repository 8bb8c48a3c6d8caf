"""The sampler's common cases as batched tensor operations on the logits' own device (the GPU path).

On device cuda the logits of a step stay on the GPU: the rows this module serves are sampled there and
only their token ids come back to the host. It serves rows with nothing beyond temperature, top-k,
top-p, min-p, the repetition / frequency / presence penalties and ``n``: greedy, or a draw. Rows that
use a field ``SAMPLING_FIELDS`` (sampling_params.py) marks host-only (a grammar, logit bias, min_tokens
still holding tokens back, Mirostat, typical-p, top-n-sigma, logprobs) go to the per-row host sampler
(engine/sampling/sampler.py), which this mirrors operation for
operation, so a row gets the same token either way up to float rounding: the same filters in the same
order, and the draw's uniform comes from the sequence's own generator on the host (one float64 per
row), so a seeded request keeps its stream.

The sampling state travels as small per-row tensors: temperatures, k, p, min-p, penalties, and the
tokens the penalties look at as a padded [rows, L] id tensor.
"""

from __future__ import annotations

import torch

from protoserve.engine.sampling.nucleus import keep_sorted
from protoserve.engine.sampling.sampling_params import host_only
from protoserve.engine.scheduling.sequence import Sequence

NEG_INF = float("-inf")


def batch_sampleable(seq: Sequence) -> bool:
    """The row needs nothing the batched operations leave out (sampling_params.SAMPLING_FIELDS)."""
    return seq.matcher is None and not host_only(seq.sampling, seq.num_generated)


def _padded_ids(lists: list[list[int]], device: torch.device) -> torch.Tensor:
    """[rows, longest] int64, padded with -1."""
    width = max((len(ids) for ids in lists), default=0)
    out = torch.full((len(lists), max(width, 1)), -1, dtype=torch.int64)
    for i, ids in enumerate(lists):
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out.to(device, non_blocking=True)


def _occurrences(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 counts of each token among a row's ids (padding -1 ignored)."""
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, torch.where(ids < 0, vocab, ids), torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (prompt and output tokens), then frequency/presence (output tokens), as
    engine/sampling/penalties.py does for one row."""
    device, vocab = logits.device, logits.shape[1]
    rep = [s.sampling.repetition_penalty for s in seqs]
    if any(r != 1.0 for r in rep):
        seen = _occurrences(_padded_ids([s.token_ids if r != 1.0 else [] for s, r in zip(seqs, rep, strict=True)],
                                        device), vocab) > 0
        penalty = torch.tensor(rep, dtype=torch.float32, device=device)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    freq = [s.sampling.frequency_penalty for s in seqs]
    pres = [s.sampling.presence_penalty for s in seqs]
    active = [(f != 0.0 or p != 0.0) and s.num_generated > 0 for s, f, p in zip(seqs, freq, pres, strict=True)]
    if any(active):
        counts = _occurrences(_padded_ids([s.output_token_ids if a else [] for s, a in zip(seqs, active, strict=True)],
                                          device), vocab)
        f = torch.tensor(freq, dtype=torch.float32, device=device)[:, None]
        p = torch.tensor(pres, dtype=torch.float32, device=device)[:, None]
        logits = logits - (f * counts + p * (counts > 0).float())
    return logits


def filtered(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of every (non-greedy) row, batched: the host sampler's
    ``apply_top_k`` / ``apply_top_p`` / ``apply_min_p`` per row."""
    device, vocab = logits.device, logits.shape[1]
    temps = torch.tensor([s.sampling.temperature for s in seqs], dtype=torch.float32, device=device)[:, None]
    cut = logits / temps
    ks = [s.sampling.top_k for s in seqs]
    if any(0 < k < vocab for k in ks):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in ks], dtype=torch.int64, device=device)
        kth = torch.sort(cut, dim=1, descending=True).values.gather(1, (k - 1)[:, None])
        cut = cut.masked_fill(cut < kth, NEG_INF)
    ps = [s.sampling.top_p for s in seqs]
    if any(p < 1.0 for p in ps):
        p = torch.tensor(ps, dtype=torch.float64, device=device)[:, None]
        desc, order = torch.sort(torch.softmax(cut, dim=1, dtype=torch.float64), dim=1, descending=True, stable=True)
        remove = ~keep_sorted(desc.cumsum(dim=1), p) & (p < 1.0)
        cut = cut.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), NEG_INF)
    min_ps = [s.sampling.min_p for s in seqs]
    if any(m > 0.0 for m in min_ps):
        m = torch.tensor(min_ps, dtype=torch.float32, device=device)[:, None]
        probs = torch.softmax(cut, dim=1)
        cut = cut.masked_fill((probs < m * probs.max(dim=1, keepdim=True).values) & (m > 0.0), NEG_INF)
    return cut


def draws(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """One inverse-CDF draw per row with one float64 uniform from each sequence's generator (the
    host sampler's ``draw``): [rows] int64 token ids."""
    u = torch.cat([torch.rand(1, generator=s.generator, dtype=torch.float64) for s in seqs])
    cdf = probs.to(torch.float64).cumsum(dim=1)
    target = (u.to(probs.device) * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[1] - 1)


def sample_batch(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The token of each row (every row ``batch_sampleable``), computed on the logits' device."""
    return sample_batch_tokens(logits, seqs).tolist()


def sample_batch_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``sample_batch``'s tokens as [rows] int64 on the logits' device, not waited for (async scheduling)."""
    rows = apply_penalties(logits.float(), seqs)
    greedy = [s.sampling.greedy for s in seqs]
    tokens = torch.argmax(rows, dim=1)
    random = [i for i, g in enumerate(greedy) if not g]
    if random:
        picked = [seqs[i] for i in random]
        index = torch.tensor(random, dtype=torch.int64, device=rows.device)
        cut = filtered(rows.index_select(0, index), picked)
        tokens = tokens.index_copy(0, index, draws(torch.softmax(cut, dim=1), picked))
    return tokens
