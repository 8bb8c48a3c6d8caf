"""The entry points of tensor parallelism for LLMEngine.from_pretrained (and a torchrun CLI).

``join_tensor_parallel`` runs before the model loads: at ``tensor_parallel_size`` 1 it does
nothing; otherwise it refuses a model the ranks cannot split (from its config alone, before any
rank starts or loads weights), then joins the ranks (from torchrun's environment, or as rank 0 spawning the
others) and returns the function that shards the loaded model for this rank, which load_model
applies between quantization and packing. ``serve_worker_rank`` runs once the engine is built:
on rank 0 it returns at once; on any other rank it serves rank 0's steps until the shutdown
message, then ends the process (SystemExit 0), since a worker rank has nothing else to do.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from protoserve.engine.config import EngineConfig
from protoserve.engine.loader.checkpoint_config import read_model_config
from protoserve.engine.parallel import ranks
from protoserve.engine.parallel.runner import TensorParallelRunner
from protoserve.engine.parallel.shard_plan import check_shardable
from protoserve.engine.parallel.sharding import shard_decoder
from protoserve.engine.parallel.spawn import WorkerSpec, spawn_workers

if TYPE_CHECKING:
    from protoserve.engine.llm_engine import LLMEngine
    from protoserve.engine.models.decoder import Decoder

ShardFn = Callable[["Decoder"], None]


def join_tensor_parallel(model_path: str | os.PathLike[str] | None, dtype: str, quantization: str,
                         config: EngineConfig) -> ShardFn | None:
    """Join (or start) the ranks for ``config.tensor_parallel_size``; this rank's shard function,
    None at size 1."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    check_shardable(read_model_config(model_path), size)
    env = ranks.rank_env()
    if env is not None:
        if env.world_size != size:
            raise ValueError(f"tensor_parallel_size {size} does not match WORLD_SIZE {env.world_size} "
                             "of the environment (torchrun --nproc-per-node)")
        group = ranks.join_from_env(env, config.device)
    else:
        store, port = ranks.host_store(size)
        spec = WorkerSpec(None if model_path is None else os.fspath(model_path), dtype, quantization, config,
                          port, os.getpid(), torch.get_num_threads())
        group = ranks.join_as_spawner(store, size, config.device, spawn_workers(spec))
    if group.rank == 0:
        atexit.unregister(close_ranks)  # once, however many engines this process has built
        atexit.register(close_ranks)
    return functools.partial(_shard, rank=group.rank, world_size=size)


def _shard(model: Decoder, rank: int, world_size: int) -> None:
    try:
        shard_decoder(model, rank, world_size)
    except BaseException:
        if rank == 0:  # every rank refuses alike: stop the workers rather than leave them waiting
            ranks.leave()
        raise


def close_ranks() -> None:
    """Rank 0: tell the workers to stop, wait for them, leave the process group (idempotent)."""
    group = ranks.current()
    if group is None or group.rank != 0:
        return
    if isinstance(group.runner, TensorParallelRunner):
        group.runner.close()
    else:
        ranks.leave()


def serve_worker_rank(engine: LLMEngine) -> None:
    """On a rank other than 0, serve rank 0's steps and exit the process; on rank 0, return."""
    runner = engine.runner
    if not isinstance(runner, TensorParallelRunner) or runner.rank == 0:
        return
    runner.serve_steps()
    raise SystemExit(0)


def torchrun_worker_rank() -> bool:
    """Whether this process is a torchrun rank other than 0 (it must serve steps, not requests)."""
    env = ranks.rank_env()
    return env is not None and env.rank != 0


def run_worker_rank(model_path: str | None, *, dtype: str, quantization: str, config: EngineConfig) -> int:
    """A rank other than 0 (torchrun's, or one rank 0 spawned): build the engine with rank 0's own
    arguments, which serves rank 0's steps until it shuts the ranks down; returns the exit code."""
    from protoserve.engine.llm_engine import LLMEngine

    # The draft model of speculative decoding runs on rank 0 only, unsharded.
    config = dataclasses.replace(config, speculative_model=None)
    try:
        LLMEngine.from_pretrained(model_path, dtype=dtype, quantization=quantization, config=config, progress=False)
    except SystemExit as e:
        return int(e.code or 0)
    except BaseException as e:
        group = ranks.current()
        if group is not None and not group.ready:  # rank 0 waits for every rank's word before serving
            print(f"protoserve tensor-parallel rank {group.rank}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            group.report_ready(False)
        raise
    raise RuntimeError("from_pretrained returned on a worker rank")
