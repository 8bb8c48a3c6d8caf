"""bench.cpu_usage: per-thread CPU time from /proc, split the way the serving figures print it."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from bench import cpu_usage

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _burn(cpu_seconds: float) -> None:
    """Spin until this thread has used ``cpu_seconds`` of CPU (not wall time: a busy CI still gets there)."""
    start = time.thread_time()
    while time.thread_time() - start < cpu_seconds:
        pass


def test_worker_thread_time_counts_as_other_and_main_thread_time_as_loop() -> None:
    pid = os.getpid()  # this process stands in for the server: its main thread is the "loop"
    before = cpu_usage.snapshot(pid)
    worker = threading.Thread(target=_burn, args=(0.3,))
    worker.start()
    worker.join()
    middle = cpu_usage.snapshot(pid)
    _burn(0.3)
    after = cpu_usage.snapshot(pid)
    assert before is not None and middle is not None and after is not None

    # Clock ticks are 10 ms: allow a few of them either way.
    assert middle.server_other_s - before.server_other_s == pytest.approx(0.3, abs=0.05)
    assert middle.server_loop_s - before.server_loop_s < 0.05
    assert after.server_loop_s - middle.server_loop_s == pytest.approx(0.3, abs=0.05)
    assert after.server_other_s - middle.server_other_s < 0.05
    # The whole process (the bench's own figure) saw both.
    assert after.bench_s - before.bench_s == pytest.approx(0.6, abs=0.08)


def test_usage_details_per_token_and_idle_share() -> None:
    start = cpu_usage.CpuSnapshot(machine_busy=1000, machine_idle=500, server_loop_s=1.0, server_other_s=2.0, bench_s=3.0)
    end = cpu_usage.CpuSnapshot(machine_busy=1150, machine_idle=550, server_loop_s=1.2, server_other_s=3.0, bench_s=3.1)
    details = cpu_usage.usage_details(start, end, tokens=100)
    assert details == {
        "server_loop_cpu_ms_per_tok": 2.0,
        "server_other_cpu_ms_per_tok": 10.0,
        "bench_cpu_ms_per_tok": 1.0,
        "idle_pct": 25.0,
    }
    assert cpu_usage.usage_details(start, None, tokens=100) == {}
    assert cpu_usage.usage_details(start, end, tokens=0) == {}


def test_usage_over_several_spans_adds_them_up() -> None:
    snap = cpu_usage.CpuSnapshot
    spans = [
        (snap(1000, 500, 1.0, 2.0, 3.0), snap(1150, 550, 1.2, 3.0, 3.1)),
        # A later run: the time between the spans (another path's run) is not counted.
        (snap(5000, 900, 9.0, 9.0, 9.0), snap(5050, 950, 9.1, 9.5, 9.3)),
    ]
    details = cpu_usage.usage_over(spans, tokens=200)
    assert details["server_loop_cpu_ms_per_tok"] == pytest.approx((0.2 + 0.1) * 1000 / 200)
    assert details["server_other_cpu_ms_per_tok"] == pytest.approx((1.0 + 0.5) * 1000 / 200)
    assert details["bench_cpu_ms_per_tok"] == pytest.approx((0.1 + 0.3) * 1000 / 200)
    assert details["idle_pct"] == 33.3  # 100 idle jiffies of 300
    assert cpu_usage.usage_over([spans[0]], 100) == cpu_usage.usage_details(*spans[0], tokens=100)
    assert cpu_usage.usage_over([spans[0], (spans[1][0], None)], 200) == {}


def test_snapshot_of_a_gone_server_is_none() -> None:
    # A pid no process has: the server died mid-run, and the figure goes without CPU details.
    with open("/proc/sys/kernel/pid_max") as f:
        gone = int(f.read()) + 1
    assert cpu_usage.snapshot(gone) is None
    assert cpu_usage.snapshot(None) is not None  # no server: machine and bench counters only
