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

The work comes as steps too (``embed_steps``, ``chunk_steps``): generators
that do one small unit per ``next()`` (an encoder layer over a few rows, a slice
of a document) and yield its cost, so a scheduler (worker.EmbeddingWorker) can
interleave callers between units and drop a caller's work between two of them.
Units never hold a lock or a thread-local mode across a yield.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tokenizers import Encoding, Tokenizer

from protoserve.engine.embedding.bert import BertEncoder, load_bert
from protoserve.engine.embedding.chunking import SlicePlan, TextChunk, keep_chunk, plan_slice
from protoserve.engine.embedding.default_model import DEFAULT_EMBEDDING_NAME, default_embedding_model_dir
from protoserve.engine.embedding.errors import EmbeddingInputTooLong, TooManyChunks
from protoserve.engine.embedding.layout import SentenceModelLayout, read_layout
from protoserve.engine.embedding.pooling import l2_normalize, pool
from protoserve.engine.execution.compute_gate import CPU_GATE
from protoserve.engine.loader.errors import ModelLoadError

__all__ = ["EmbeddingInputTooLong", "EmbeddingModel", "TextChunk", "TooManyChunks", "run_steps"]

T = TypeVar("T")
# Steps: each next() does one unit of work and yields its cost; the generator returns the result.
Steps = Generator[int, None, T]

DEFAULT_BATCH_SIZE = 32
# Padded tokens per unit: one encoder layer over this many (rows x the micro-batch's width) takes one
# turn at the cores the engine's decode loop shares (CPU_GATE). While the engine decodes, a unit is
# one window's worth: a decode step waits at most one layer over one chunk, ~10 ms. The worker
# (worker.EmbeddingWorker) always uses that size; the direct calls use larger units while idle.
BUSY_UNIT_TOKENS = 256
IDLE_UNIT_TOKENS = 4096
MIN_CHUNK_TOKENS = 16
# Characters of a document tokenized and planned per chunking step: ~3k tokens of prose (~10 ms), the
# step another caller may wait behind and the tokens held in memory at once. Each slice plans its
# last ~window of tokens again in the next, ~8% more tokenizing than one pass over the whole text.
CHUNK_SLICE_CHARS = 16 * 1024
# A chunking step's cost in the units forwards are counted in (one padded token through one layer):
# tokenizing and planning a character costs about a hundredth of that.
CHUNK_CHARS_PER_COST = 64
# Rows of caller-given token ids checked per step (~5 ms of Python at the window's 256 ids a row).
CHECK_ROWS = 64
_SPACE = re.compile(r"\s")


