"""Fixtures for the embedding tests: our model, the sentence-transformers reference, varied texts.

``embedding_model`` -> EmbeddingModel (the packaged all-MiniLM-L6-v2), loaded once per session.
``reference_model`` -> SentenceTransformer on the same directory, CPU (the test oracle only).
``varied_texts`` -> 200 texts: short to full-window, punctuation, numbers, accents, CJK,
emoji, control and odd whitespace, mixed case; every one fits the 256-token window.
"""

from __future__ import annotations

import random

import pytest

from protoserve.engine.embedding.default_model import default_embedding_model_dir
from protoserve.engine.embedding.model import EmbeddingModel

WORDS = (
    "retrieval augmented generation server token window chunk vector index query latency "
    "throughput embedding document The QUICK brown Fox jumps over lazy dogs Paris Zürich "
    "naïve café résumé façade Ærøskøbing Łódź Ελληνικά русский текст 日本語 中文 한국어 "
    "नमस्ते مرحبا 😀 🚀 👍🏽 🇫🇷 ∑ ≠ √2 x² ½ ﬁne e\u0301 C++ foo_bar snake-case CamelCase "
    "http://example.com/a?b=c user@mail.org #hashtag @mention 3.14159 -42 1,000,000 2024-01-31 "
    "12:30 $99.99 100% (parens) [brackets] {braces} 'quote' \"dq\" ... !? ; : / \\ | ~"
).split()
SEPARATORS = (" ", " ", " ", "  ", "\t", "\n", " \n\n ", "\u00a0", "\u200b", "\r\n", ", ", ". ")


def _make_text(rng: random.Random, n_words: int) -> str:
    parts = []
    for _ in range(n_words):
        word = rng.choice(WORDS)
        word = word.upper() if rng.random() < 0.1 else word
        parts.append(word + rng.choice(SEPARATORS))
    text = "".join(parts)
    if rng.random() < 0.2:
        text = rng.choice(("  ", "\n", "\t ")) + text
    if rng.random() < 0.1:
        text = text.replace(" ", "\x07", 1)  # a control character the normalizer drops
    return text


@pytest.fixture(scope="session")
def embedding_model() -> EmbeddingModel:
    return EmbeddingModel.load()


@pytest.fixture(scope="session")
def reference_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(default_embedding_model_dir()), device="cpu")


@pytest.fixture(scope="session")
def varied_texts(reference_model) -> list[str]:
    rng = random.Random(1234)
    texts = ["a", "Hello, World!", "", "   ", "12345", "😀", "日本語のテキストです。", "ÀÉÎÕÜ àéîõü"]
    while len(texts) < 200:
        # Mostly short (queries), some paragraphs, a few close to the window.
        n_words = rng.choice((1, 2, 3, 5, 8, 12, 20, 30, 50, 80, 120, 200))
        texts.append(_make_text(rng, n_words))
    # Trim each to the window by the reference tokenizer, so sentence-transformers never truncates.
    tokenizer = reference_model.tokenizer
    fitted = []
    for text in texts:
        while len(tokenizer(text, truncation=False)["input_ids"]) > 256:
            text = text[: int(len(text) * 0.97)]
        fitted.append(text)
    return fitted
