"""EmbeddingModel.chunk and the pure planner: exact offsets, window fit, overlap, full coverage."""

from __future__ import annotations

import random

import pytest

from protoserve.engine.embedding.chunking import (
    TextChunk,
    TokenRange,
    drop_contained,
    plan_chunks,
    word_firsts,
)

UNICODE_DOC = (
    "Zürich's café served crème brûlée — naïve façade, Ærøskøbing & Łódź.\n\n"
    "日本語の文章はスペースなしで書かれます。中文也一样。한국어 문장도 있습니다.\n"
    "Emoji 😀🚀👍🏽 🇫🇷 and math ∑ x² ≠ √2, ½ ﬁne, decomposed e\u0301 and İstanbul.\t"
    "Control\x07chars and\u200bzero-width and\u00a0nbsp; URL http://example.com/path?q=1&r=2 ok. "
)


def _document(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    words = (
        "retrieval augmented generation servers tokenize unbelievably long documents into chunks "
        "the of and a an vector index 3.14159 2024-01-31 C++ foo_bar"
    ).split()
    parts = [UNICODE_DOC]
    for _ in range(n_words):
        parts.append(rng.choice(words) + rng.choice((" ", " ", ", ", ". ", "\n", "  ")))
    return "".join(parts) + UNICODE_DOC


def _token_spans(reference_model, text: str):
    """(offsets, word_ids) of text's tokens, without specials, from the Hugging Face tokenizer."""
    encoded = reference_model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoded["offset_mapping"], encoded.word_ids()


def _token_ranges(chunks, offsets) -> list[tuple[int, int]]:
    """Each chunk's [first, last + 1) token index in the whole text's tokenization."""
    ranges = []
    for c in chunks:
        inside = [i for i, (s, e) in enumerate(offsets) if s >= c.start and e <= c.end and e > s]
        assert inside == list(range(inside[0], inside[-1] + 1))
        ranges.append((inside[0], inside[-1] + 1))
    return ranges


@pytest.mark.parametrize(
    ("chunk_tokens", "overlap", "n_words", "exact_overlap"),
    [(256, 32, 600, True), (32, 8, 300, True), (16, 0, 300, True), (40, 37, 100, False)],
)
# Overlap 37 of a 38-token window leaves no room to move by whole words: chunks then start
# at the next word or inside one, and the overlap is smaller (never a gap).
def test_chunks_are_exact_fitting_overlapping_and_complete(
    embedding_model, reference_model, chunk_tokens, overlap, n_words, exact_overlap
):
    text = _document(seed=chunk_tokens, n_words=n_words)
    chunks = embedding_model.chunk(text, chunk_tokens=chunk_tokens, overlap_tokens=overlap)
    assert len(chunks) >= 3

    for c in chunks:
        assert text[c.start : c.end] == c.text
        assert c.text == c.text.strip()  # a chunk starts and ends on a token
    counts = embedding_model.count_tokens([c.text for c in chunks])
    assert counts == [c.tokens for c in chunks]
    assert max(counts) <= chunk_tokens
    assert max(counts) >= chunk_tokens - 8  # chunks are filled, not merely small

    offsets, word_ids = _token_spans(reference_model, text)
    # Every token of the text lies inside some chunk.
    assert all(any(c.start <= s and e <= c.end for c in chunks) for s, e in offsets)
    for c, following in zip(chunks, chunks[1:], strict=False):
        assert c.start < following.start and c.end < following.end
        assert (following.start < c.end) == (overlap > 0)

    if exact_overlap:
        firsts = word_firsts(word_ids)
        ranges = _token_ranges(chunks, offsets)
        assert ranges[0][0] == 0 and ranges[-1][1] == len(offsets)
        for (_, end), (next_start, _) in zip(ranges, ranges[1:], strict=False):
            # `overlap` tokens, grown back to the start of the word that would be cut.
            assert next_start == firsts[end - overlap]
            assert end - next_start >= overlap


def test_unicode_offsets_are_str_characters(embedding_model):
    chunks = embedding_model.chunk(UNICODE_DOC * 3, chunk_tokens=16, overlap_tokens=4)
    assert any("日本語" in c.text for c in chunks)
    for c in chunks:
        assert (UNICODE_DOC * 3)[c.start : c.end] == c.text
    assert chunks[0].start == 0 and chunks[0].text.startswith("Zürich")
    assert chunks[-1].end == len((UNICODE_DOC * 3).rstrip())


def test_full_window_chunks_embed(embedding_model):
    text = _document(seed=7, n_words=700)
    chunks = embedding_model.chunk(text)  # defaults: 256 tokens, 32 overlap
    assert 250 <= max(c.tokens for c in chunks) <= 256
    vectors = embedding_model.embed_texts([c.text for c in chunks[:3]])  # would raise if one overflowed
    assert vectors.shape == (3, 384)


def test_words_longer_than_the_window_are_cut_and_still_fit(embedding_model, reference_model):
    rng = random.Random(3)
    gibberish = " ".join("".join(rng.choice("qxzjkvwy") for _ in range(60)) for _ in range(6))
    text = f"start {gibberish} end"
    offsets, _ = _token_spans(reference_model, text)
    chunks = embedding_model.chunk(text, chunk_tokens=16, overlap_tokens=2)
    assert all(text[c.start : c.end] == c.text for c in chunks)
    assert max(embedding_model.count_tokens([c.text for c in chunks])) <= 16
    ranges = _token_ranges(chunks, offsets)
    assert set().union(*(range(s, e) for s, e in ranges)) == set(range(len(offsets)))


def test_short_and_empty_texts(embedding_model):
    assert embedding_model.chunk("") == []
    assert embedding_model.chunk(" \n\t\u00a0 ") == []
    [only] = embedding_model.chunk("  Hello world.  ")
    assert (only.start, only.end, only.text, only.tokens) == (2, 14, "Hello world.", 5)


def test_argument_validation(embedding_model):
    for bad in (15, 257, 0):
        with pytest.raises(ValueError, match="chunk_tokens"):
            embedding_model.chunk("text", chunk_tokens=bad)
    for bad in (-1, 30, 31):
        with pytest.raises(ValueError, match="overlap_tokens"):
            embedding_model.chunk("text", chunk_tokens=32, overlap_tokens=bad)
    embedding_model.chunk("text", chunk_tokens=32, overlap_tokens=29)  # the largest allowed
    with pytest.raises(ValueError, match="chunk_tokens"):
        embedding_model.chunk("text", chunk_tokens=32.0)
    with pytest.raises(TypeError, match="text must be str"):
        embedding_model.chunk(b"bytes")


def test_planner_shortens_a_range_that_retokenizes_longer():
    word_ids = list(range(40))  # every token its own word

    def measure(start: int, end: int) -> int:
        # Pretend a cut at token 10 re-tokenizes 3 tokens longer.
        return end - start + (3 if start < 10 < end else 0)

    ranges = plan_chunks(word_ids, window=12, overlap=2, measure=measure)
    assert ranges[0] == TokenRange(0, 10, 10)  # shortened until the cut at 10 is outside
    assert ranges[1] == TokenRange(8, 17, 12)  # 12 tokens + 3 did not fit, 9 + 3 does
    assert all(r.tokens <= 12 for r in ranges)
    assert [r.start for r in ranges] == [0, 8, 15, 25, 35]
    assert ranges[-1].end == 40


def test_planner_keeps_words_whole_when_it_can():
    # Words of 3 tokens: [0,1,2] [3,4,5] ...
    word_ids = [i // 3 for i in range(30)]
    ranges = plan_chunks(word_ids, window=10, overlap=2, measure=lambda s, e: e - s)
    assert [(r.start, r.end) for r in ranges] == [(0, 9), (6, 15), (12, 21), (18, 27), (24, 30)]


def test_drop_contained_keeps_increasing_spans():
    def span(start: int, end: int) -> TextChunk:
        return TextChunk(start, end, "", 0)

    # (3, 10) lies inside (0, 10); (5, 12) inside (5, 15), which starts at the same character.
    chunks = [span(0, 10), span(3, 10), span(5, 12), span(5, 15), span(12, 20)]
    assert drop_contained(chunks) == [span(0, 10), span(5, 15), span(12, 20)]


def test_planner_cuts_a_word_longer_than_the_window():
    # Words: 4 one-token words, a 3-token word (4-6), a 20-token word (7-26), two more words.
    word_ids = [0, 1, 2, 3, 4, 4, 4] + [5] * 20 + [6, 7]
    ranges = plan_chunks(word_ids, window=9, overlap=2, measure=lambda s, e: e - s)
    # (4, 7) would add nothing after (0, 7): the second range cuts into the long word instead.
    assert [(r.start, r.end) for r in ranges] == [(0, 7), (4, 13), (7, 16), (14, 23), (21, 29)]
