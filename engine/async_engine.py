"""AsyncEngine: the LLMEngine stepped by its own thread, streamed to asyncio callers.

The step loop runs in a daemon thread so a forward never blocks the event loop.
Callers hand work to the thread through an inbox under a lock (new requests,
aborts); the thread hands outputs back with ``loop.call_soon_threadsafe``, one
call per step and event loop. Only the thread touches the LLMEngine after
start(), except for ``LLMEngine.prepare`` (validation), which reads immutable
state and so runs in the caller's task and raises there (in a worker thread for
a request with a constraint, whose grammar may compile there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from protoserve.engine.config import EngineConfig
from protoserve.engine.errors import EngineError, EngineStoppedError, InvalidRequestError, QueueFullError
from protoserve.engine.llm_engine import AdmittedRequest, LLMEngine
from protoserve.engine.lora.stack import AdapterStack
from protoserve.engine.request import RequestOutput, TokenizedRequest
from protoserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncEngine:
    """Thread-stepped engine with an async generator per request."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.quantization = engine.quantization
        self.kv_cache_dtype = engine.kv_cache_dtype
        self.max_model_len = engine.max_model_len
        self.num_parameters = engine.num_parameters
        self.model_summary = engine.model_summary
        self.kv_bytes_per_token = engine.runner.kv_cache.bytes_per_token  # the pool's, as GetModel reports it
        self.sampling_defaults = engine.sampling_defaults
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: list[tuple[AdmittedRequest, _Stream]] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()  # accepted and not yet finished (guarded by _lock)
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()

    @property
    def adapters(self) -> AdapterStack | None:
        """The engine's LoRA adapters (engine/lora), None when it serves none."""
        return self.engine.adapters

    @classmethod
    def from_pretrained(
        cls,
        model_path: str | None = None,
        *,
        dtype: str = "float32",
        quantization: str = "none",
        config: EngineConfig | None = None,
        progress: bool = True,
        model_name: str | None = None,
    ) -> AsyncEngine:
        engine = LLMEngine.from_pretrained(
            model_path, dtype=dtype, quantization=quantization, config=config, progress=progress
        )
        if model_name is None:
            model_name = _default_model_name(model_path)
        return cls(engine, model_name)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent)."""
        with self._lock:
            if self._thread is not None or self._stopping:
                return
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop taking requests, finish pending ones as cancelled, and stop the thread."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wakeup.set()
        if thread is not None:
            await asyncio.to_thread(thread.join)
        # No step runs any more: the prefix cache may be persisted, other tensor-parallel ranks may stop.
        await asyncio.to_thread(self.engine.close)

    # -- requests ------------------------------------------------------------

    async def generate(
        self, request: TokenizedRequest, *, on_abandoned: Callable[[RequestOutput], None] | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last has ``finished=True`` and stats.

        Refusals (invalid, too long, queue full, stopped) raise at the first
        ``__anext__``; a request that fails while generating (ConstraintFailedError)
        raises after the outputs it produced up to the failure. Leaving the
        iteration early (aclose, task cancelled) aborts the request, which frees its
        KV blocks within one step. The abort's own final output (its stats: time to
        first token, decode time, tokens) then goes to ``on_abandoned`` when given,
        which the cleanup waits for (one step at most).
        """
        self.start()
        if request.sampling.constraint is not None:
            # A constraint may compile here (milliseconds, up to a second for a big grammar): off the loop.
            prepared = await asyncio.to_thread(self.engine.prepare, request)
        else:
            prepared = self.engine.prepare(request)
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down")
            if rid in self._live:
                raise InvalidRequestError([("request_id", f"request {rid!r} is already running")])
            # The engine thread decides at a full waiting queue (a newcomer may displace a longer-queued
            # tenant's request); only the hand-over list itself is bounded here.
            if len(self._inbox) >= self.engine.config.max_queue:
                raise QueueFullError(len(self._inbox) + self._stats.waiting)
            self._live.add(rid)
            self._inbox.append((prepared, stream))
        self._wakeup.set()
        done = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(rid)
                if on_abandoned is not None:
                    final = await _final_output(stream.queue)
                    if final is not None:
                        on_abandoned(final)

    def abort(self, request_id: str) -> bool:
        """Cancel a request from any thread; True if it was waiting or running."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._aborts.append(request_id)
        self._wakeup.set()
        return True

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    # -- the step thread -----------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                stopping = self._stopping
            for prepared, stream in inbox:
                self._admit(prepared, stream)
            for rid in aborts:
                engine.abort(rid)
            if stopping:
                for rid in list(engine.requests):
                    engine.abort(rid)
            if not engine.has_unfinished():
                self._stats = engine.stats()
                if stopping:
                    return
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a failing forward must not hang every caller
                log.exception("engine step failed; failing all live requests")
                self._fail_all(exc)
                continue
            self._stats = engine.stats()
            self._deliver(outputs)

    def _admit(self, prepared: AdmittedRequest, stream: _Stream) -> None:
        rid = prepared.request.request_id
        try:
            shed = self.engine.add_request(prepared)
        except EngineError as exc:
            with self._lock:
                self._live.discard(rid)
            _put(stream, exc)
            return
        self._streams[rid] = stream
        for shed_id in shed:  # refused as if it had arrived at the full queue
            with self._lock:
                self._live.discard(shed_id)
            _put(self._streams.pop(shed_id), QueueFullError(self.engine.config.max_queue))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                with self._lock:
                    self._live.discard(out.request_id)
            by_loop.setdefault(stream.loop, []).extend((stream.queue, item) for item in _stream_items(out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    def _fail_all(self, exc: Exception) -> None:
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        self.engine.step()  # nothing is scheduled: this only collects the cancellations
        failed, self._streams = self._streams, {}
        for stream in failed.values():
            _put(stream, exc)
        with self._lock:
            self._live.difference_update(failed)
        self._stats = self.engine.stats()


async def _final_output(queue: asyncio.Queue[RequestOutput | BaseException]) -> RequestOutput | None:
    """The finished output an aborted request still gets from the step thread (None if it failed)."""
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            return None
        if item.finished:
            return item


def _stream_items(out: RequestOutput) -> list[RequestOutput | BaseException]:
    """What a caller's stream gets for one output: a failed request's output up to the failure, as
    an unfinished update, then its error (raised to the caller after those tokens)."""
    if out.error is None:
        return [out]
    partial = dataclasses.replace(out, finished=False, stats=None, error=None)
    return [partial, out.error] if partial.deltas else [out.error]


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)


def _put(stream: _Stream, item: RequestOutput | BaseException) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass


def _default_model_name(model_path: str | None) -> str:
    if model_path is None:
        return "SmolLM2-135M-Instruct"
    from pathlib import Path

    path = Path(model_path)
    return path.stem if path.is_file() else path.name
