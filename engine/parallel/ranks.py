"""This process's place among the tensor-parallel ranks: joining the process group and leaving it.

Two ways in:

* spawned (``protoserve serve --tensor-parallel-size N``): rank 0 hosts a TCP store on
  127.0.0.1 at a free port and starts ranks 1..N-1 (engine/parallel/spawn.py); each worker
  writes ``joined/<rank>`` to the store before the collective rendezvous, so rank 0 can tell a
  worker that died on the way from one that is slow, instead of waiting out a timeout;
* torchrun: RANK, WORLD_SIZE and LOCAL_RANK (with MASTER_ADDR/MASTER_PORT) are in the
  environment and every rank joins with ``env://``; torchrun owns the processes.

Activations are all-reduced over the default group (``gloo`` on cpu, ``nccl`` on cuda); rank
0's steps go over a second, gloo group (engine/parallel/step_channel.py) whose timeout is a
year, since a worker of an idle server waits for its next step for as long as nobody asks.
One tensor-parallel engine per process: ``torch.distributed`` has one default group.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

MASTER_ADDR = "127.0.0.1"
# How long rank 0 waits for spawned workers to reach the store, and every rank for the others at
# a collective of the default group (loading runs before the first one on every rank alike).
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
IDLE_TIMEOUT = datetime.timedelta(days=365)
# Environment of a worker rank that rank 0 spawned itself (rather than torchrun).
SPAWNED_ENV = "PROTOSERVE_TP_SPAWNED"
# How long close() waits for workers to leave after the shutdown message.
EXIT_GRACE_S = 10.0


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


@dataclass(frozen=True)
class RankEnv:
    """A rank's assignment as torchrun (or rank 0's spawn) puts it in the environment."""

    rank: int
    world_size: int
    local_rank: int
    spawned: bool  # by rank 0 (spawn.py), not by torchrun


def rank_env() -> RankEnv | None:
    """The environment's assignment, or None when RANK is unset (this process is rank 0 of its own)."""
    if "RANK" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError) as e:
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers for tensor parallelism: {e}") from e
    return RankEnv(rank, world, local, os.environ.get(SPAWNED_ENV) == "1")


@dataclass
class RankGroup:
    """The joined ranks, as this process sees them."""

    rank: int
    world_size: int
    backend: str
    control: dist.ProcessGroup  # gloo, for rank 0's step messages
    workers: list[BaseProcess] = field(default_factory=list)  # processes this rank spawned
    runner: object | None = None  # the TensorParallelRunner once built (engine/parallel/runner.py)
    ready: bool = False  # every rank reported its engine built

    def report_ready(self, ok: bool) -> list[int]:
        """Every rank says whether its engine was built; returns the ranks that failed."""
        flags = torch.zeros(self.world_size, dtype=torch.int64)
        flags[self.rank] = 0 if ok else 1
        dist.all_reduce(flags, group=self.control)
        self.ready = True
        return [r for r, f in enumerate(flags.tolist()) if f]

    def workers_alive(self) -> list[int]:
        return [p.pid for p in self.workers if p.is_alive()]


_current: RankGroup | None = None


def current() -> RankGroup | None:
    """The ranks this process has joined, if any."""
    return _current


def _finish_join(rank: int, world_size: int, backend: str, workers: list[BaseProcess]) -> RankGroup:
    global _current
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _current = RankGroup(rank, world_size, backend, control, workers)
    return _current


def _select_device(device: str, local_rank: int) -> None:
    """On cuda, this rank's GPU becomes the current one (the one resolve_device then names)."""
    if device == "cuda":
        torch.cuda.set_device(local_rank)


def join_from_env(env: RankEnv, device: str) -> RankGroup:
    """Join as the environment says (a torchrun rank, or a worker rank 0 spawned)."""
    _check_free()
    backend = backend_for(device)
    _select_device(device, env.local_rank)
    if env.spawned:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                              is_master=False, timeout=JOIN_TIMEOUT)
        store.set(f"joined/{env.rank}", "1")
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=JOIN_TIMEOUT)
    else:
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=JOIN_TIMEOUT)
    return _finish_join(env.rank, env.world_size, backend, [])


def host_store(world_size: int) -> tuple[dist.TCPStore, int]:
    """Rank 0's store on 127.0.0.1 at a port the OS picks; returns it and the port."""
    store = dist.TCPStore(MASTER_ADDR, 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=JOIN_TIMEOUT)
    return store, store.port


def join_as_spawner(store: dist.TCPStore, world_size: int, device: str, workers: list[BaseProcess]) -> RankGroup:
    """Rank 0 of workers it spawned: wait for each to reach the store (or fail), then join."""
    _check_free()
    keys = [f"joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
    while not store.check(keys):
        dead = [(r, p.exitcode) for r, p in enumerate(workers, start=1) if p.exitcode is not None]
        if dead or time.monotonic() > deadline:
            _stop(workers)
            what = ", ".join(f"rank {r} exited with code {c}" for r, c in dead) or "timed out"
            raise RuntimeError(f"tensor-parallel workers did not start: {what} (their errors are in this log)")
        time.sleep(0.05)
    backend = backend_for(device)
    _select_device(device, 0)
    dist.init_process_group(backend, store=store, rank=0, world_size=world_size, timeout=JOIN_TIMEOUT)
    return _finish_join(0, world_size, backend, workers)


def _check_free() -> None:
    if _current is not None and _current.runner is not None:
        raise RuntimeError("a tensor-parallel engine already runs in this process; close its runner first")
    if _current is not None:  # ranks left by an engine whose construction failed
        leave()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")


def _stop(workers: list[BaseProcess], grace_s: float = 0.0) -> None:
    """Wait up to ``grace_s`` for the workers to exit, then terminate the rest."""
    deadline = time.monotonic() + grace_s
    for p in workers:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in workers:
        if p.is_alive():
            p.terminate()
    for p in workers:
        p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join()


def leave(grace_s: float = 0.0) -> None:
    """Leave the ranks: wait for spawned workers (``grace_s``; they were told to stop), terminate any
    left, destroy the process groups. Idempotent."""
    global _current
    group, _current = _current, None
    if group is not None:
        _stop(group.workers, grace_s)
    if dist.is_initialized():
        dist.destroy_process_group()
