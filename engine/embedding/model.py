"""EmbeddingModel: tokenizer + BERT encoder + pooling, as a sentence-transformers directory specifies them.

Produces the same vectors as ``SentenceTransformer(directory).encode(...)``
without importing ``transformers``: the tokenizer is the directory's
``tokenizer.json`` run by the ``tokenizers`` library, the encoder is
``bert.py``. Unlike sentence-transformers, an input longer than the window is
an error (EmbeddingInputTooLong), never truncated: callers chunk documents
with ``chunk`` first.

Texts are embedded in micro-batches sorted by length, so each batch pads to a
length close to its members' and padding costs little compute. Torch runs
with whatever thread count the process configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Encoding, Tokenizer

from protoserve.engine.embedding.bert import BertEncoder, load_bert
from protoserve.engine.embedding.chunking import TextChunk, drop_contained, plan_chunks
from protoserve.engine.embedding.default_model import DEFAULT_EMBEDDING_NAME, default_embedding_model_dir
from protoserve.engine.embedding.errors import EmbeddingInputTooLong
from protoserve.engine.embedding.layout import SentenceModelLayout, read_layout
from protoserve.engine.embedding.pooling import l2_normalize, pool
from protoserve.engine.execution.compute_gate import CPU_GATE
from protoserve.engine.loader.errors import ModelLoadError

__all__ = ["EmbeddingInputTooLong", "EmbeddingModel", "TextChunk"]

DEFAULT_BATCH_SIZE = 32
# Padded tokens per forward. Each encoder layer of a forward takes one turn at the cores the engine's
# decode loop shares (CPU_GATE), so while the engine decodes, a forward is one window's worth: a decode
# step then waits at most one layer over one chunk. Idle, larger forwards use the cores better.
BUSY_UNIT_TOKENS = 256
IDLE_UNIT_TOKENS = 4096
MIN_CHUNK_TOKENS = 16


def _load_tokenizer(path: Path) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for missing or malformed files
        raise ModelLoadError(path, f"cannot load tokenizer: {e}") from e
    # tokenizer.json may carry the training setup (all-MiniLM-L6-v2's truncates and pads to 128):
    # lengths here must be the text's own, and padding is ours.
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _special_ids(tokenizer: Tokenizer, path: Path) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a single sequence ([CLS] / [SEP] for BERT)."""
    encoding = tokenizer.encode("a", add_special_tokens=True)
    content = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
    if not content:
        raise ModelLoadError(path, "the tokenizer produced no token for the text 'a'")
    return encoding.ids[: content[0]], encoding.ids[content[-1] + 1 :]


def check_texts(texts: Sequence[str], field: str = "texts") -> None:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise TypeError(f"{field} must be a list of str, got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{field}[{i}] must be str, got {type(text).__name__}")


