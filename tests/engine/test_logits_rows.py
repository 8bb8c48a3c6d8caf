"""StepRows: each sampling sequence's logits rows, as the model runner lays them out; forked choices share them."""

from __future__ import annotations

import torch

from protoserve.engine.config import EngineConfig
from protoserve.engine.execution.model_runner import build_forward_batch
from protoserve.engine.sampling.sampling_params import SamplingParams
from protoserve.engine.scheduling.block_manager import BlockManager
from protoserve.engine.scheduling.forks import fork_pending_choices
from protoserve.engine.scheduling.logits_rows import DraftRows, SampleRow, StepRows
from protoserve.engine.scheduling.scheduler import ScheduledBatch, Scheduler
from protoserve.engine.scheduling.sequence import Sequence

BS = 4


def seq(seq_id: int, tokens: int, computed: int, drafts: int = 0, forks: int = 0) -> Sequence:
    s = Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, token_ids=list(range(1, tokens + 1)),
                 num_prompt_tokens=tokens, max_len=64, sampling=SamplingParams(), generator=torch.Generator(),
                 num_computed_tokens=computed, num_pending_forks=forks)
    if drafts:
        s.add_drafts([7] * drafts)
    s.block_table = [seq_id * 8 + b for b in range(-(-s.num_tokens // BS))]
    return s


def test_rows_follow_the_runners_logits_layout():
    chunk = seq(0, tokens=10, computed=0)  # a prefill chunk that does not reach its last token: no row
    drafted = seq(1, tokens=6, computed=5, drafts=3)  # its last sampled token and 3 drafts to compute
    decoding = seq(2, tokens=5, computed=4)
    prefill = seq(3, tokens=3, computed=0)
    batch = ScheduledBatch(seqs=[chunk, drafted, decoding, prefill], num_new_tokens=[4, 4, 1, 3])
    rows = StepRows.of(batch)
    assert rows.plain == [SampleRow(decoding, logits_row=4, mask_row=0), SampleRow(prefill, logits_row=5, mask_row=1)]
    assert rows.drafted == [DraftRows(drafted, slice(0, 4))]
    # The rows name the token positions whose logits the runner returns, in its order.
    indices = build_forward_batch(batch.seqs, batch.num_new_tokens, BS).logits_indices.tolist()
    assert indices[rows.drafted[0].rows] == [4, 5, 6, 7]  # drafted's last sampled token, then its 3 drafts
    assert [indices[r.logits_row] for r in rows.plain] == [8, 11]  # decoding's one token; prefill's last


def test_forked_choices_follow_their_parent_on_its_rows():
    scheduler = Scheduler(EngineConfig(block_size=BS), BlockManager(64, BS))
    parent, alone = seq(0, tokens=6, computed=0, forks=2), seq(1, tokens=3, computed=0)
    for s in (parent, alone):
        s.block_table = []
        scheduler.add(s)
    rows = StepRows.of(scheduler.schedule())
    made = []

    def new_choice(p: Sequence, index: int, matcher) -> Sequence:
        child = seq(10 + index, tokens=p.num_tokens, computed=0)
        child.index, child.request_id = index, p.request_id
        made.append((p, index, matcher))
        return child

    forked = fork_pending_choices(rows.plain, scheduler, new_choice)
    assert [(r.seq.request_id, r.seq.index, r.logits_row, r.mask_row) for r in forked] == [
        ("r0", 0, 0, 0), ("r0", 1, 0, 0), ("r0", 2, 0, 0), ("r1", 0, 1, 1)]
    assert made == [(parent, 1, None), (parent, 2, None)]
    assert parent.num_pending_forks == 0
    assert [s.seq_id for s in scheduler.running] == [0, 1, 11, 12]  # forked choices run from now on
    assert fork_pending_choices(rows.plain, scheduler, new_choice) == rows.plain  # nothing owed twice
