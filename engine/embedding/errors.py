"""The error for an input that does not fit the embedding model's window."""

from __future__ import annotations

from protoserve.engine.errors import ContextLengthError


class EmbeddingInputTooLong(ContextLengthError):
    """Input ``index`` has ``tokens`` tokens (with [CLS]/[SEP]) but the window holds ``max_tokens``.

    Embeddings never truncate silently: a vector of a cut text would stand for
    text the caller did not ask about. A ContextLengthError, so the server maps
    it like a prompt that overflows an LLM's window.
    """

    def __init__(self, index: int, tokens: int, max_tokens: int) -> None:
        self.index = index
        self.tokens = tokens
        self.max_tokens = max_tokens
        super().__init__(
            tokens,
            max_tokens,
            f"input {index} has {tokens} tokens but the embedding model's window is {max_tokens} tokens "
            "(including [CLS] and [SEP]); chunk it first",
        )


class TooManyChunks(ValueError):
    """A document would make more than ``max_chunks`` chunks; chunking stopped there.

    Raised as soon as the count passes the cap, so a document that small chunks and a large overlap
    would cut into tens of thousands of pieces costs no more than the cap's worth of planning.
    """

    def __init__(self, max_chunks: int) -> None:
        self.max_chunks = max_chunks
        super().__init__(f"the text makes more than {max_chunks} chunks")
