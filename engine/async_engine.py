"""AsyncEngine: the LLMEngine stepped by its own thread, streamed to asyncio callers.

The step loop runs in a daemon thread so a forward never blocks the event loop.
Callers hand work to the thread through an inbox under a lock (new requests,
aborts); the thread hands outputs back with ``loop.call_soon_threadsafe``, one
call per step and event loop. Only the thread touches the LLMEngine after
start(), except for ``LLMEngine.prepare`` (validation), which reads immutable
state and so runs in the caller's task and raises there (in a worker thread for
a request with a constraint, whose grammar may compile there).

An idle engine may be evicted: its LLMEngine (weights and KV pool) is closed and dropped, and the
next request loads it again before it is queued, waiting for the load (Ollama's keep-alive). An
engine may also be unloaded for good: requests still running then end with ModelUnloadedError.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from protoserve.engine.config import EngineConfig
from protoserve.engine.errors import (
    EngineError,
    EngineStoppedError,
    InvalidRequestError,
    ModelUnloadedError,
    QueueFullError,
)
from protoserve.engine.llm_engine import LLMEngine
from protoserve.engine.loader.heap import release_freed_memory
from protoserve.engine.lora.stack import AdapterStack
from protoserve.engine.request import RequestOutput, TokenizedRequest
from protoserve.engine.sampling.constraints.constraint import Constraint
from protoserve.engine.scheduling.admission import AdmittedRequest
from protoserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """Where one request's outputs go: an asyncio queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    # The step thread's own: the output held back for EngineConfig.stream_interval, and whether the
    # request's first token has gone (it goes at once, whatever the interval).
    held: RequestOutput | None = None
    started: bool = False

    def due(self, out: RequestOutput, interval: int) -> RequestOutput | None:
        """``out`` joined to what is held, if the caller is to have it now; else None (held)."""
        if self.held is not None:
            out, self.held = _merged(self.held, out), None
        if interval == 1 or out.finished or out.error is not None:
            return out
        tokens = max((len(d.token_ids) for d in out.deltas), default=0)
        if tokens >= interval or (tokens and not self.started):
            self.started = True
            return out
        self.held = out
        return None


