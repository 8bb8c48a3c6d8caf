"""Top-p over a real vocabulary size: the candidate search keeps exactly the set a full sort keeps,
the batched rows keep the same set as the host row, and both match transformers' TopPLogitsWarper."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from protoserve.engine.sampling import nucleus
from protoserve.engine.sampling.batched import filtered
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.sequence import Sequence

VOCAB = 49152  # SmolLM2's


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def full_sort_nucleus(logits: torch.Tensor, p: float) -> set[int]:
    """The rule on the whole vocabulary sorted once: descending, ties by token id."""
    probs = torch.softmax(logits, dim=0, dtype=torch.float64)
    desc, order = torch.sort(probs, descending=True, stable=True)
    return set(order[nucleus.keep_sorted(desc.cumsum(dim=0), p)].tolist())


def rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(28)
    peaked = torch.randn(VOCAB, generator=g) * 3
    sharp = torch.randn(VOCAB, generator=g) * 8
    flat = torch.zeros(VOCAB)  # every token ties: the nucleus is the first ceil(p * V) ids
    top_k_cut = torch.full((VOCAB,), float("-inf"))  # a top-k filter ran first: 40 finite logits
    top_k_cut[torch.randperm(VOCAB, generator=g)[:40]] = torch.randn(40, generator=g)
    plateau = torch.randn(VOCAB, generator=g) - 20  # 300 tokens tied at the top, the boundary among them
    plateau[torch.randperm(VOCAB, generator=g)[:300]] = 5.0
    wide = torch.randn(VOCAB, generator=g) * 0.5  # mass spread thin: the search must grow past its first guess
    return {"peaked": peaked, "sharp": sharp, "flat": flat, "top_k_cut": top_k_cut, "plateau": plateau,
            "wide": wide}


@pytest.mark.parametrize("p", [0.01, 0.5, 0.9, 0.95, 0.999999])
@pytest.mark.parametrize("name", ["peaked", "sharp", "flat", "top_k_cut", "plateau", "wide"])
def test_candidate_search_keeps_the_full_sort_set(name, p):
    logits = rows()[name]
    out = nucleus.apply_top_p(logits.clone(), p)
    assert kept(out) == full_sort_nucleus(logits, p)
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])  # kept logits untouched


def test_the_candidate_search_grows_when_the_first_guess_is_short():
    logits = rows()["wide"]
    probs = torch.softmax(logits, dim=0, dtype=torch.float64)
    assert float(torch.topk(probs, nucleus.FIRST_CANDIDATES).values.sum()) < 0.9  # the case is what it claims
    assert len(kept(nucleus.apply_top_p(logits, 0.9))) > nucleus.FIRST_CANDIDATES


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.95])
def test_matches_transformers_top_p(p):
    for name in ("peaked", "sharp", "wide"):
        logits = rows()[name]
        theirs = TopPLogitsWarper(p)(None, logits.clone()[None])[0]
        assert kept(nucleus.apply_top_p(logits.clone(), p)) == kept(theirs), name


def test_batched_rows_keep_the_host_rows_set():
    table = rows()
    names = list(table)
    ps = [0.5, 0.9, 1.0, 0.95, 0.999999, 0.3]
    seqs = [
        Sequence(seq_id=i, request_id=f"r{i}", index=0, token_ids=[1], num_prompt_tokens=1, max_len=10,
                 sampling=SamplingParams(temperature=1.0, top_p=p), generator=torch.Generator())
        for i, p in enumerate(ps)
    ]
    batch = filtered(torch.stack([table[n] for n in names]), seqs)
    for i, (name, p) in enumerate(zip(names, ps, strict=True)):
        assert kept(batch[i]) == kept(nucleus.apply_top_p(table[name].clone(), p)), name


def test_p_of_one_leaves_the_row():
    logits = rows()["peaked"]
    assert nucleus.apply_top_p(logits, 1.0) is logits
