"""TensorParallelRunner: one ModelRunner per rank, rank 0's steps broadcast to the others.

Rank 0 runs the normal engine (scheduler, sampler, ModelRunner.execute); a forward pre-hook on
its model broadcasts each step's ForwardBatch before the forward runs. The other ranks sit in
``serve_steps``, receiving each batch and running the same forward on their shard with their
own KV cache (block ids are rank 0's: every rank's pool has the same number of blocks, since
they share the engine config and the sharded model's KV heads), discarding the logits. The
row-parallel layers' all-reduces keep the ranks in step within a forward.

``make_runner`` is the engine's one choice between this and the plain ModelRunner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from protoserve.engine.config import EngineConfig
from protoserve.engine.execution.model_runner import ModelRunner
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.parallel import ranks
from protoserve.engine.parallel.step_channel import StepChannel
from protoserve.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)

# How long a shutdown waits for a step in flight to finish broadcasting.
SHUTDOWN_WAIT_S = 30.0


def make_runner(model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                quantization: str = "none", device: torch.device | None = None) -> ModelRunner:
    """The engine's runner (ModelRunner's arguments): a TensorParallelRunner when
    ``config.tensor_parallel_size`` > 1."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(model, model_config, config, dtype, quantization, device)
    return TensorParallelRunner(model, model_config, config, dtype, quantization, device)


class TensorParallelRunner(ModelRunner):
    """A ModelRunner over one rank's shard; rank 0's broadcasts each step, the others serve them."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 dtype: torch.dtype, quantization: str = "none", device: torch.device | None = None) -> None:
        group = ranks.current()
        size = config.tensor_parallel_size
        if group is None or group.world_size != size:
            raise ValueError(f"tensor_parallel_size {size} needs its ranks joined and the model sharded: "
                             "load it with LLMEngine.from_pretrained")
        shard = getattr(model, "tensor_parallel", None)
        if shard is None or (shard.rank, shard.world_size) != (group.rank, size):
            raise ValueError(f"tensor_parallel_size {size}: the model is not sharded for rank {group.rank} of {size}")
        model.fused_step = None  # the fused C++ step is single-rank
        self.group = group
        self.rank = group.rank
        self._closed = False
        try:
            # The sharded model's config is the local one: the KV cache holds this rank's heads only.
            super().__init__(model, model.config, config, dtype, quantization, device)
        except BaseException:
            self._fail()
            raise
        self.channel = StepChannel(group.control, self.device)
        failed = group.report_ready(True)
        if failed:
            self._fail(reported=True)
            raise RuntimeError(f"tensor-parallel rank(s) {failed} failed to build their engine "
                               "(their errors are in this log)")
        group.runner = self
        if self.rank == 0:
            model.register_forward_pre_hook(self._broadcast_step)

    def _fail(self, reported: bool = False) -> None:
        """This rank's engine cannot serve: tell the others (unless they were told) and, on rank 0, stop them."""
        if not reported:
            self.group.report_ready(False)
        if self.rank == 0:
            ranks.leave()

    # ModelRunner.lora_slots_of, refused: adapters are not sharded.
    @property
    def lora_slots_of(self) -> Callable[[list[Sequence]], list[int]] | None:
        return None

    @lora_slots_of.setter
    def lora_slots_of(self, value: Callable[[list[Sequence]], list[int]] | None) -> None:
        if value is not None:
            raise ValueError("LoRA adapters are not served with tensor_parallel_size > 1 "
                             "(tensor parallelism of adapters is not built)")

    def _broadcast_step(self, module: torch.nn.Module, args: tuple) -> None:
        if self._closed:
            raise RuntimeError("the tensor-parallel ranks are shut down")
        self.channel.send(args[0])

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """A rank other than 0: run rank 0's steps until it shuts the ranks down, then leave them."""
        if self.rank == 0:
            raise RuntimeError("rank 0 schedules the steps; it does not serve them")
        try:
            while True:
                try:
                    batch = self.channel.receive()
                except RuntimeError as e:  # rank 0's end of the connection closed: it is gone
                    log.error("tensor-parallel rank %d: rank 0 is gone (%s); exiting", self.rank,
                              str(e).splitlines()[0])
                    raise SystemExit(1) from None
                if batch is None:
                    break
                self.model(batch, self.kv_cache)
        finally:
            self._closed = True
            ranks.leave()

    def close(self) -> None:
        """Rank 0: stop the other ranks and leave the process group (idempotent)."""
        if self._closed or self.rank != 0:
            return
        self._closed = True
        try:
            if not self.channel.send_shutdown(SHUTDOWN_WAIT_S):
                log.warning("a step held the tensor-parallel channel past %.0fs: terminating the workers",
                            SHUTDOWN_WAIT_S)
            grace = ranks.EXIT_GRACE_S
        except RuntimeError as e:  # a worker already gone: the others are stopped below
            log.warning("tensor-parallel shutdown: %s", e)
            grace = 0.0
        ranks.leave(grace)
