"""Tensor parallelism on torch.distributed: one model sharded over N ranks (processes).

* sharding.py: a loaded Decoder's heads and MLP columns split in place for one rank;
  linear_slices.py slices one layer in any weight format, row_parallel.py sums partial products.
* step_channel.py: rank 0's ForwardBatch broadcast to the other ranks each step.
* runner.py: the TensorParallelRunner (a ModelRunner per rank) and ``make_runner``.
* ranks.py: joining and leaving the process group (spawned ranks or torchrun's).
* spawn.py: rank 0 starting the other ranks as processes; launch.py: the entry points
  LLMEngine.from_pretrained calls.
"""