class AsyncEngine:
    """Thread-stepped engine with an async generator per request."""

    # How often wait_idle looks at the live requests: a drain is not timed closer than this.
    IDLE_POLL_S = 0.02

    def __init__(
        self, engine: LLMEngine, model_name: str, reload: Callable[[], LLMEngine] | None = None
    ) -> None:
        """``reload`` loads the same engine again after :meth:`evict`; None: it is never evicted."""
        self.engine: LLMEngine | None = engine  # None while evicted or once unloaded
        self.model_name = model_name
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.quantization = engine.quantization
        self.kv_cache_dtype = engine.kv_cache_dtype
        self.max_model_len = engine.max_model_len
        self.num_parameters = engine.num_parameters
        self.model_summary = engine.model_summary
        self.kv_bytes_per_token = engine.runner.kv_cache.bytes_per_token  # the pool's, as GetModel reports it
        # What it holds while resident, for the server's memory budget.
        self.weight_bytes = engine.runner.model.weight_bytes()
        self.kv_pool_bytes = engine.runner.kv_cache.nbytes
        self.sampling_defaults = engine.sampling_defaults
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._inbox: list[tuple[AdmittedRequest, _Stream]] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()  # accepted and not yet finished (guarded by _lock)
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._stopping = False
        self._stop_error: EngineStoppedError | None = None  # what requests get once stopping; None: cancelled
        self._parking = False  # the step thread returns once idle (evict)
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._reload = reload
        self._residency = asyncio.Lock()  # one evict or reload at a time
        self._users = 0  # generate() calls under way, from entry to exit (event loop only)
        self._last_used = time.monotonic()
        # Called with a reload's seconds after an evicted engine loads again (the server's load metric).
        self.on_reload: Callable[[float], None] | None = None

    @property
    def adapters(self) -> AdapterStack | None:
        """The engine's LoRA adapters (engine/lora), None when it serves none."""
        return self.engine.adapters if self.engine is not None else None

    @property
    def resident(self) -> bool:
        """Whether the weights and KV pool are in memory (not evicted, not unloaded)."""
        return self.engine is not None

    def requests_under_way(self) -> int:
        """Requests between generate()'s entry and exit: loading the model, queued or running."""
        return max(self._users, len(self._live))

    def idle_seconds(self) -> float:
        """Seconds since the last request ended; 0 while one is under way."""
        if self._users or self._live:
            return 0.0
        return time.monotonic() - self._last_used

    def compile_constraint(self, constraint: Constraint | None) -> object:
        """Compile ``constraint`` ahead (LLMEngine.compile_constraint, thread-safe). While evicted it is
        left to the request's own prepare after the reload, which refuses it the same way."""
        engine = self.engine
        return engine.compile_constraint(constraint) if engine is not None else None

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
        reload = None
        if engine.config.tensor_parallel_size == 1:  # ranks of a sharded model live as long as the server
            reload = functools.partial(LLMEngine.from_pretrained, model_path, dtype=dtype,
                                       quantization=quantization, config=config, progress=False)
        return cls(engine, model_name, reload)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        """Start the step thread (idempotent; not while evicted)."""
        with self._lock:
            if self._thread is not None or self._stopping or self.engine is None:
                return
            self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
            self._thread.start()

    async def shutdown(self, error: EngineStoppedError | None = None) -> None:
        """Stop taking requests and stop the thread; pending requests finish as cancelled, or fail with
        ``error`` when given (so do requests that arrive from now on)."""
        with self._lock:
            self._stopping = True
            self._stop_error = error
            thread = self._thread
        self._wakeup.set()
        if thread is not None:
            await asyncio.to_thread(thread.join)
        # No step runs any more: the prefix cache may be persisted, other tensor-parallel ranks may stop.
        async with self._residency:  # not while an evicted engine reloads
            if self.engine is not None:
                await asyncio.to_thread(self.engine.close)

    async def unload(self) -> None:
        """Shut down for good: requests still running fail with ModelUnloadedError, then the weights and
        KV pool are freed (the engine must no longer be referenced elsewhere for that)."""
        await self.shutdown(ModelUnloadedError(self.model_name))
        engine, self.engine = self.engine, None
        del engine
        await asyncio.to_thread(_collect_freed)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for no request to be under way; True when none is."""
        deadline = time.monotonic() + timeout_s
        while self._users or self._live:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(self.IDLE_POLL_S)
        return True

    async def evict(self) -> bool:
        """Free the weights and KV pool of an idle engine; its next request loads them again.

        False, doing nothing, while a request is under way, when already evicted or stopping, and for an
        engine that cannot be reloaded as it is: sharded (tensor parallel), or serving LoRA adapters
        (loaded at run time, they would not come back).
        """
        async with self._residency:
            with self._lock:
                engine = self.engine
                if (engine is None or self._reload is None or engine.adapters is not None or self._users
                        or self._live or self._stopping):
                    return False
                self._parking = True
                thread, self._thread = self._thread, None
            self._wakeup.set()
            if thread is not None:
                await asyncio.to_thread(thread.join)
            with self._lock:
                self._parking = False
            self.engine = None
            await asyncio.to_thread(engine.close)
            del engine
            await asyncio.to_thread(_collect_freed)
            log.info("model %s evicted after %.0fs idle", self.model_name, self.idle_seconds())
            return True

    async def _ensure_resident(self) -> float:
        """Load an evicted engine again; returns the seconds the caller waited for it (0 when resident)."""
        if self.engine is not None:
            return 0.0
        started = time.monotonic()
        async with self._residency:
            if self.engine is None and not self._stopping:
                assert self._reload is not None  # evict() leaves only reloadable engines
                engine = await asyncio.to_thread(self._reload)
                self.engine = engine
                self._stats = engine.stats()
                seconds = time.monotonic() - started
                log.info("model %s loaded again in %.1fs", self.model_name, seconds)
                if self.on_reload is not None:
                    self.on_reload(seconds)
        return time.monotonic() - started

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
        which the cleanup waits for (one step at most). A caller that falls behind gets the
        outputs queued meanwhile folded into one (``_coalesce``).
        """
        self._users += 1
        outputs = self._generate(request, on_abandoned)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # now, not at garbage collection: its cleanup aborts the request
            self._users -= 1
            self._last_used = time.monotonic()

    async def _generate(
        self, request: TokenizedRequest, on_abandoned: Callable[[RequestOutput], None] | None
    ) -> AsyncIterator[RequestOutput]:
        waited = await self._ensure_resident()
        engine = self.engine
        if engine is None or self._stopping:
            raise self._stopped()
        self.start()
        if request.sampling.constraint is not None:
            # A constraint may compile here (milliseconds, up to a second for a big grammar): off the loop.
            prepared = await asyncio.to_thread(engine.prepare, request)
        else:
            prepared = engine.prepare(request)
        del engine  # a failed request's traceback keeps this frame: it must not keep the engine
        rid = request.request_id
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._stopping:
                raise self._stopped()
            if rid in self._live:
                raise InvalidRequestError([("request_id", f"request {rid!r} is already running")])
            # The engine thread decides at a full waiting queue (a newcomer may displace a longer-queued
            # tenant's request); only the hand-over list itself is bounded here.
            if len(self._inbox) >= self.config.max_queue:
                raise QueueFullError(len(self._inbox) + self._stats.waiting)
            self._live.add(rid)
            self._inbox.append((prepared, stream))
        self._wakeup.set()
        done = False
        error: BaseException | None = None  # taken from the queue while coalescing, raised next
        try:
            while True:
                item = error if error is not None else await stream.queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                item, error = _coalesce(item, stream.queue)
                done = item.finished
                if done and waited and item.stats is not None:
                    item.stats.model_load_s = waited
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(rid)
                # An error already taken was the request's last item: no final output follows it.
                if on_abandoned is not None and error is None:
                    final = await _final_output(stream.queue)
                    if final is not None:
                        on_abandoned(final)

    def _stopped(self) -> EngineStoppedError:
        """A new error for a request refused or ended by the stop: a shared instance would gather every
        request's traceback, and with them the frames that hold the engine."""
        if self._stop_error is None:
            return EngineStoppedError("the engine is shutting down")
        return copy.copy(self._stop_error)

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
        assert engine is not None  # start() runs no thread while evicted
        while True:
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                stopping, parking = self._stopping, self._parking
            for prepared, stream in inbox:
                self._admit(engine, prepared, stream)
            for rid in aborts:
                engine.abort(rid)
            if stopping and self._stop_error is not None and self._streams:
                self._fail_all(engine, self._stopped())
            elif stopping:
                for rid in list(engine.requests):
                    engine.abort(rid)
            if not engine.has_unfinished():
                self._stats = engine.stats()
                if stopping or parking:
                    return
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # a failing forward must not hang every caller
                log.exception("engine step failed; failing all live requests")
                self._fail_all(engine, exc)
                continue
            self._stats = engine.stats()
            self._deliver(outputs)

    def _admit(self, engine: LLMEngine, prepared: AdmittedRequest, stream: _Stream) -> None:
        rid = prepared.request.request_id
        try:
            shed = engine.add_request(prepared)
        except EngineError as exc:
            with self._lock:
                self._live.discard(rid)
            _put(stream, exc)
            return
        self._streams[rid] = stream
        for shed_id in shed:  # refused as if it had arrived at the full queue
            with self._lock:
                self._live.discard(shed_id)
            _put(self._streams.pop(shed_id), QueueFullError(self.config.max_queue))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        interval = self.config.stream_interval
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            out = stream.due(out, interval)
            if out is None:
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

    def _fail_all(self, engine: LLMEngine, exc: Exception) -> None:
        for rid in list(engine.requests):
            engine.abort(rid)
        engine.step()  # nothing is scheduled: this only collects the cancellations
        failed, self._streams = self._streams, {}
        for stream in failed.values():
            if stream.held is not None:  # the tokens made before the failure come first, as in _stream_items
                _put(stream, stream.held)
            _put(stream, exc)
        with self._lock:
            self._live.difference_update(failed)
        self._stats = engine.stats()


