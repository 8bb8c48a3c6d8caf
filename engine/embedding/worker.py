"""EmbeddingWorker: the asyncio front of an EmbeddingModel, computing on one dedicated thread.

Every tokenizer and encoder call runs on the worker's own single-thread
executor, so the event loop only awaits. One thread, not a pool: torch already
spreads each forward over the process's cores, and two forwards at once would
only fight for them.

Fairness: a request is cut into slices of at most ``max_batch_texts`` texts,
and each request keeps at most ONE slice in the executor's FIFO queue at a
time (it submits the next slice when the previous one returns). The queue so
round-robins between active requests: a small query that arrives while a
400-text indexing job runs waits for the slice now running plus at most one
slice of every other active request, never for the whole job. A plain FIFO of
all slices would put the query behind the job's remaining slices; explicit
per-caller queues would add bookkeeping for the same order.

Cancelling an awaiting caller stops its request after the running slice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from protoserve.engine.embedding.errors import EmbeddingInputTooLong
from protoserve.engine.embedding.model import EmbeddingModel, check_texts
from protoserve.engine.errors import EngineStoppedError

T = TypeVar("T")

# Tokenizing is ~1000x cheaper per text than a forward; slices this size keep one
# tokenizer job short without multiplying queue round-trips.
TOKENIZE_SLICE_TEXTS = 1024


def _slices(n: int, size: int) -> list[range]:
    return [range(at, min(at + size, n)) for at in range(0, n, size)]


class EmbeddingWorker:
    def __init__(self, model: EmbeddingModel, max_batch_texts: int = 32) -> None:
        if not isinstance(max_batch_texts, int) or isinstance(max_batch_texts, bool) or max_batch_texts < 1:
            raise ValueError(f"max_batch_texts must be an integer >= 1, got {max_batch_texts!r}")
        self.model = model
        self.max_batch_texts = max_batch_texts
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedding")
        self._closed = False

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text without [CLS]/[SEP] (as EmbeddingModel.tokenize)."""
        check_texts(texts)
        ids: list[list[int]] = []
        for part in _slices(len(texts), TOKENIZE_SLICE_TEXTS):
            ids += await self._run(self.model.tokenize, list(texts[part.start : part.stop]))
        return ids

    async def embed_texts(self, texts: list[str]) -> np.ndarray:
        """float32 [len(texts), dimensions]; the whole request is checked before any forward."""
        ids = await self.tokenize(texts)
        specials = self.model.special_tokens
        for i, row in enumerate(ids):
            if len(row) + specials > self.model.max_tokens:
                raise EmbeddingInputTooLong(i, len(row) + specials, self.model.max_tokens)
        return await self.embed_tokenized(ids)

    async def embed_tokenized(self, ids: list[list[int]]) -> np.ndarray:
        """Vectors of ids this model's own tokenizer produced (``tokenize``), each known to fit the window:
        no second pass of checks."""
        return await self._embed_ids(ids)

    async def embed_token_ids(self, ids: list[list[int]]) -> np.ndarray:
        """Pre-tokenized input without specials (as EmbeddingModel.embed_token_ids)."""
        await self._run(self.model.check_token_ids, ids)
        return await self._embed_ids([list(row) for row in ids])

    async def _embed_ids(self, ids: list[list[int]]) -> np.ndarray:
        out = np.empty((len(ids), self.model.dimensions), dtype=np.float32)
        # Sort the whole request before slicing, so each slice pads to a length close to its members'.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        for part in _slices(len(order), self.max_batch_texts):
            members = order[part.start : part.stop]
            rows = [ids[i] for i in members]
            out[members] = await self._run(self.model.embed_token_ids, rows, self.max_batch_texts)
        return out

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        if self._closed:
            raise EngineStoppedError("the embedding worker is closed")
        try:
            future: Future[T] = self._executor.submit(fn, *args)
        except RuntimeError as e:  # shut down between the check and the submit
            raise EngineStoppedError("the embedding worker is closed") from e
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            # close() cancelled our queued slice (the caller itself was not cancelled).
            if future.cancelled() and self._closed and task is not None and not task.cancelling():
                raise EngineStoppedError("the embedding worker was closed") from None
            raise

    def close(self, wait: bool = True) -> None:
        """Stop taking work and cancel queued slices; waits for the running one when ``wait``.

        Callers whose slice was cancelled, or who submit later, get EngineStoppedError.
        """
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)

    async def aclose(self) -> None:
        """close() without blocking the event loop while the running slice finishes."""
        self._closed = True
        await asyncio.to_thread(self._executor.shutdown, True, cancel_futures=True)

    @property
    def closed(self) -> bool:
        return self._closed