def run_steps(steps: Steps[T]) -> T:
    """Run every step of ``steps`` here and now; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _unit_tokens() -> int:
    """Unit size for work run outside a scheduler: small while the engine decodes."""
    return BUSY_UNIT_TOKENS if CPU_GATE.engine_active() else IDLE_UNIT_TOKENS


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
        return run_steps(self._embed_steps(ids, batch_size, _unit_tokens))

    def embed_steps(
        self, ids: list[list[int]], batch_size: int, unit_tokens: Callable[[], int], check: bool = True
    ) -> Steps[np.ndarray]:
        """``embed_token_ids(ids, batch_size)`` as steps: one encoder layer over at most ``unit_tokens()``
        padded tokens (asked before each unit) per step. Every id is checked first, CHECK_ROWS rows a
        step, unless ``check`` is False (ids this model's ``tokenize`` made, known to fit the window)."""
        _check_batch_size(batch_size)
        if check:
            if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
                raise TypeError(f"ids must be a list of lists of int, got {type(ids).__name__}")
            for i, row in enumerate(ids):
                self._check_id_row(i, row)
                if i % CHECK_ROWS == CHECK_ROWS - 1:
                    yield CHECK_ROWS
            self._check_lengths(ids, extra=self.special_tokens)
        return (
            yield from self._embed_steps(
                [self._prefix_ids + list(row) + self._suffix_ids for row in ids], batch_size, unit_tokens
            )
        )

    def _embed_steps(
        self, ids: list[list[int]], batch_size: int, unit_tokens: Callable[[], int]
    ) -> Steps[np.ndarray]:
        out = np.empty((len(ids), self.dimensions), dtype=np.float32)
        # Longest first (as sentence-transformers does): a batch pads only to its own longest member.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        lengths = [len(ids[i]) for i in order]
        at = 0
        while at < len(order):
            # A micro-batch as large as an idle unit: units split it by rows when they must be smaller.
            batch = _first_batch(order[at:], lengths[at:], batch_size, IDLE_UNIT_TOKENS)
            vectors = yield from self._forward_steps([ids[i] for i in batch], unit_tokens)
            out[batch] = vectors.numpy()
            at += len(batch)
        return out

    def _forward_steps(self, rows: list[list[int]], unit_tokens: Callable[[], int]) -> Steps[torch.Tensor]:
        """One micro-batch through the encoder, a layer over a group of its rows per step.

        Rows never attend to each other, so a layer may run over any subset of them: each unit takes
        as many rows as ``unit_tokens()`` allows now, however large the micro-batch.
        """
        width = max(len(row) for row in rows)
        with torch.inference_mode():
            input_ids = torch.zeros((len(rows), width), dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, row in enumerate(rows):
                input_ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
                mask[r, : len(row)] = 1
            key_mask = mask.bool()[:, None, None, :]
            hidden = torch.empty((len(rows), width, self.dimensions), dtype=torch.float32)
        encoder = self._encoder
        for depth, layer in enumerate(encoder.layers):
            at = 0
            while at < len(rows):
                part = slice(at, at + max(1, unit_tokens() // width))
                # Each unit a turn at the cores the engine's decode loop shares (CPU_GATE).
                with torch.inference_mode(), CPU_GATE.background():
                    x = encoder.embeddings(input_ids[part]) if depth == 0 else hidden[part]
                    hidden[part] = layer(x, key_mask[part])
                rows_done = min(len(rows), part.stop) - at
                at += rows_done
                yield rows_done * width
        with torch.inference_mode():
            vectors = pool(hidden, mask, self._layout.pooling)
            if self._layout.normalize:
                vectors = l2_normalize(vectors)
            return vectors.float()

    # --- chunking -----------------------------------------------------------------------------

    def chunk(
        self, text: str, chunk_tokens: int = 256, overlap_tokens: int = 32, max_chunks: int | None = None
    ) -> list[TextChunk]:
        """Cut ``text`` into chunks that each fit ``chunk_tokens`` with [CLS]/[SEP], overlapping by
        ``overlap_tokens`` tokens (extended back to a word start rather than cutting a word).

        ``chunk.text == text[chunk.start:chunk.end]``, from the first token's
        first character to the last token's last (str offsets). Text that
        tokenizes to nothing (empty, whitespace) gives []. TooManyChunks once
        the chunks pass ``max_chunks``.
        """
        return run_steps(self.chunk_steps(text, chunk_tokens, overlap_tokens, max_chunks))

    def chunk_steps(
        self, text: str, chunk_tokens: int = 256, overlap_tokens: int = 32, max_chunks: int | None = None
    ) -> Steps[list[TextChunk]]:
        """``chunk`` as steps: each tokenizes and plans one slice of about CHUNK_SLICE_CHARS characters.

        A slice ends after a whitespace character where there is one near, and the next starts at the
        first character of the next chunk, so a chunk never straddles two slices' tokenizations.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        self._check_chunk_args(chunk_tokens, overlap_tokens)
        if max_chunks is not None and (isinstance(max_chunks, bool) or not isinstance(max_chunks, int)):
            raise ValueError(f"max_chunks must be an int or None, got {type(max_chunks).__name__}")
        window = chunk_tokens - self.special_tokens
        kept: list[TextChunk] = []
        base = 0  # where this slice starts in text: the next chunk's first character
        covered = 0  # where the last chunk ends in text
        size = CHUNK_SLICE_CHARS
        while base < len(text):
            end = _slice_end(text, base, size)
            final = end == len(text)
            piece = text[base:end]
            # Each step a turn at the cores, as forward units are: beside the engine's forwards it
            # would slow every decode step, and the tokenizer leaves the GIL to run beside them.
            with CPU_GATE.background():
                plan, offsets = self._plan_slice(piece, base, covered, window, overlap_tokens, final)
            if not offsets:
                if final:
                    break
                base, size = end, CHUNK_SLICE_CHARS
                yield len(piece) // CHUNK_CHARS_PER_COST
                continue
            for r in plan.ranges:
                first, last = base + offsets[r.start][0], base + offsets[r.end - 1][1]
                keep_chunk(kept, TextChunk(first, last, text[first:last], r.tokens + self.special_tokens))
                covered = last
            if max_chunks is not None and len(kept) > max_chunks:
                raise TooManyChunks(max_chunks)
            yield len(piece) // CHUNK_CHARS_PER_COST
            if plan.next_start is None:
                break
            if plan.next_start == 0:
                size *= 2  # not one chunk fits before the slice's last word: read a longer slice
                continue
            base, size = base + offsets[plan.next_start][0], CHUNK_SLICE_CHARS
        return kept

    def _plan_slice(
        self, piece: str, base: int, covered: int, window: int, overlap: int, final: bool
    ) -> tuple[SlicePlan, list[tuple[int, int]]]:
        """Tokenize one slice (starting at ``base`` in the text) and plan its ranges; also its token
        offsets in the slice (none: the slice holds no token)."""
        # The Python binding reports offsets in str characters, not UTF-8 bytes.
        encoding = self._encode(piece)
        offsets = encoding.offsets
        if not offsets:
            return SlicePlan([], None), offsets

        def span(start: int, stop: int) -> str:
            return piece[offsets[start][0] : offsets[stop - 1][1]]

        def measure(start: int, stop: int) -> int:
            return len(self._encode(span(start, stop)).ids)

        ends = [stop for _, stop in offsets]
        previous_end = bisect.bisect_right(ends, covered - base)
        plan = plan_slice(encoding.word_ids, window, overlap, measure, final=final, previous_end=previous_end)
        return plan, offsets


    def _encode(self, text: str) -> Encoding:
        """``text``'s tokens without specials. By encode_batch, not encode: only the batch call lets go
        of the GIL (encode of 16K characters stalls every other thread of the process for ~7 ms, the
        server's event loop included), at the same speed even for one short text."""
        return self._tokenizer.encode_batch([text], add_special_tokens=False)[0]

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


def _slice_end(text: str, start: int, size: int) -> int:
    """Where a chunking slice from ``start`` ends: the text's end if that is near, else just after the
    first whitespace past ``start + size`` (within another ``size``), else at ``start + size``."""
    if len(text) - start <= size:
        return len(text)
    space = _SPACE.search(text, start + size, min(len(text), start + 2 * size))
    return space.end() if space is not None else start + size


def _first_batch(order: list[int], lengths: list[int], max_rows: int, max_tokens: int) -> list[int]:
    """The first rows of ``order`` (longest first) that fit ``max_rows`` rows and ``max_tokens`` padded
    tokens (rows x the longest); at least one row, however long."""
    rows = 1
    while rows < min(max_rows, len(order)) and (rows + 1) * lengths[0] <= max_tokens:
        rows += 1
    return order[:rows]
