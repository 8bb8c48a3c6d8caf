"""The RAG bench section's pure parts: its figures, text, vectors, recall and ITL ratio.

No model, no server: the section itself runs in ``make bench`` (``--only rag``).
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.context import BenchContext
from bench.profile import PROFILES
from bench.run import SECTIONS
from bench.sections import rag
from bench.timeline import RequestTimeline


def stream(sent: float, gaps: list[float]) -> RequestTimeline:
    t = RequestTimeline(sent)
    at = sent + 0.1
    t.add_chunk(at, 1)
    for gap in gaps:
        at += gap
        t.add_chunk(at, 1)
    t.finish(at)
    return t


def test_registered_with_its_figures_and_targets():
    assert SECTIONS["rag"] is rag.steps
    steps = rag.steps(BenchContext(PROFILES["default"]))
    names = [name for step in steps for name, _ in step.expects]
    search = [f"rag.search.{kind}.{{size}}.{q}" for kind in ("flat", "hnsw") for q in ("p50", "p99")] + [
        "rag.search.hnsw.{size}.recall_at_5",
        "rag.search.hnsw_vs_flat.{size}",
    ]
    assert names == [
        "rag.embed.protoserve", "rag.embed.st", "rag.embed.ratio",
        *[n.format(size="10k") for n in search], *[n.format(size="100k") for n in search],
        "rag.itl_p99.idle", "rag.itl_p99.indexing", "rag.itl_p99_ratio",
        "rag.tenant_search_p99.idle", "rag.tenant_search_p99.uploading", "rag.tenant_search_p99_ratio",
    ]  # fmt: skip
    assert rag.EMBED_TARGET.met(1.0) and not rag.EMBED_TARGET.met(0.99)
    assert rag.ITL_TARGET.met(1.5) and not rag.ITL_TARGET.met(1.51)
    assert rag.SEARCH_TARGET.met(3.0) and not rag.SEARCH_TARGET.met(3.01)


def test_smoke_profile_uses_small_stores():
    steps = rag.steps(BenchContext(PROFILES["smoke"]))
    names = {name for step in steps for name, _ in step.expects}
    assert "rag.search.flat.2k.p50" in names and "rag.search.hnsw.5k.recall_at_5" in names
    assert not any(".100k." in name for name in names)


@pytest.mark.parametrize(("n", "label"), [(10_000, "10k"), (100_000, "100k"), (2_000, "2k"), (2_500, "2500")])
def test_size_labels(n, label):
    assert rag.size_label(n) == label


def test_abba_alternates_which_side_goes_first():
    assert [rag.abba(r) for r in range(4)] == [(True, False), (False, True)] * 2


def test_vocabulary_words_keep_whole_words_in_id_order():
    vocab = {"[CLS]": 101, "the": 1996, "##ing": 2075, "of": 1997, "3": 1017, "café": 5000, "a": 1037}
    assert rag.vocabulary_words(vocab) == ["a", "the", "of"]


def test_english_like_text_is_seeded_and_shaped_like_prose():
    words = [f"w{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(300)]
    text = rag.english_like_text(words, 2000, seed=3)
    assert text == rag.english_like_text(words, 2000, seed=3)
    assert text != rag.english_like_text(words, 2000, seed=4)
    assert len(text.replace(",", "").replace(".", "").split()) == 2000
    sentences = [s for p in text.split("\n\n") for s in p.split(". ")]
    assert all(s[0].isupper() for s in sentences) and text.endswith(".")
    assert 2000 / 22 < len(sentences) < 2000 / 5
    assert "\n\n" in text
    counts = {w: text.lower().split().count(w) for w in (words[0], words[-1])}
    assert counts[words[0]] > 5 * max(1, counts[words[-1]])  # frequent words come first


def test_english_like_text_refuses_bad_input():
    with pytest.raises(ValueError, match="words"):
        rag.english_like_text([], 10, 0)
    with pytest.raises(ValueError, match="n_words"):
        rag.english_like_text(["a"], 0, 0)


def test_embedding_like_vectors_are_unit_seeded_and_low_rank():
    rng = np.random.default_rng(0)
    basis = rng.standard_normal((8, 64), dtype=np.float32)
    a = rag.embedding_like_vectors(np.random.default_rng(1), 500, basis, 0.0)
    b = rag.embedding_like_vectors(np.random.default_rng(1), 500, basis, 0.0)
    assert a.dtype == np.float32 and a.shape == (500, 64)
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    np.testing.assert_array_equal(a, b)
    assert np.linalg.matrix_rank(a, tol=1e-3) == 8
    noisy = rag.embedding_like_vectors(np.random.default_rng(1), 500, basis, 0.3)
    assert np.linalg.matrix_rank(noisy, tol=1e-3) == 64


def test_recall_is_the_mean_share_found():
    exact = [{1, 2, 3, 4, 5}, {6, 7, 8, 9, 10}]
    assert rag.recall(exact, exact) == 1.0
    assert rag.recall(exact, [{1, 2, 3, 4, 99}, {6, 7, 98, 97, 96}]) == pytest.approx((0.8 + 0.4) / 2)
    with pytest.raises(ValueError):
        rag.recall(exact, exact[:1])


def test_itl_figures_divide_busy_p99_by_idle_p99():
    idle = [[stream(0.0, [0.01] * 50) for _ in range(2)]]
    busy = [[stream(10.0, [0.01] * 40 + [0.03] * 10) for _ in range(2)]]
    index = rag.IndexOutcome(documents=4, chunks=40, tokens=8000, seconds=8.0)
    idle_fig, busy_fig, ratio = rag.itl_figures(idle, busy, index)
    assert (idle_fig.name, busy_fig.name, ratio.name) == (rag.IDLE_NAME, rag.BUSY_NAME, rag.ITL_RATIO_NAME)
    assert idle_fig.value == pytest.approx(0.01)
    assert busy_fig.value == pytest.approx(0.03)
    assert ratio.value == pytest.approx(3.0) and ratio.met is False
    assert busy_fig.details["index_chunks_per_s"] == 5.0 and busy_fig.details["rounds"] == 1
    assert busy_fig.details["rounds_s"] == pytest.approx(0.8) and busy_fig.details["itl_max_ms"] == 30.0


def test_itl_figures_need_a_round_beside_indexing_and_clean_streams():
    idle = [[stream(0.0, [0.01] * 10)]]
    index = rag.IndexOutcome(1, 1, 100, 0.5)
    with pytest.raises(RuntimeError, match="before a round"):
        rag.itl_figures(idle, [], index)
    failed = stream(0.0, [0.01] * 10)
    failed.fail(2.0, "UNAVAILABLE: gone")
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        rag.itl_figures(idle, [[failed]], index)


def test_tenant_search_figures_divide_busy_p99_by_idle_p99():
    idle = [0.02] * 99 + [0.03]
    busy = [0.03] * 98 + [0.06, 0.09]
    upload = rag.UploadOutcome(bytes=4_000_000, seconds=21.5)
    idle_fig, busy_fig, ratio = rag.tenant_search_figures(idle, busy, upload)
    assert (idle_fig.name, busy_fig.name, ratio.name) == (
        rag.SEARCH_IDLE_NAME,
        rag.SEARCH_BUSY_NAME,
        rag.SEARCH_RATIO_NAME,
    )
    assert ratio.value == pytest.approx(busy_fig.value / idle_fig.value)
    assert busy_fig.details["searches"] == 100 and busy_fig.details["upload_bytes"] == 4_000_000
    with pytest.raises(RuntimeError, match="before a search beside it"):
        rag.tenant_search_figures(idle, [], upload)


def test_the_upload_is_just_under_a_document_cap():
    from protoserve.server.limits import MAX_DOCUMENT_BYTES

    text = rag.upload_text(["alpha", "beta", "gamma", "delta"], seed=1)
    assert MAX_DOCUMENT_BYTES - 4096 < len(text.encode()) <= MAX_DOCUMENT_BYTES