def _collect_freed() -> None:
    """Free a dropped engine's tensors now (its objects hold reference cycles) and hand the pages back."""
    gc.collect()
    release_freed_memory()


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


def _coalesce(
    output: RequestOutput, queue: asyncio.Queue[RequestOutput | BaseException]
) -> tuple[RequestOutput, BaseException | None]:
    """``output`` with the outputs already queued behind it folded in, and an error met there.

    A caller that fell behind (a busy event loop, a slow client) then takes several steps'
    tokens in one output, and writes them as one message, instead of paying a message per token
    and falling further behind, as vLLM's output collector does. A caller that keeps up sees
    one output per step as before."""
    while not output.finished and not queue.empty():
        later = queue.get_nowait()
        if isinstance(later, BaseException):
            return output, later
        output = _merged(output, later)
    return output, None


def _merged(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: each choice's text, tokens and logprobs
    joined in order, everything else (finished, stats, error) from the later one."""
    deltas = {d.index: dataclasses.replace(d, token_ids=list(d.token_ids), logprobs=list(d.logprobs))
              for d in first.deltas}
    for delta in later.deltas:
        into = deltas.get(delta.index)
        if into is None:
            deltas[delta.index] = delta
            continue
        into.text += delta.text
        into.token_ids.extend(delta.token_ids)
        into.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            into.finish_reason, into.stop_reason = delta.finish_reason, delta.stop_reason
    return dataclasses.replace(
        later,
        deltas=list(deltas.values()),
        num_prompt_tokens=later.num_prompt_tokens or first.num_prompt_tokens,
        stats=later.stats or first.stats,
    )


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
