"""The contract between the engine and the model: one flattened batch per step.

The scheduler packs the new tokens of every scheduled sequence (a prefill
chunk of one, a single decode token of another) into one flat batch, so a
single forward serves both. Everything here is integer state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class ForwardBatch:
    """New tokens of B sequences, concatenated in sequence order (T tokens in all).

    Sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of the
    token tensors; its context after this step is ``seq_lens[i]`` tokens, the
    last ``query_lens[i]`` of which are new.
    """

    input_ids: torch.Tensor  # [T] int64 token ids
    positions: torch.Tensor  # [T] int64 absolute position of each token in its sequence
    query_start_loc: torch.Tensor  # [B+1] int32 prefix sums of new-token counts
    seq_lens: torch.Tensor  # [B] int32 context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32 KV block ids of each sequence, padded with 0
    slot_mapping: torch.Tensor  # [T] int64 cache slot (block_id * block_size + offset) for each new token
    logits_indices: torch.Tensor  # [S] int64 rows of T whose next-token logits are wanted
    # Host-side copies, so attention can loop over sequences without device syncs.
    query_lens_list: list[int]
    seq_lens_list: list[int]
    # [T] int64 LoRA slot of each token's sequence (engine/lora; -1: the base model alone); None: no adapters.
    lora_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> ForwardBatch:
        """The batch with its tensors on ``device`` (itself when they are there already)."""
        # (Async scheduling hands the runner input ids already on the device, the rest on the host.)
        if self.input_ids.device == device and self.positions.device == device:
            return self
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self,
            input_ids=move(self.input_ids),
            positions=move(self.positions),
            query_start_loc=move(self.query_start_loc),
            seq_lens=move(self.seq_lens),
            block_tables=move(self.block_tables),
            slot_mapping=move(self.slot_mapping),
            logits_indices=move(self.logits_indices),
            lora_slots=None if self.lora_slots is None else move(self.lora_slots),
        )
