"""The turn loop: every user of a plan holds its conversation at once, each turn carrying the history.

A user waits its start offset, then per turn appends its message to the
history, sends the whole history, and appends the answer the server returned
(its real text, so the next prompt is what a chat client would send) before
thinking and sending the next. A failed turn ends that user's conversation: its
history would no longer be one the server produced. No turn starts after the
deadline; turns in flight finish, so their latencies are real. ``sleep`` and
``clock`` are injected so the loop can run on a scripted clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.peers.conversation_plan import ConversationPlan, UserScript
from bench.peers.turn_transport import Message, TurnReply, TurnTransport

Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], float]


@dataclass(frozen=True)
class TurnRecord:
    """One sent turn: whose, which (1-based), and what came back."""

    user: int
    turn: int
    reply: TurnReply

    @property
    def prompt_tokens(self) -> int:
        return self.reply.timeline.prompt_tokens


async def run_user(
    transport: TurnTransport, plan: ConversationPlan, user: int, deadline: float,
    sleep: Sleep = asyncio.sleep, clock: Clock = time.perf_counter,
) -> list[TurnRecord]:  # fmt: skip
    """One user's conversation; returns its turns in order."""
    script: UserScript = plan.users[user]
    history: list[Message] = [{"role": "system", "content": plan.system}]
    records: list[TurnRecord] = []
    await sleep(script.start_s)
    for turn, message in enumerate(script.messages, start=1):
        if turn > 1:
            await sleep(script.think_s[turn - 2])
        if clock() >= deadline:
            break
        history.append({"role": "user", "content": message})
        reply = await transport.send(list(history), plan.answer_tokens)
        records.append(TurnRecord(user, turn, reply))
        if not reply.timeline.ok:
            break
        history.append({"role": "assistant", "content": reply.text})
    return records


async def run_conversations(
    transport: TurnTransport, plan: ConversationPlan, max_seconds: float,
    sleep: Sleep = asyncio.sleep, clock: Clock = time.perf_counter,
) -> list[TurnRecord]:  # fmt: skip
    """Every user of ``plan`` at once; returns all their turns, user by user."""
    deadline = clock() + max_seconds
    per_user = await asyncio.gather(
        *(run_user(transport, plan, u, deadline, sleep, clock) for u in range(len(plan.users)))
    )
    return [record for records in per_user for record in records]
