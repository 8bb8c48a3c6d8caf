"""EmbeddingWorker: the asyncio front of an EmbeddingModel, computing on one dedicated thread.

Every tokenizer, chunking and encoder call runs on the worker's own thread, so the event loop only
awaits. One thread, not a pool: torch already spreads each forward over the process's cores, and
two forwards at once would only fight for them.

Work is cut into small units: a slice of texts to tokenize (at most TOKENIZE_SLICE_BYTES), a slice
of a document to chunk (model.CHUNK_SLICE_CHARS), one encoder layer over a few rows of a
micro-batch (model.EmbeddingModel.embed_steps). Each call is a job, a generator of such units
(model.Steps), queued under its tenant (the server passes the caller's identity). The thread runs
one unit at a time and picks each from the job that fairness says is next (fair_queue.FairQueue):
the least-served tenant's oldest job. So a search that arrives while another tenant indexes a
4 MiB document waits for the unit running now, not for the document. Forward units are always one
window's worth of tokens (UNIT_TOKENS), because a search can arrive during any unit: one layer over
256 tokens takes ~10 ms on 2 cores, and measured no slower per chunk than 4,096-token units
(26 against 24 chunks/s of 256 tokens), which took up to 180 ms. A tenant's own jobs run in the
order it sent them.

Cancelling an awaiting caller stops its job after the running unit: the thread drops it before
picking the next one. ``close()`` takes no more work, ends every queued job with
EngineStoppedError and, with ``wait``, waits for the running unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from protoserve.engine.embedding.chunking import TextChunk
from protoserve.engine.embedding.errors import EmbeddingInputTooLong
from protoserve.engine.embedding.fair_queue import FairQueue
from protoserve.engine.embedding.model import BUSY_UNIT_TOKENS, EmbeddingModel, Steps, check_texts
from protoserve.engine.errors import EngineStoppedError
from protoserve.engine.execution.compute_gate import CPU_GATE

T = TypeVar("T")

# Tokenizing is ~100x cheaper per byte than a forward; a slice this size keeps one tokenizer unit
# near 20 ms however long the texts are, and many short texts still go in one call.
TOKENIZE_SLICE_TEXTS = 1024
TOKENIZE_SLICE_BYTES = 64 * 1024
# A tokenizer unit's cost in forward units (one padded token through one layer) per byte.
TOKENIZE_BYTES_PER_COST = 64
# Padded tokens of one forward unit (an encoder layer over a group of rows).
UNIT_TOKENS = BUSY_UNIT_TOKENS


def _unit_tokens() -> int:
    return UNIT_TOKENS


def _text_slices(texts: list[str]) -> list[range]:
    """Consecutive ranges of at most TOKENIZE_SLICE_TEXTS texts and TOKENIZE_SLICE_BYTES characters
    (at least one text each)."""
    slices, start, size = [], 0, 0
    for i, text in enumerate(texts):
        if i > start and (i - start == TOKENIZE_SLICE_TEXTS or size + len(text) > TOKENIZE_SLICE_BYTES):
            slices.append(range(start, i))
            start, size = i, 0
        size += len(text)
    if start < len(texts):
        slices.append(range(start, len(texts)))
    return slices


@dataclass(eq=False)
class _Job:
    """One call's steps and the future its caller awaits (resolved on the caller's loop)."""

    tenant: str
    steps: Steps[Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]
    abandoned: bool = False  # the caller stopped waiting: drop the job before its next unit

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
            self.loop.call_soon_threadsafe(settle)


class EmbeddingWorker:
    def __init__(self, model: EmbeddingModel, max_batch_texts: int = 32) -> None:
        if not isinstance(max_batch_texts, int) or isinstance(max_batch_texts, bool) or max_batch_texts < 1:
            raise ValueError(f"max_batch_texts must be an integer >= 1, got {max_batch_texts!r}")
        self.model = model
        self.max_batch_texts = max_batch_texts
        self._cond = threading.Condition()
        self._queue: FairQueue[_Job] = FairQueue()
        self._thread: threading.Thread | None = None
        self._running: _Job | None = None
        self._closed = False

    # --- the calls -----------------------------------------------------------------------------

    async def tokenize(self, texts: list[str], tenant: str = "") -> list[list[int]]:
        """Token ids of each text without [CLS]/[SEP] (as EmbeddingModel.tokenize)."""
        check_texts(texts)
        return await self._submit(tenant, self._tokenize_steps(list(texts)))

    async def chunk(
        self,
        text: str,
        chunk_tokens: int = 256,
        overlap_tokens: int = 32,
        max_chunks: int | None = None,
        tenant: str = "",
    ) -> list[TextChunk]:
        """EmbeddingModel.chunk, a slice of the text per unit (TooManyChunks past ``max_chunks``)."""
        return await self._submit(
            tenant, self.model.chunk_steps(text, chunk_tokens, overlap_tokens, max_chunks)
        )

    async def embed_texts(self, texts: list[str], tenant: str = "") -> np.ndarray:
        """float32 [len(texts), dimensions]; the whole request is checked before any forward."""
        ids = await self.tokenize(texts, tenant)
        specials = self.model.special_tokens
        for i, row in enumerate(ids):
            if len(row) + specials > self.model.max_tokens:
                raise EmbeddingInputTooLong(i, len(row) + specials, self.model.max_tokens)
        return await self.embed_tokenized(ids, tenant)

    async def embed_tokenized(self, ids: list[list[int]], tenant: str = "") -> np.ndarray:
        """Vectors of ids this model's own tokenizer produced (``tokenize``), each known to fit the window:
        no second pass of checks."""
        steps = self.model.embed_steps(ids, self.max_batch_texts, _unit_tokens, check=False)
        return await self._submit(tenant, steps)

    async def embed_token_ids(self, ids: list[list[int]], tenant: str = "") -> np.ndarray:
        """Pre-tokenized input without specials (as EmbeddingModel.embed_token_ids), checked on the thread."""
        rows = [list(row) for row in ids]
        return await self._submit(tenant, self.model.embed_steps(rows, self.max_batch_texts, _unit_tokens))

    def _tokenize_steps(self, texts: list[str]) -> Steps[list[list[int]]]:
        ids: list[list[int]] = []
        for part in _text_slices(texts):
            chosen = texts[part.start : part.stop]
            with CPU_GATE.background():  # a turn at the cores, as forward units are
                ids += self.model.tokenize(chosen)
            yield sum(len(t) for t in chosen) // TOKENIZE_BYTES_PER_COST
        return ids

    # --- the queue ---------------------------------------------------------------------------

    async def _submit(self, tenant: str, steps: Steps[T]) -> T:
        loop = asyncio.get_running_loop()
        job = _Job(tenant, steps, loop, loop.create_future())
        with self._cond:
            if self._closed:
                steps.close()
                raise EngineStoppedError("the embedding worker is closed")
            self._queue.push(tenant, job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="embedding", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        try:
            return await job.future
        except asyncio.CancelledError:
            with self._cond:
                job.abandoned = True  # the thread drops it before its next unit
                self._cond.notify_all()
            raise

    def _serve(self) -> None:
        """The thread: one unit of the job fairness picks, until closed."""
        while True:
            with self._cond:
                picked = self._pick()
                while picked is None and not self._closed:
                    self._cond.wait()
                    picked = self._pick()
                if picked is None:
                    return
                self._running = picked
            cost, done, result, error = 0, False, None, None
            try:
                cost = next(picked.steps)
            except StopIteration as stop:
                done, result = True, stop.value
            except BaseException as exc:  # noqa: BLE001 - the caller gets it, the thread serves on
                done, error = True, exc
            with self._cond:
                self._running = None
                self._queue.charge(picked.tenant, cost)
                if done:
                    self._queue.remove(picked.tenant, picked)
                    picked.resolve(result, error)
                elif self._closed:
                    self._end(picked, "the embedding worker was closed")
                self._cond.notify_all()

    def _pick(self) -> _Job | None:
        """The next job to run a unit of, after dropping abandoned ones; the caller holds the lock."""
        while (picked := self._queue.next()) is not None:
            job = picked[1]
            if not job.abandoned and not self._closed:
                return job
            self._end(job, "the embedding worker was closed")
        return None

    def _end(self, job: _Job, reason: str) -> None:
        """Take ``job`` out and close its steps; its caller (if still waiting) gets EngineStoppedError."""
        self._queue.remove(job.tenant, job)
        job.steps.close()
        if not job.abandoned:
            job.resolve(error=EngineStoppedError(reason))

    # --- lifecycle ---------------------------------------------------------------------------

    def close(self, wait: bool = True) -> None:
        """Stop taking work and end queued jobs; waits for the running unit when ``wait``.

        Callers whose job was ended, or who submit later, get EngineStoppedError.
        """
        thread = self._stop()
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join()

    async def aclose(self) -> None:
        """close() without blocking the event loop while the running unit finishes."""
        thread = self._stop()
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def _stop(self) -> threading.Thread | None:
        with self._cond:
            self._closed = True
            if self._thread is None:
                return None
            self._cond.notify_all()  # the thread ends the queued jobs, then itself
            return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def queued(self) -> int:
        """Jobs queued or running (for tests and metrics)."""
        with self._cond:
            return len(self._queue)
