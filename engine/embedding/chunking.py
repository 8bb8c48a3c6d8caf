"""Where to cut a tokenized document into overlapping, window-sized chunks.

Pure planning over token indices; the model turns the ranges into text spans.
Cuts fall between words where they can: a chunk that starts inside a word
("##ie" of "unbelievably") re-tokenizes its text differently, and it embeds a
fragment no reader would write. A word longer than the space left is cut
inside, and every planned chunk is measured by re-tokenizing its text, so a
chunk never exceeds the window whatever the tokenizer does at a cut.

A long document is planned a slice of its text at a time (``plan_slice``): the
planner stops before the ranges that could reach past the slice, and the next
slice starts at the next range's first character. Only one slice's tokens are
in memory at once, and the work can stop between slices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TextChunk:
    """``text == document[start:end]`` (str character offsets); ``tokens`` counts [CLS]/[SEP] too."""

    start: int
    end: int
    text: str
    tokens: int


@dataclass(frozen=True)
class TokenRange:
    start: int  # first token index
    end: int  # one past the last token index
    tokens: int  # what the range's text re-tokenizes to, without specials


def word_firsts(word_ids: Sequence[int | None]) -> list[int]:
    """For each token, the index of the first token of its word (a token without a word is its own word)."""
    firsts: list[int] = []
    for i, word in enumerate(word_ids):
        same_word = i > 0 and word is not None and word == word_ids[i - 1]
        firsts.append(firsts[i - 1] if same_word else i)
    return firsts


@dataclass(frozen=True)
class SlicePlan:
    """The ranges planned in one slice, and where the next slice must start (None: the text is done)."""

    ranges: list[TokenRange]
    next_start: int | None  # token index in this slice of the next range's first token


def plan_chunks(
    word_ids: Sequence[int | None], window: int, overlap: int, measure: Callable[[int, int], int]
) -> list[TokenRange]:
    """Token ranges of at most ``window`` tokens covering every token, consecutive ones sharing ``overlap``.

    The overlap grows back to the start of the word it would cut, so it is
    ``overlap`` plus less than one word. Only when that word began at or before
    the previous range's start (an overlap close to the window, or a word
    longer than the step) does the next range start at the following word
    instead, or inside the word if none is left. ``measure(start, end)``
    re-tokenizes a range's text; a range it finds too long is shortened a token
    at a time. Starts and ends both strictly increase.
    """
    return plan_slice(word_ids, window, overlap, measure).ranges


def plan_slice(
    word_ids: Sequence[int | None],
    window: int,
    overlap: int,
    measure: Callable[[int, int], int],
    *,
    final: bool = True,
    previous_end: int = 0,
) -> SlicePlan:
    """``plan_chunks`` over one slice of a longer text, the slice starting at a range's first token.

    ``previous_end``: how many of the slice's first tokens the previous slice's last range covered.
    Unless ``final``, the slice was cut inside the text, so its last word may be cut too: planning
    stops before the first range that could reach that word, and ``next_start`` says where the
    next slice starts. A slice too short for one such range plans nothing (next_start 0).
    """
    if not 0 <= overlap < window:
        raise ValueError(f"overlap {overlap} must be in [0, window {window})")
    n = len(word_ids)
    firsts = word_firsts(word_ids)
    # Tokens from here on may belong to a word the slice's end cut: a range must end before it.
    reliable = n if final or not n else firsts[n - 1]
    ranges: list[TokenRange] = []
    start = 0
    while start < n:
        if start + window >= reliable and not final:
            return SlicePlan(ranges, start)
        end = min(start + window, n)
        # End between words unless that would leave no room to move past the overlap,
        # or add nothing to the previous range (a word longer than the window starts there).
        if end < n and firsts[end] - start > overlap and firsts[end] > previous_end:
            end = firsts[end]
        tokens = measure(start, end)
        while tokens > window:
            if end - 1 > max(previous_end, start):
                end -= 1
            elif start < previous_end:  # shortening would add nothing new: give up overlap instead
                start += 1
            else:
                raise RuntimeError(f"token {start} alone re-tokenizes to more than {window} tokens")
            tokens = measure(start, end)
        ranges.append(TokenRange(start, end, tokens))
        if end == n:
            break
        previous_end = end
        start = _next_start(firsts, start, end, overlap)
    return SlicePlan(ranges, None)


def _next_start(firsts: list[int], start: int, end: int, overlap: int) -> int:
    candidate = end - overlap
    if firsts[candidate] > start:
        return firsts[candidate]
    following = next((i for i in range(max(candidate, start) + 1, end) if firsts[i] == i), None)
    return following if following is not None else max(candidate, start + 1)


def drop_contained(chunks: list[TextChunk]) -> list[TextChunk]:
    """Drop chunks whose text span lies inside a neighbour's.

    Several tokens can share one character (a Hangul syllable the normalizer
    decomposes into jamo, a ligature), so two different token ranges cut inside
    such a character map to the same span edge; the smaller chunk adds nothing
    to retrieval. Word-aligned cuts never do this; cuts inside long words can.
    """
    kept: list[TextChunk] = []
    for chunk in chunks:
        keep_chunk(kept, chunk)
    return kept


def keep_chunk(kept: list[TextChunk], chunk: TextChunk) -> None:
    """Append ``chunk`` to ``kept`` as ``drop_contained`` would: one chunk at a time, as slices plan them."""
    if kept and chunk.end <= kept[-1].end:
        return
    while kept and kept[-1].start >= chunk.start:
        kept.pop()
    kept.append(chunk)