def _check_batch_size(batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")


class EmbeddingModel:
    """One loaded sentence-embedding model. Thread-safe for concurrent calls (no mutable state)."""

    def __init__(
        self,
        name: str,
        encoder: BertEncoder,
        tokenizer: Tokenizer,
        layout: SentenceModelLayout,
        max_tokens: int,
        special_ids: tuple[list[int], list[int]],
    ) -> None:
        self.name = name
        self.dimensions = encoder.config.hidden_size
        self.max_tokens = max_tokens
        self.vocab_size = encoder.config.vocab_size
        self._encoder = encoder
        self._tokenizer = tokenizer
        self._layout = layout
        self._prefix_ids, self._suffix_ids = special_ids
        # Tokens the tokenizer adds around every text ([CLS] and [SEP]: 2).
        self.special_tokens = len(self._prefix_ids) + len(self._suffix_ids)

    @classmethod
    def load(cls, path: str | Path | None = None) -> EmbeddingModel:
        """Load a sentence-transformers directory; None = the packaged all-MiniLM-L6-v2."""
        directory = default_embedding_model_dir() if path is None else Path(path)
        if not directory.is_dir():
            raise ModelLoadError(
                directory, "not a directory: an embedding model is a sentence-transformers directory"
            )
        layout = read_layout(directory)
        encoder = load_bert(
            layout.transformer_dir / "config.json", layout.transformer_dir / "model.safetensors"
        )
        config = encoder.config
        if layout.pooling_dimension is not None and layout.pooling_dimension != config.hidden_size:
            raise ModelLoadError(
                directory,
                f"pooling word_embedding_dimension {layout.pooling_dimension} != encoder hidden_size "
                f"{config.hidden_size}",
            )
        max_tokens = layout.max_seq_length or config.max_positions
        if max_tokens > config.max_positions:
            raise ModelLoadError(
                directory,
                f"max_seq_length {max_tokens} exceeds max_position_embeddings {config.max_positions}",
            )
        tokenizer_path = layout.transformer_dir / "tokenizer.json"
        tokenizer = _load_tokenizer(tokenizer_path)
        if tokenizer.get_vocab_size(with_added_tokens=True) > config.vocab_size:
            raise ModelLoadError(
                tokenizer_path,
                f"the tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, "
                f"more than the encoder's vocab_size {config.vocab_size}",
            )
        is_default = path is None or directory.resolve() == _default_dir_or_none()
        name = DEFAULT_EMBEDDING_NAME if is_default else directory.resolve().name
        return cls(name, encoder, tokenizer, layout, max_tokens, _special_ids(tokenizer, tokenizer_path))

    # --- tokens -------------------------------------------------------------------------------

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text takes in the window, [CLS]/[SEP] included; nothing is truncated."""
        check_texts(texts)
        return [len(e.ids) for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text without [CLS]/[SEP] (what ``embed_token_ids`` takes)."""
        check_texts(texts)
        return [e.ids for e in self._tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    # --- embeddings ---------------------------------------------------------------------------

    def embed_texts(self, texts: list[str], batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """float32 [len(texts), dimensions]; EmbeddingInputTooLong for the first text over the window."""
        check_texts(texts)
        _check_batch_size(batch_size)
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=True)
        ids = [e.ids for e in encodings]
        self._check_lengths(ids, extra=0)
        return self._embed(ids, batch_size)

    def embed_token_ids(self, ids: list[list[int]], batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        """Like embed_texts for pre-tokenized input: ids without specials, [CLS]/[SEP] are added here."""
        _check_batch_size(batch_size)
        self.check_token_ids(ids)
        return self._embed([self._prefix_ids + list(row) + self._suffix_ids for row in ids], batch_size)

    def check_token_ids(self, ids: list[list[int]]) -> None:
        """The checks embed_token_ids makes: ints in the vocabulary, each row fitting the window with specials."""
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"ids must be a list of lists of int, got {type(ids).__name__}")
        for i, row in enumerate(ids):
            self._check_id_row(i, row)
        self._check_lengths(ids, extra=self.special_tokens)

    def _check_id_row(self, index: int, row: Sequence[int]) -> None:
        if not isinstance(row, Sequence) or isinstance(row, str | bytes):
            raise TypeError(f"ids[{index}] must be a list of int, got {type(row).__name__}")
        for j, token in enumerate(row):
            if not isinstance(token, int | np.integer) or isinstance(token, bool):
                raise TypeError(f"ids[{index}][{j}] must be an int, got {type(token).__name__}")
            if not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"ids[{index}][{j}] = {token} is outside the vocabulary [0, {self.vocab_size})"
                )

    def _check_lengths(self, rows: Sequence[Sequence[int]], extra: int) -> None:
        for i, row in enumerate(rows):
            if len(row) + extra > self.max_tokens:
                raise EmbeddingInputTooLong(i, len(row) + extra, self.max_tokens)

    def _embed(self, ids: list[list[int]], batch_size: int) -> np.ndarray:
        out = np.empty((len(ids), self.dimensions), dtype=np.float32)
        # Longest first (as sentence-transformers does): a batch pads only to its own longest member.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        lengths = [len(ids[i]) for i in order]
        at = 0
        while at < len(order):
            # Sized as each forward starts, so a forward begun while the engine idles is the only big one.
            unit = BUSY_UNIT_TOKENS if CPU_GATE.engine_active() else IDLE_UNIT_TOKENS
            batch = _first_batch(order[at:], lengths[at:], batch_size, unit)
            out[batch] = self._forward([ids[i] for i in batch]).numpy()
            at += len(batch)
        return out

    @torch.inference_mode()
    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in rows)
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            input_ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[r, : len(row)] = 1
        # One layer at a time, each a turn at the cores the engine's decode loop shares (CPU_GATE).
        encoder = self._encoder
        key_mask = mask.bool()[:, None, None, :]
        with CPU_GATE.background():
            hidden = encoder.embeddings(input_ids)
        for layer in encoder.layers:
            with CPU_GATE.background():
                hidden = layer(hidden, key_mask)
        vectors = pool(hidden, mask, self._layout.pooling)
        if self._layout.normalize:
            vectors = l2_normalize(vectors)
        return vectors.float()

    # --- chunking -----------------------------------------------------------------------------

    def chunk(self, text: str, chunk_tokens: int = 256, overlap_tokens: int = 32) -> list[TextChunk]:
        """Cut ``text`` into chunks that each fit ``chunk_tokens`` with [CLS]/[SEP], overlapping by
        ``overlap_tokens`` tokens (extended back to a word start rather than cutting a word).

        ``chunk.text == text[chunk.start:chunk.end]``, from the first token's
        first character to the last token's last (str offsets). Text that
        tokenizes to nothing (empty, whitespace) gives [].
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        self._check_chunk_args(chunk_tokens, overlap_tokens)
        encoding: Encoding = self._tokenizer.encode(text, add_special_tokens=False)
        # The Python binding reports offsets in str characters, not UTF-8 bytes.
        offsets = encoding.offsets
        if not offsets:
            return []

        def span(start: int, end: int) -> str:
            return text[offsets[start][0] : offsets[end - 1][1]]

        def measure(start: int, end: int) -> int:
            return len(self._tokenizer.encode(span(start, end), add_special_tokens=False).ids)

        window = chunk_tokens - self.special_tokens
        ranges = plan_chunks(encoding.word_ids, window, overlap_tokens, measure)
        return drop_contained(
            [
                TextChunk(
                    offsets[r.start][0],
                    offsets[r.end - 1][1],
                    span(r.start, r.end),
                    r.tokens + self.special_tokens,
                )
                for r in ranges
            ]
        )

    def _check_chunk_args(self, chunk_tokens: int, overlap_tokens: int) -> None:
        for field, value in (("chunk_tokens", chunk_tokens), ("overlap_tokens", overlap_tokens)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{field} must be an int, got {type(value).__name__}")
        if not MIN_CHUNK_TOKENS <= chunk_tokens <= self.max_tokens:
            raise ValueError(
                f"chunk_tokens must be in [{MIN_CHUNK_TOKENS}, {self.max_tokens}], got {chunk_tokens}"
            )
        window = chunk_tokens - self.special_tokens
        if not 0 <= overlap_tokens < window:
            raise ValueError(
                f"overlap_tokens must be in [0, chunk_tokens - {self.special_tokens} = {window}), got {overlap_tokens}"
            )


def _default_dir_or_none() -> Path | None:
    try:
        return default_embedding_model_dir().resolve()
    except ModelLoadError:
        return None


def _first_batch(order: list[int], lengths: list[int], max_rows: int, max_tokens: int) -> list[int]:
    """The first rows of ``order`` (longest first) that fit ``max_rows`` rows and ``max_tokens`` padded
    tokens (rows x the longest); at least one row, however long."""
    rows = 1
    while rows < min(max_rows, len(order)) and (rows + 1) * lengths[0] <= max_tokens:
        rows += 1
    return order[:rows]
