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
                time.sleep(seconds)
                inside.release()

    threads = [
        threading.Thread(target=work, args=("E", gate.engine, 0.004)),
        threading.Thread(target=work, args=("B", gate.background, 0.002)),
    ]
    for t in threads:
        t.start()
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    # Both back to back: turns alternate, so each kind got about half of them and the engine
    # never waited for two background units in a row.
    assert log.count("E") > 20 and log.count("B") > 20
    assert "BB" not in "".join(log)


def test_background_runs_back_to_back_while_the_engine_idles():
    gate = ComputeGate()
    started = time.perf_counter()
    for _ in range(100):
        with gate.background():
            pass
    assert time.perf_counter() - started < 0.5
    assert not gate.engine_active()
    with gate.engine():
        pass
    assert gate.engine_active()


def test_a_waiting_engine_goes_before_a_waiting_background_unit():
    gate = ComputeGate()
    order: list[str] = []
    release = threading.Event()

    def hold() -> None:
        with gate.background():
            release.wait()

    def enter(kind: str, context) -> None:
        with context():
            order.append(kind)
            time.sleep(0.05)

    threads = [
        threading.Thread(target=hold, daemon=True),
        threading.Thread(target=enter, args=("B", gate.background), daemon=True),
        threading.Thread(target=enter, args=("E", gate.engine), daemon=True),
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # the holder first, then the background unit waits, then the engine
    release.set()  # the holder leaves: the engine, though it came last, goes first
    for thread in threads:
        thread.join(2)
    assert order == ["E", "B"]
