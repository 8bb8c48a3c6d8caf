"""ModelRunner: owns the model and its paged KV cache, turns a scheduled step into one forward.

``build_forward_batch`` is the pure part: the new tokens of every scheduled
sequence flattened into one ForwardBatch (integer tensors only), with a logits
row for each sequence whose new tokens reach its last token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from protoserve.engine.config import EngineConfig, resolve_num_blocks
from protoserve.engine.execution.compute_gate import CPU_GATE
from protoserve.engine.execution.cuda_graphs import DecodeGraphs
from protoserve.engine.execution.forward_batch import ForwardBatch
from protoserve.engine.models.config import ModelConfig
from protoserve.engine.models.kv_cache import PagedKVCache, resolve_kv_dtype
from protoserve.engine.scheduling.sequence import Sequence


def build_forward_batch(seqs: list[Sequence], num_new_tokens: list[int], block_size: int,
                        lora_slots: list[int] | None = None) -> ForwardBatch:
    """Flatten one step: sequence i computes tokens ``[computed_i, computed_i + new_i)`` of its own.

    ``lora_slots`` gives each sequence's LoRA slot (engine/lora), repeated onto its tokens. Python
    lists are gathered once per sequence and the rest is whole-batch NumPy: this runs on the host
    before every forward (bench/sections/host_loop.py measures it).
    """
    query_lens = list(num_new_tokens)
    starts = [s.num_computed_tokens for s in seqs]
    seq_lens = [c + n for c, n in zip(starts, query_lens, strict=True)]
    max_blocks = max(len(s.block_table) for s in seqs)
    token_list: list[int] = []
    table_list: list[int] = []
    logits_indices: list[int] = []
    end = 0
    for s, c, e in zip(seqs, starts, seq_lens, strict=True):
        token_list += s.token_ids[c:e]
        table_list += s.block_table
        table_list += [0] * (max_blocks - len(s.block_table))
        end += e - c
        if e == len(s.token_ids):  # the last known token is computed: its logits give the next one
            # A speculative row also wants the logits after each of its drafts, to verify them.
            logits_indices.extend(range(end - 1 - s.num_draft_tokens, end))
    query_start_loc = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    lens = np.asarray(query_lens, dtype=np.int64)
    owner = np.repeat(np.arange(len(seqs)), lens)  # the sequence of each new token
    # Token j of sequence i sits at position starts[i] + (j - query_start_loc[i]).
    positions = np.arange(len(token_list), dtype=np.int64) + np.repeat(
        np.asarray(starts, dtype=np.int64) - query_start_loc[:-1], lens)
    block_tables = np.asarray(table_list, dtype=np.int32).reshape(len(seqs), max_blocks)
    slot_mapping = block_tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return ForwardBatch(
        input_ids=torch.from_numpy(np.asarray(token_list, dtype=np.int64)),
        positions=torch.from_numpy(positions),
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.from_numpy(block_tables),
        slot_mapping=torch.from_numpy(slot_mapping),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        lora_slots=None if lora_slots is None else torch.from_numpy(
            np.repeat(np.asarray(lora_slots, dtype=np.int64), query_lens)),
    )


class ModelRunner:
    """Runs the decoder over the paged KV cache it preallocates from the engine's memory budget."""

    def __init__(self, model: torch.nn.Module, model_config: ModelConfig, config: EngineConfig,
                 dtype: torch.dtype, quantization: str = "none", device: torch.device | None = None) -> None:
        self.model = model
        # The model's device (engine/execution/device.py): the KV pool, each step's batch and its logits
        # live there (the sampler brings back token ids, and the rows it samples on the host).
        self.device = device if device is not None else torch.device("cpu")
        self.model_config = model_config
        # Each sequence's LoRA slot, set by LLMEngine.enable_lora; None: no adapters.
        self.lora_slots_of: Callable[[list[Sequence]], list[int]] | None = None
        self.block_size = config.block_size
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype, quantization)
        if self.kv_dtype == torch.int8 and model_config.attn_logit_softcapping is not None:
            raise ValueError("kv_cache_dtype int8 cannot serve a model with soft-capped attention scores: "
                             "those take the PyTorch attention, which reads float32 and bfloat16 pools only")
        self.block_bytes = PagedKVCache.model_block_bytes(model_config, config.block_size, self.kv_dtype)
        self.num_blocks = resolve_num_blocks(config, self.block_bytes)
        # (Not under tensor parallelism: each step's broadcast to the other ranks runs on the host.)
        graphs = self.device.type == "cuda" and config.cuda_graphs and config.tensor_parallel_size == 1
        self.kv_cache = PagedKVCache.for_model(
            model_config,
            # Decode graphs pad their batches with rows that write to one more block, never handed out.
            num_blocks=self.num_blocks + (1 if graphs else 0),
            block_size=config.block_size,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.graphs = DecodeGraphs(
            model, self.kv_cache, config.max_num_seqs,
            max_blocks=min(self.num_blocks, -(-model_config.max_position_embeddings // config.block_size)),
            scratch_block=self.num_blocks,
        ) if graphs else None

    def close(self) -> None:
        """Release what outlives the engine's steps (other ranks, under tensor parallelism); here nothing."""

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int],
                input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One forward; returns float32 logits ``[S, vocab]`` on the model's device, one row per sequence that
        samples, in order. ``input_ids``: the new tokens' ids already on the device (async scheduling:
        last step's samples, not yet on the host), in place of the sequences' own."""
        lora_slots = self.lora_slots_of(seqs) if self.lora_slots_of is not None else None
        batch = build_forward_batch(seqs, num_new_tokens, self.block_size, lora_slots)
        if input_ids is not None:
            batch = replace(batch, input_ids=input_ids)
        with CPU_GATE.engine():  # background work (embedding) waits for the forward, not beside it
            if self.graphs is not None and self.graphs.accepts(batch):
                return self.graphs.run(batch).float()
            return self.model(batch.to(self.device), self.kv_cache).float()
