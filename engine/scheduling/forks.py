"""Forking a request's ``n`` choices: one sequence prefills the prompt, and when the prompt's
logits arrive the other choices fork off it, sharing its full KV blocks and sampling their
first token from its logits row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from protoserve.engine.scheduling.logits_rows import SampleRow
from protoserve.engine.scheduling.scheduler import Scheduler
from protoserve.engine.scheduling.sequence import Sequence

if TYPE_CHECKING:
    from llguidance import LLMatcher

# Builds choice ``index`` of the parent's request, starting from the parent's tokens, with this matcher.
NewChoice = Callable[[Sequence, int, "LLMatcher | None"], Sequence]


def fork_pending_choices(rows: list[SampleRow], scheduler: Scheduler, new_choice: NewChoice) -> list[SampleRow]:
    """``rows`` with the choices each one still owes forked off right after it, on the same rows."""
    out: list[SampleRow] = []
    for row in rows:
        out.append(row)
        parent = row.seq
        for index in range(1, parent.num_pending_forks + 1):
            # The parent has taken no token yet: a copy of its matcher is a fresh one.
            matcher = parent.matcher.deep_copy() if parent.matcher is not None else None
            child = new_choice(parent, index, matcher)
            scheduler.fork(parent, child)
            out.append(replace(row, seq=child))
        parent.num_pending_forks = 0
    return out
