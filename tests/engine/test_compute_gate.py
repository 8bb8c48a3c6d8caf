"""ComputeGate: engine forwards and background units never overlap; a waiting engine goes first, but a
waiting background unit gets one turn after each engine forward, so neither starves."""

from __future__ import annotations

import threading
import time

from protoserve.engine.execution.compute_gate import ComputeGate


def test_engine_and_background_alternate_without_overlap():
    gate = ComputeGate()
    log: list[str] = []
    inside = threading.Lock()
    stop = threading.Event()

    def work(kind: str, enter, seconds: float) -> None:
        while not stop.is_set():
            with enter():
                assert inside.acquire(blocking=False), "two holders at once"
                log.append(kind)
                if len(log) >= 60:  # a count of turns, not a time: a loaded machine takes longer, not fewer
                    stop.set()
                time.sleep(seconds)  # the unit's work, so the other kind is waiting when it ends
                inside.release()

    threads = [
        threading.Thread(target=work, args=("E", gate.engine, 0.004)),
        threading.Thread(target=work, args=("B", gate.background, 0.002)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Both back to back: turns alternate, so each kind got about half of them and the engine
    # never waited for two background units in a row.
    assert log.count("E") > 20 and log.count("B") > 20
    assert "BB" not in "".join(log)


def test_background_runs_back_to_back_while_the_engine_idles():
    gate = ComputeGate()
    done = threading.Event()

    def units() -> None:
        for _ in range(100):
            with gate.background():
                pass
        done.set()

    threading.Thread(target=units, daemon=True).start()
    assert done.wait(30), "a background unit waited with the engine idle"
    assert not gate.engine_active()
    with gate.engine():
        pass
    assert gate.engine_active()


def until(condition, timeout: float = 10.0) -> None:
    """Wait for ``condition`` (another thread's progress), failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)


def test_a_waiting_engine_goes_before_a_waiting_background_unit():
    gate = ComputeGate()
    order: list[str] = []
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with gate.background():
            held.set()
            release.wait()

    def enter(kind: str, context) -> None:
        with context():
            order.append(kind)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    background = threading.Thread(target=enter, args=("B", gate.background), daemon=True)
    background.start()
    until(lambda: gate.waiting() == (0, 1))
    engine = threading.Thread(target=enter, args=("E", gate.engine), daemon=True)
    engine.start()
    until(lambda: gate.waiting() == (1, 1))
    release.set()  # the holder leaves: the engine, though it came last, goes first
    for thread in (holder, background, engine):
        thread.join(10)
    assert order == ["E", "B"]


def test_engines_take_turns_in_the_order_they_asked():
    """Two engines (a decode loop each) with work: one forward each, in turn, neither twice in a row."""
    gate = ComputeGate()
    log: list[str] = []
    finished: set[str] = set()

    def decode_loop(name: str, other: str) -> None:
        for _ in range(30):
            with gate.engine():
                log.append(name)
                # Hold the cores until the other engine asks for them (or is done): each release
                # then finds it waiting, as a busy model's decode loop is.
                until(lambda: gate.waiting()[0] > 0 or other in finished)
        finished.add(name)

    threads = [threading.Thread(target=decode_loop, args=pair) for pair in (("A", "B"), ("B", "A"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    sequence = "".join(log)
    assert sequence.count("A") == sequence.count("B") == 30
    assert "AA" not in sequence and "BB" not in sequence, sequence
