"""The server's event loop: uvloop where it is installed, asyncio's own otherwise.

Why: every streamed token costs the loop a wakeup, a queue hand-off and a gRPC
write, and through the gateway a second gRPC read and an HTTP chunk. On a
2-core machine the loop shares the cores with the engine's compute team, so its
cost per token comes out of throughput, and uvloop's is smaller (the measured
difference is in docs/notes/performance-log.md). ``--event-loop asyncio`` keeps the
standard loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


class EventLoopUnavailable(RuntimeError):
    """The loop asked for cannot be had here."""


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """What ``asyncio.Runner`` should build: uvloop's loop, or None for asyncio's default."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise EventLoopUnavailable(
                "--event-loop uvloop: uvloop is not installed (pip install uvloop; not on Windows)"
            ) from None
        return None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """'uvloop' or 'asyncio', for the startup log."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
