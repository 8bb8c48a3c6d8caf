"""ComputeGate: whose work runs on the CPU's cores right now, the engine's forward or background work.

The engine's decode loop and the embedding model share a few cores. Run together, each with its own
OpenMP team, they slow each other down several times over, and every decode step of every stream
waits on a whole embedding batch: streams stalled for most of a second while documents were being
indexed. So they take turns instead: background work (embedding) runs in small units (one encoder
layer over a micro-batch), each unit inside ``background()``; the engine's forward runs inside
``engine()``. The engine goes first whenever it waits, but after each of its forwards a waiting
background unit gets one turn, so indexing keeps moving while streams decode, one unit per step,
and a decode step waits at most one unit. With the engine idle, background work runs back to back.

One gate per process (``CPU_GATE``): every engine and embedding model in a process shares its cores.
A server with several models has an engine (a decode loop, a thread) per model; their forwards take
the cores in the order they asked for them. Each engine asks again only after its forward and its
sampling, so while two engines have work they alternate, one forward each: each model gets half the
steps, and a step of one waits at most one step of the other (and one background unit).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

# The engine counts as decoding while its last forward started less than this long ago.
ENGINE_ACTIVE_S = 0.5


class ComputeGate:
    """Mutual exclusion between engine forwards and background units, engine first, alternating;
    engine forwards in the order they asked."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._engine_waiting = 0
        self._engine_queue: deque[object] = deque()  # a token per waiting forward, in asking order
        self._background_waiting = 0
        self._background_turn = False  # set when an engine forward ends with background work waiting
        self._engine_started = float("-inf")  # monotonic time of the last engine forward's start

    def waiting(self) -> tuple[int, int]:
        """How many engine forwards and background units wait for the cores now."""
        with self._cond:
            return self._engine_waiting, self._background_waiting

    def engine_active(self) -> bool:
        """Whether the engine is decoding now: background work then keeps its units small."""
        return time.monotonic() - self._engine_started < ENGINE_ACTIVE_S

    @contextmanager
    def engine(self) -> Iterator[None]:
        """Hold the cores for one engine forward."""
        ticket = object()
        with self._cond:
            self._engine_waiting += 1
            self._engine_queue.append(ticket)
            while (
                self._busy
                or (self._background_turn and self._background_waiting)
                or self._engine_queue[0] is not ticket
            ):
                self._cond.wait()
            self._engine_queue.popleft()
            self._engine_waiting -= 1
            self._busy = True
            self._engine_started = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._background_turn = self._background_waiting > 0
                self._cond.notify_all()

    @contextmanager
    def background(self) -> Iterator[None]:
        """Hold the cores for one small unit of background work."""
        with self._cond:
            self._background_waiting += 1
            while self._busy or (self._engine_waiting and not self._background_turn):
                self._cond.wait()
            self._background_waiting -= 1
            self._busy = True
            self._background_turn = False
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


CPU_GATE = ComputeGate()
