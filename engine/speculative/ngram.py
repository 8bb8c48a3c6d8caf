"""Prompt-lookup (n-gram) drafting, as vLLM's ``ngram`` method: no second model.

The sequence's last ``n`` tokens are looked up earlier in its own prompt and output,
longest ``n`` first; the tokens that followed the most recent earlier occurrence are
the draft. Text that quotes its context (summaries, edits, RAG answers) drafts well.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


def propose_ngram(token_ids: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the longest suffix n-gram,
    ``n`` from ``max_n`` down to ``min_n``; empty when no suffix of those sizes recurs."""
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Candidate starts: earlier positions holding the suffix's first token for the largest n; a
    # smaller n's matches are found by the same scan, so one pass over the last token's occurrences.
    last = tokens[-1]
    ends = np.flatnonzero(tokens[:-1] == last)  # positions j where tokens[j] == last, j < length - 1
    if ends.size == 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # A match ending at j covers tokens[j - n + 1 : j + 1]; it must start at 0 or later.
        for j in ends[::-1]:  # most recent first
            start = j - n + 1
            if start < 0:
                continue
            if np.array_equal(tokens[start : j + 1], suffix):
                return tokens[j + 1 : j + 1 + k].tolist()
    return []
