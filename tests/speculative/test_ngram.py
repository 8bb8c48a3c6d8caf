"""Prompt-lookup drafting and the speculative options' validation."""

from __future__ import annotations

from protoserve.engine.speculative.ngram import propose_ngram
from protoserve.engine.speculative.params import SpeculativeParams


def test_longest_suffix_wins_over_a_later_shorter_match():
    # Suffix [1, 2, 3] occurs at 0..2 (followed by 4, 5); the 1-gram [3] recurs later at 6 (followed by 9).
    tokens = [1, 2, 3, 4, 5, 7, 3, 9, 1, 2, 3]
    assert propose_ngram(tokens, k=2, min_n=1, max_n=3) == [4, 5]
    assert propose_ngram(tokens, k=2, min_n=1, max_n=1) == [9, 1]


def test_most_recent_occurrence_and_k_cap():
    tokens = [5, 6, 7, 5, 6, 8, 8, 5, 6]
    assert propose_ngram(tokens, k=1, min_n=2, max_n=2) == [8]
    assert propose_ngram(tokens, k=5, min_n=2, max_n=2) == [8, 8, 5, 6]


def test_no_match_or_too_short():
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []
    assert propose_ngram([1], k=3, min_n=1, max_n=3) == []
    assert propose_ngram([1, 2, 1, 2], k=3, min_n=3, max_n=3) == []  # [2,1,2] never occurred before
    assert propose_ngram([1, 2, 1, 2], k=0, min_n=1, max_n=3) == []


def test_match_may_overlap_the_suffix():
    # A run: the suffix [7, 7] matches at 1..2 (overlapping it), and what followed is [7].
    assert propose_ngram([7, 7, 7, 7], k=3, min_n=2, max_n=2) == [7]
    assert propose_ngram([7, 7, 7, 7], k=3, min_n=1, max_n=1) == [7]


def test_params_validation_names_fields():
    assert SpeculativeParams().validate() == []
    assert SpeculativeParams(method="off").validate() == []
    assert [f for f, _ in SpeculativeParams(method="eagle").validate()] == ["speculative.method"]
    bad = SpeculativeParams(num_speculative_tokens=0, prompt_lookup_min=3, prompt_lookup_max=2).validate()
    assert [f for f, _ in bad] == ["speculative.num_speculative_tokens", "speculative.prompt_lookup_max"]
    assert [f for f, _ in SpeculativeParams(prompt_lookup_min=0).validate()] == ["speculative.prompt_lookup_min"]
