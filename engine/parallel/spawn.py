"""Rank 0 starting ranks 1..N-1 as processes of its own (``protoserve serve --tensor-parallel-size N``).

Each worker is a ``spawn``ed daemon process that puts its assignment in its environment as
torchrun would, then builds its engine through ``LLMEngine.from_pretrained`` with rank 0's own
arguments, so it loads the same model with the same options and takes its shard on the way
(engine/parallel/launch.py); it then serves rank 0's steps until the shutdown message.

No worker outlives rank 0: a normal exit of rank 0 sends the shutdown message (an ``atexit``
handler) and multiprocessing terminates daemon children; if rank 0 dies outright, the worker's
next collective fails on the closed connection, and a watchdog thread exits the worker as soon
as its parent is gone (it may be loading, outside any collective).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from protoserve.engine.config import EngineConfig
from protoserve.engine.parallel.ranks import MASTER_ADDR, SPAWNED_ENV

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build the same engine as rank 0 (from_pretrained's arguments)."""

    model_path: str | None
    dtype: str
    quantization: str
    config: EngineConfig
    master_port: int
    parent_pid: int
    num_threads: int  # rank 0's intra-op threads


def spawn_workers(spec: WorkerSpec) -> list[BaseProcess]:
    """Start ranks 1..N-1 (N = ``spec.config.tensor_parallel_size``)."""
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, spec.config.tensor_parallel_size):
        p = ctx.Process(target=worker_main, args=(spec, rank), name=f"protoserve-tp-rank{rank}", daemon=True)
        p.start()
        workers.append(p)
    return workers


def worker_main(spec: WorkerSpec, rank: int) -> None:
    """A spawned worker's whole life: join, load, serve steps; exits when rank 0 says so or is gone."""
    os.environ.update({
        "RANK": str(rank),
        "WORLD_SIZE": str(spec.config.tensor_parallel_size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(spec.master_port),
        SPAWNED_ENV: "1",
    })
    _watch_parent(spec.parent_pid)
    torch.set_num_threads(spec.num_threads)
    from protoserve.engine.parallel.launch import run_worker_rank

    sys.exit(run_worker_rank(spec.model_path, dtype=spec.dtype, quantization=spec.quantization, config=spec.config))


def _watch_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)  # rank 0 is gone: nothing to serve

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
